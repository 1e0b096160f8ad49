# nanoserve: the two quick-start targets (`make demo`, `make test`) and their set-up.
# Each creates .venv when missing and installs what it needs: `make demo` the package alone
# (plus torch), `make test` the package with its test extra. Each has its own stamp file, so
# `make test` after `make demo` adds the test extra, and neither installs twice.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# --no-compile: pip does not compile every installed file to bytecode (about 30 s of 80 on
# 2 cores). What the demo's install put in the venv (the package's dependencies: Ray, torch,
# pyarrow, numpy, pandas and theirs) is compiled after it all the same, in parallel
# (COMPILE_JOB_MODULES): every process of a job imports them (Ray's GCS helpers, agents and
# workers, the worker's torch, and pandas with dateutil, pytz and numpy, which pyarrow imports
# in the worker's first `pa.array` of Python values), and without bytecode each compiles them
# again as it starts: on the first job of a fresh install, or on every job where
# PYTHONDONTWRITEBYTECODE is set. On a busy 2-core machine that made Ray's start and the
# worker's first batch minutes slower. The test extra (transformers, moto, ...) is not.
PIP := $(PY) -m pip
# (A file written for a newer Python, one of torch's tests, does not compile: `|| true`.)
COMPILE_JOB_MODULES = $(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; \
	print(sysconfig.get_paths()['purelib'])") > /dev/null || true
# torch 2.13, installed first so the package's own `torch>=2.4` is already met. On a machine
# without an NVIDIA GPU (no nvidia-smi) the CPU build, without CUDA libraries, where pip's
# configured index offers one (the `+cpu` local version), else the default wheel.
TORCH_SPEC ?= torch==2.13.*
TORCH_CPU_SPEC ?= torch==2.13.0+cpu
HAVE_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_NVIDIA),yes)
TORCH_INSTALL = $(PIP) install -q --no-compile "$(TORCH_SPEC)"
else
TORCH_INSTALL = $(PIP) install -q --no-compile "$(TORCH_CPU_SPEC)" 2>/dev/null \
	|| { echo "no CPU build of torch on the index: installing the default wheel"; \
	     $(PIP) install -q --no-compile "$(TORCH_SPEC)"; }
endif

.PHONY: demo test test-kernels lint bench setup setup-demo clean

# The package and torch: what the demo (and any job) needs.
$(VENV)/.installed-demo: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(TORCH_INSTALL)
	$(PIP) install -q --no-compile -e .
	$(COMPILE_JOB_MODULES)
	touch $@

# The test extra on top (pytest, transformers' oracles, moto, ...).
$(VENV)/.installed-test: $(VENV)/.installed-demo
	$(PIP) install -q --no-compile -e ".[test]"
	touch $@

setup-demo: $(VENV)/.installed-demo
setup: $(VENV)/.installed-test

# Run the main job: the batch job over examples/prompts.jsonl with the default model.
demo: setup-demo
	$(VENV)/bin/nanoserve batch examples/prompts.jsonl -o demo-output --overwrite --max-tokens 64

# The whole CPU test suite (GPU tests skip themselves without a GPU).
test: setup
	$(VENV)/bin/nanoserve fetch-model
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m benchmarks.cpu_generate

clean:
	rm -rf $(VENV) demo-output .pytest_cache
