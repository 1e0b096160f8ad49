# nanoserve: the two quick-start targets (`make demo`, `make test`) and their set-up.
# Each creates .venv when missing and installs the package with what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch 2.13 (a CPU build where the package index offers one alongside the default);
# installed first so the package's own `torch>=2.4` is already met.
TORCH_SPEC ?= torch==2.13.*

.PHONY: demo test test-kernels lint bench setup clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

# Run the main job: the batch job over examples/prompts.jsonl with the default model.
demo: setup
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
