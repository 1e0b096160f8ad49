"""benchmarks/classify.py on the CPU: its rows and shapes (full size, nothing run), its
--smoke run (a tiny shape of each, nanoserve and transformers, a child process as on the
GPU box), its table's targets, and the plumbing of its vLLM side against a stand-in `vllm`
package (no vLLM here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from benchmarks.classify import (
    MODELS,
    agreement,
    make_rows,
    model_spec,
    print_table,
    run_vllm,
    shape_rows,
)

REPO = Path(__file__).resolve().parents[1]


def test_rows_lengths_ids_and_seed():
    rows = make_rows(2000, 50, 500, (999, 30522), (101,), (102,), seed=0)
    assert len(rows) == 2000
    assert min(map(len, rows)) == 50 and max(map(len, rows)) == 500  # both ends drawn
    assert all(r[0] == 101 and r[-1] == 102 for r in rows)
    assert all(999 <= t < 30522 for r in rows for t in r[1:-1])
    assert make_rows(2000, 50, 500, (999, 30522), (101,), (102,), seed=0) == rows
    assert make_rows(2000, 50, 500, (999, 30522), (101,), (102,), seed=1) != rows
    spec = model_spec("decoder", smoke=False)
    dec = shape_rows(spec, 500, 50, 500, seed=0)
    assert all(50 <= len(r) <= 500 for r in dec)
    pad = spec["config"]["pad_token_id"]
    assert all(0 <= t < pad for r in dec for t in r)  # no row holds the pad id: it pools its end


def test_shapes_are_the_released_models():
    """Parameter counts of the shapes as transformers builds them (on the meta device):
    bert-base-uncased with a two-label head, 109,483,778; Qwen3-0.6B's 0.44B outside the
    embedding, plus its 151,936 x 1,024 embedding and a [2, 1024] score."""
    import transformers

    counts = {}
    for shape in ("decoder", "encoder"):
        spec = model_spec(shape, smoke=False)
        assert spec["architecture"] == MODELS[shape]["architecture"]
        cfg = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
        with torch.device("meta"):
            model = getattr(transformers, spec["architecture"])(cfg)
        counts[shape] = sum(p.numel() for p in model.parameters())
        assert cfg.num_labels == 2
    assert counts["encoder"] == 109_483_778
    embedding = 151936 * 1024
    assert round((counts["decoder"] - embedding - 2 * 1024) / 1e9, 2) == 0.44


def test_smoke_run_prints_both_shapes_and_agreement(tmp_path):
    from transformers import AutoTokenizer

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.classify", "--smoke", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| shape | side | seconds | rows/s | tokens/s | nanoserve over side | target |" in out
    for shape in ("decoder", "encoder"):
        assert f"| {shape} | nanoserve | " in out, out
        assert f"| {shape} | hf | " in out, out
        assert (f"agreement, {shape}, nanoserve vs hf: argmax equal on 100.00% of 24 rows "
                f"(>= 99%: yes); logits max |diff| ") in out, out
    assert "| vllm |" not in out
    result = json.loads((tmp_path / "classify_smoke.json").read_text())
    assert result["device"] == "cpu" and result["sides"] == ["nanoserve", "hf"]
    for shape, arch in (("decoder", "Qwen3ForSequenceClassification"),
                        ("encoder", "BertForSequenceClassification")):
        r = result["shapes"][shape]
        assert r["rows"] == 24 and r["reference"] == "hf"
        assert r["agreement"]["nanoserve"]["max_abs_diff"] < 1e-4  # float32 on both sides
        config = json.loads((tmp_path / f"{shape}-smoke" / "config.json").read_text())
        assert config["architectures"] == [arch] and len(config["id2label"]) == 2
        tok = AutoTokenizer.from_pretrained(tmp_path / f"{shape}-smoke")  # vLLM's fallback
        assert tok("<t5> <t7>", add_special_tokens=False)["input_ids"] == [5, 7]
    assert result["shapes"]["decoder"]["sides"]["nanoserve"]["classifier"] == "DecoderClassifier"
    assert result["shapes"]["encoder"]["sides"]["nanoserve"]["classifier"] == "Encoder"


def test_table_targets_and_agreement_of_probabilities(capsys):
    logits = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.3, 0.2]])
    a = agreement(logits, logits.softmax(-1), got_is_probs=True)
    assert a["compared"] == "probabilities" and a["argmax_equal"] == 1.0
    assert a["max_abs_diff"] < 1e-6 and a["flipped_max_margin"] is None
    b = agreement(logits, torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.2, 0.3]]))
    assert b["argmax_equal"] == pytest.approx(2 / 3)
    assert b["flipped_max_margin"] == pytest.approx(0.1)  # the differing row was a near-tie
    results = {"shapes": {"decoder": {
        "rows": 1000, "tokens": 100_000, "reference": "hf",
        "sides": {"vllm": {"seconds": 12.0, "load_s": 30.0},
                  "nanoserve": {"seconds": 10.0, "load_s": 1.0},
                  "hf": {"seconds": 25.0, "load_s": 2.0}},
        "agreement": {"nanoserve": b}}}}
    print_table(results)
    out = capsys.readouterr().out
    assert "| decoder | nanoserve | 10.00 | 100 | 10,000 | - | - |" in out
    assert "| decoder | hf | 25.00 | 40 | 4,000 | 2.50x | >= 2.0x: met |" in out
    assert "| decoder | vllm | 12.00 | 83 | 8,333 | 1.20x | >= 1.3x: not met |" in out
    assert "argmax equal on 66.67% of 3 rows (>= 99%: NO)" in out


FAKE_VLLM = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace as NS
    assert not {"torch", "nanoserve", "benchmarks"} & set(sys.modules), "imported before vllm"
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    __version__ = "stand-in"
    TokensPrompt = dict
    class PoolingParams:
        def __init__(self, use_activation=None):
            self.use_activation = use_activation
    class LLM:
        def __init__(self, **kw):
            self.calls = []
            self.kw = {**kw, "path": sys.path, "PYTHONPATH": os.environ["PYTHONPATH"]}
        def classify(self, prompts, pooling_params=None, use_tqdm=True):
            assert not use_tqdm and pooling_params.use_activation is False
            rows = [p["prompt_token_ids"] for p in prompts]
            self.calls.append([len(r) for r in rows])
            with open(os.path.join(os.path.dirname(__file__), "kw.json"), "w") as f:
                json.dump({**self.kw, "calls": self.calls, "rows": rows}, f)
            return [NS(outputs=NS(probs=[float(len(r)), float(r[-1])])) for r in rows]
""")


def test_vllm_child_plumbing_with_a_stand_in(tmp_path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    spec = {"shape": "encoder", **model_spec("encoder", smoke=True), "rows": 6, "min_len": 5,
            "max_len": 9, "seed": 3, "warmup_rows": 2, "dtype": "bfloat16",
            "max_model_len": 512, "gpu_memory_utilization": 0.9}
    args = Namespace(vllm_site=str(site), vllm_timeout=120)
    side, logits, error = run_vllm(tmp_path / "model", spec, tmp_path, args)
    assert error == "", error
    rows = shape_rows(spec, 6, 5, 9, seed=3)  # the child draws the parent's rows
    want = torch.tensor([[float(len(r)), float(r[-1])] for r in rows])
    torch.testing.assert_close(logits, want)
    assert side["activation"] is False and side["vllm_version"] == "stand-in"
    kw = json.loads((site / "vllm" / "kw.json").read_text())
    assert kw["rows"] == rows and len(kw["calls"]) == 2 and len(kw["calls"][0]) == 2  # warm-up
    assert kw["runner"] == "pooling" and kw["skip_tokenizer_init"] is True
    assert kw["dtype"] == "bfloat16" and kw["max_model_len"] == 512
    assert kw["model"] == str(tmp_path / "model")
    assert kw["PYTHONPATH"] == str(site)
    assert str(REPO) not in kw["path"] and str(REPO / "benchmarks") not in kw["path"]

    run_vllm(tmp_path / "model", {**spec, "with_tokenizer": True}, tmp_path, args)
    assert json.loads((site / "vllm" / "kw.json").read_text())["skip_tokenizer_init"] is False

    # A child that fails: its stderr comes back, the caller still gets an answer
    (site / "vllm" / "__init__.py").write_text("raise RuntimeError('no GPU here')\n")
    side, logits, error = run_vllm(tmp_path / "model", spec, tmp_path, args)
    assert logits is None and "no GPU here" in error and "last 40 lines" in error
