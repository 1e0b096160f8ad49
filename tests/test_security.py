"""Security of the batch job: weights never unpickled, no code-running calls in the product,
chat templates sandboxed all the way through a job, and a local Ray reachable from this
machine only."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from nanoserve.errors import InputError
from nanoserve.sampling.params import SamplingParams
from nanoserve_cli import main as nanoserve_main

REPO = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("nanoserve", "nanoserve_kernels", "ray_jobs")
MAX_TOKENS = 3




def run_cli(capsys, *args):
    rc = nanoserve_main(["batch", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.err.strip().splitlines()


def write_prompts(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- a tiny chat model: random Llama weights, byte-level tokenizer, ChatML-like specials -------

SPECIALS = ["<|im_start|>", "<|im_end|>"]  # ids 256, 257
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_chat_model(folder: Path, chat_template: str | None) -> Path:
    """A Hugging Face folder: tiny random Llama (saved by transformers) and a byte-level
    tokenizer; `chat_template` goes into tokenizer_config.json (none when None)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=128, tie_word_embeddings=True,
                      bos_token_id=256, eos_token_id=257)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    tconf = {"eos_token": "<|im_end|>", "bos_token": None}
    if chat_template is not None:
        tconf["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tconf))
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny chat model with a sound template (copied and altered by the tests)."""
    return write_chat_model(tmp_path_factory.mktemp("chat-model"), CHATML)


def model_variant(tmp_path: Path, chat_model: Path, chat_template: str | None) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(chat_model, folder)
    tconf = json.loads((folder / "tokenizer_config.json").read_text())
    tconf.pop("chat_template")
    if chat_template is not None:
        tconf["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tconf))
    return folder


# --- weights only through safetensors / GGUF ---------------------------------------------------


class _WritesMarker:
    """Unpickling this creates the file `path`: proof that a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_weights_are_refused_unopened(tmp_path, capsys, no_ray, chat_model):
    folder = tmp_path / "pickled"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_model / name, folder / name)
    marker = tmp_path / "UNPICKLED"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _WritesMarker(marker)}))
    prompts = write_prompts(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    rc, err = run_cli(capsys, prompts, "-o", tmp_path / "out", "--model", folder)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and "pickle" in err[0] and "safetensors" in err[0], err
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


# Calls that run code from data, or unpickle: none may appear in product code.
FORBIDDEN_CALLS = {
    "eval", "exec", "compile", "__import__",
    "torch.load", "torch.jit.load", "pickle.load", "pickle.loads", "pickle.Unpickler",
    "cPickle.load", "cPickle.loads", "marshal.load", "marshal.loads", "dill.load", "dill.loads",
    "cloudpickle.load", "cloudpickle.loads", "joblib.load", "shelve.open", "yaml.load",
    "yaml.unsafe_load", "numpy.load", "np.load", "os.system",
}
FORBIDDEN_IMPORTS = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve",
                     "joblib"}
FORBIDDEN_KEYWORDS = {"allow_pickle": True, "trust_remote_code": True, "shell": True,
                      "weights_only": False}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def product_sources():
    for package in PRODUCT_PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))


def forbidden_uses(path: Path) -> list[str]:
    """From the file's syntax tree (comments and strings do not count): calls to
    eval/exec/torch.load/pickle and kin, imports of a pickle module, and allow_pickle=True,
    trust_remote_code=True, shell=True or weights_only=False."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in FORBIDDEN_CALLS:
                found.append(f"{where} calls {name}")
            for kw in node.keywords:
                value = kw.value.value if isinstance(kw.value, ast.Constant) else None
                if kw.arg in FORBIDDEN_KEYWORDS and value is FORBIDDEN_KEYWORDS[kw.arg]:
                    found.append(f"{where} passes {kw.arg}={value}")
        elif isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in FORBIDDEN_IMPORTS]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in FORBIDDEN_IMPORTS:
                found.append(f"{where} imports from {node.module}")
    return found


def test_product_code_never_unpickles_or_evaluates():
    sources = list(product_sources())
    assert len(sources) > 20  # the scan sees the product
    assert [use for path in sources for use in forbidden_uses(path)] == []


def test_the_scan_finds_planted_uses(tmp_path):
    """The scan is not vacuous: planted uses are found, a method named `eval` is not."""
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        import pickle
        import torch
        x = eval("1")
        w = torch.load("w.bin", weights_only=False)
        model.eval()
        # torch.load( in a comment, and "exec(" in a string, do not count
    """))
    assert forbidden_uses(bad) == ["bad.py:2 imports pickle", "bad.py:4 calls eval",
                                   "bad.py:5 calls torch.load", "bad.py:5 passes weights_only=False"]


# --- chat templates that reach for Python internals --------------------------------------------

PROBES = {
    "os-popen": "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "format-string": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    "mutate-caller": "{{ messages.append({'role': 'x', 'content': 'y'}) }}",
    "namespace-dunder": "{% set ns = namespace(__class__=1) %}{{ ns }}",
}


def malicious_template(probe: str, marker: Path) -> str:
    return PROBES[probe].replace("{marker}", str(marker)) + CHATML


@pytest.fixture(scope="module")
def malicious_job(tmp_path_factory, chat_model, ray_session):
    """A job whose model's chat template tries to run a shell command, over chat rows and
    plain prompt rows, through the CLI on the shared local Ray."""
    folder = tmp_path_factory.mktemp("malicious-job")
    marker = folder / "PWNED"
    model = model_variant(folder, chat_model, malicious_template("os-popen", marker))
    rows = [{"id": "chat-1", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "text-1", "prompt": "hello there"},
            {"id": "chat-2", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "why"}]},
            {"id": "text-2", "prompt": "the sky is"}]
    prompts = write_prompts(folder / "in.jsonl", rows)
    out = folder / "out"
    rc = nanoserve_main(["batch", str(prompts), "-o", str(out), "--model", str(model),
                         "--max-tokens", str(MAX_TOKENS), "--no-progress"])
    by_id = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()} if out.exists() else {}
    return rc, by_id, marker, model


def test_malicious_template_makes_chat_rows_error_rows(malicious_job):
    rc, by_id, marker, _ = malicious_job
    assert rc == 0
    assert not marker.exists()
    for row_id in ("chat-1", "chat-2"):
        row = by_id[row_id]
        assert row["finish_reason"] == "error"
        assert "chat template tried unsafe operation" in row["error"], row["error"]
        assert row["generated_token_ids"] is None


def test_malicious_template_leaves_plain_prompts_answered(malicious_job):
    """Prompt rows do not use the template: each equals `LLM.generate` of that prompt alone."""
    from nanoserve.llm import LLM

    rc, by_id, _, model = malicious_job
    llm = LLM(model=str(model), device="cpu")
    for row_id, text in (("text-1", "hello there"), ("text-2", "the sky is")):
        row = by_id[row_id]
        ids = llm.tokenizer.encode(text)
        (want,) = llm.generate([ids], [SamplingParams(max_tokens=MAX_TOKENS)])
        assert row["error"] is None
        assert row["generated_token_ids"] == want.token_ids
        assert row["finish_reason"] == want.finish_reason


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_every_probe_is_an_error_row_not_a_job_failure(tmp_path, chat_model, probe):
    """The row preparation the job runs on the driver, with the model's real tokenizer: each
    probe ends its row with a clear error, and the probe's side effect never happens."""
    from nanoserve.weights.tokenizer import Tokenizer
    from ray_jobs.input.files import InputChunk
    from ray_jobs.preparation.prepare import RowPreparer, plan_columns

    marker = tmp_path / "PWNED"
    model = model_variant(tmp_path, chat_model, malicious_template(probe, marker))
    batch = pa.RecordBatch.from_pylist([{"messages": [{"role": "user", "content": "hi"}]}])
    preparer = RowPreparer(plan_columns(batch.schema), Tokenizer.from_path(model), 128, 260,
                           {"max_tokens": 2})
    (row,) = preparer.prepare(InputChunk(batch, tmp_path / "in.jsonl"), 0)
    assert row.error is not None and row.params is None
    assert row.error.startswith("chat template tried unsafe operation"), row.error
    assert not marker.exists()


def test_template_that_does_not_compile_fails_the_job_before_ray(tmp_path, capsys, no_ray,
                                                                  chat_model):
    model = model_variant(tmp_path, chat_model, "{% for m in messages %}{{ m['content'] }")
    prompts = write_prompts(tmp_path / "in.jsonl",
                            [{"messages": [{"role": "user", "content": "hi"}]}])
    rc, err = run_cli(capsys, prompts, "-o", tmp_path / "out", "--model", model)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: the input has chat messages (column 'messages')")
    assert "not valid Jinja" in err[0]


def test_chat_rows_for_a_model_without_template_fail_the_job_before_ray(tmp_path, capsys,
                                                                         no_ray, chat_model):
    model = model_variant(tmp_path, chat_model, None)
    prompts = write_prompts(tmp_path / "in.jsonl",
                            [{"messages": [{"role": "user", "content": "hi"}]}])
    rc, err = run_cli(capsys, prompts, "-o", tmp_path / "out", "--model", model)
    assert rc == 2 and len(err) == 1, err
    assert "the model has no chat template" in err[0], err


@pytest.mark.parametrize("body, error", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10**9) %}{% endfor %}", "Range too big"),
])
def test_template_failing_at_render_is_a_row_error_not_a_crash(tmp_path, chat_model, body, error):
    """A template that raises something other than a template error (division by zero, the
    sandbox's range limit) still ends only its row."""
    from nanoserve.weights.tokenizer import Tokenizer
    from ray_jobs.input.files import InputChunk
    from ray_jobs.preparation.prepare import RowPreparer, plan_columns

    model = model_variant(tmp_path, chat_model, body + CHATML)
    batch = pa.RecordBatch.from_pylist([{"messages": [{"role": "user", "content": "hi"}]}])
    preparer = RowPreparer(plan_columns(batch.schema), Tokenizer.from_path(model), 128, 260,
                           {"max_tokens": 2})
    (row,) = preparer.prepare(InputChunk(batch, tmp_path / "in.jsonl"), 0)
    assert row.error.startswith("chat template failed on this conversation") and error in row.error


def test_model_without_template_is_refused_only_for_chat_rows(chat_model, tmp_path):
    """Without chat rows, a model without a template is fine: prompt rows need none."""
    from nanoserve.weights.tokenizer import Tokenizer
    from ray_jobs.preparation.prepare import RowPreparer, plan_columns

    model = model_variant(tmp_path, chat_model, None)
    tokenizer = Tokenizer.from_path(model)
    RowPreparer(plan_columns(pa.schema([("prompt", pa.string())])), tokenizer, 128, 260,
                {"max_tokens": 2})
    schema = pa.schema([("prompt", pa.string()), ("messages", pa.list_(pa.struct(
        [("role", pa.string()), ("content", pa.string())])))])
    with pytest.raises(InputError, match="column 'messages'"):
        RowPreparer(plan_columns(schema), tokenizer, 128, 260, {"max_tokens": 2})


# --- the local Ray listens on 127.0.0.1 only ---------------------------------------------------

LISTEN_SCRIPT = textwrap.dedent("""
    import json, sys
    import psutil
    import ray_jobs.dispatch.driver as driver
    from ray_jobs.dispatch.pool import WorkerPool

    seen = []
    start = WorkerPool.start.__func__

    def start_and_look(cls, *args, **kwargs):
        pool = start(cls, *args, **kwargs)  # every Ray process of the job exists now, workers included
        me = psutil.Process()
        for proc in [me] + me.children(recursive=True):
            try:
                name, conns = proc.name(), proc.net_connections(kind="inet")
            except psutil.Error:
                continue
            for c in conns:
                if c.status == psutil.CONN_LISTEN or c.type.name == "SOCK_DGRAM":
                    seen.append([name, c.laddr.ip, c.laddr.port, c.type.name])
        return pool

    WorkerPool.start = classmethod(start_and_look)
    summary = driver.run_batch_job(sys.argv[1], sys.argv[2], model=sys.argv[3], address="local",
                                   max_tokens=2, progress=False)
    print("LISTENING=" + json.dumps(seen))
    print("ROWS=" + str(summary.rows))
""")


def test_local_ray_listens_on_loopback_only(tmp_path, chat_model):
    """A job that starts its own private local Ray (the CLI's default on a machine without
    a cluster): while its workers are up, every listening socket of every Ray process it
    started (GCS, raylet, agents, workers) is bound to 127.0.0.1, and no dashboard runs."""
    prompts = write_prompts(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", LISTEN_SCRIPT, str(prompts), str(tmp_path / "out"), str(chat_model)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LISTENING="))
    listening = json.loads(line.removeprefix("LISTENING="))
    names = {name for name, *_ in listening}
    assert {"gcs_server", "raylet"} <= names, listening
    assert any("BatchWorker" in name for name in names), listening  # the job's actor process
    assert not any("dashboard" in name.lower() and "agent" not in name.lower() for name in names)
    addresses = {ip.removeprefix("::ffff:") for _, ip, _, _ in listening}
    assert addresses == {"127.0.0.1"}, listening
    assert "ROWS=1" in proc.stdout


@pytest.mark.parametrize("body", ["{{ 'a' * 10**8 }}", "{{ [0] * 100000000 }}",
                                  "{{ 100000000 * 'ab' }}", "{{ 2 ** 100000 }}"])
def test_template_cannot_build_huge_values(body):
    """Memory is a resource too: `*` and `**` are bounded inside the sandbox."""
    from nanoserve.weights.chat_template import ChatTemplate

    with pytest.raises(ValueError, match="unsafe"):
        ChatTemplate(body).render([{"role": "user", "content": "hi"}])
    ok = ChatTemplate("{{ '-' * 3 }}{{ messages[0]['content'] }}{{ 2 ** 10 }}")
    assert ok.render([{"role": "user", "content": "hi"}]) == "---hi1024"
