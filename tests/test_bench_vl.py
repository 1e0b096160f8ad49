"""benchmarks/vl.py on the CPU: the shapes (their parameter counts are the released
checkpoints'), the workload, the model folder's tokenizer as both engines read it, the
--smoke run (a child process, as on the GPU box), and the plumbing of its vLLM half against
a stand-in `vllm` package (no vLLM here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

from benchmarks.vl import (
    PREPROCESSOR,
    QWEN2_5_VL_3B,
    QWEN2_5_VL_7B,
    SIZES,
    SMOKE,
    make_images,
    make_rows,
    run_vllm,
    vl_folder,
)

REPO = Path(__file__).resolve().parents[1]


def test_shapes_have_the_released_parameter_counts():
    """Qwen2.5-VL-3B-Instruct holds 3.75B parameters, 7B-Instruct 8.29B (their model cards'
    safetensors totals), vision tower included."""
    from nanoserve.model.config import ModelConfig
    from nanoserve.weights.weights import expected_shapes

    def count(config):
        return sum(math.prod(s) for s in expected_shapes(ModelConfig.from_hf_dict(config)).values())

    assert abs(count(QWEN2_5_VL_3B) - 3.75e9) < 0.01e9
    assert abs(count(QWEN2_5_VL_7B) - 8.29e9) < 0.01e9


def test_workload_sizes_and_lengths(tmp_path):
    from nanoserve.multimodal.image_input import ImageConfig, smart_resize

    cfg = ImageConfig.from_dict(PREPROCESSOR)
    tokens = [math.prod(smart_resize(h, w, 28, cfg.min_pixels, cfg.max_pixels)) // 28**2
              for w, h in SIZES]
    assert min(tokens) == 64 and max(tokens) == 1196
    fake = [tmp_path / f"{i}.jpg" for i in range(2000)]
    rows, max_tokens = make_rows(fake, 1)
    assert len(rows) == 2000 and all(32 <= m <= 128 for m in max_tokens)
    assert (rows, max_tokens) == make_rows(fake, 1)  # fixed seed
    assert rows[7][0]["content"][0]["image_url"]["url"] == f"file://{fake[7].resolve()}"
    images = make_images(tmp_path / "images", 12, 0)
    from PIL import Image

    sizes = [Image.open(p).size for p in images]
    assert set(sizes) <= set(SIZES) and len(set(sizes)) > 3
    assert images == make_images(tmp_path / "images", 12, 0)


def test_both_tokenizers_read_the_folder_alike(tmp_path):
    """vLLM tokenizes with transformers, nanoserve with its own: the same ids, the image
    placeholder at Qwen2.5-VL's id."""
    from transformers import AutoTokenizer

    from nanoserve.weights.tokenizer import Tokenizer

    folder = vl_folder(tmp_path / "m", SMOKE)
    ours, theirs = Tokenizer.from_path(folder), AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "<t17> <t9000> <t3>"}]}]
    text = ours.apply_chat_template(messages, add_generation_prompt=True, content_parts=True)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert 151655 in ids and [17, 9000, 3] == ids[ids.index(151653) + 1:][:3]


def test_smoke_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vl", "--smoke", "--out",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| smoke | 4 | nanoserve | " in proc.stdout
    side = json.loads((tmp_path / "vl_smoke.json").read_text())["sides"]["nanoserve"]
    assert side["output_tokens"] > 0 and side["images_s"] > 0
    assert 0 < side["prepare_s"] < side["wall_s"]


FAKE_VLLM = textwrap.dedent("""
    import json, os, sys
    from types import SimpleNamespace as NS
    assert not {"torch", "nanoserve", "benchmarks"} & set(sys.modules), "imported before vllm"
    __version__ = "stand-in"
    SamplingParams = dict
    class LLM:
        def __init__(self, **kw):
            with open(os.path.join(os.path.dirname(__file__), "kw.json"), "w") as f:
                json.dump({**kw, "PYTHONPATH": os.environ["PYTHONPATH"]}, f)
        def chat(self, rows, params, use_tqdm=True):
            assert not use_tqdm and len(rows) == len(params)
            assert all(p["temperature"] == 0 and p["ignore_eos"] for p in params)
            for r in rows:
                assert r[0]["content"][0]["image_url"]["url"].startswith("file://")
            return [NS(outputs=[NS(token_ids=[1] * p["max_tokens"])], prompt_token_ids=[0] * 9)
                    for p in params]
""")


def test_vllm_child_plumbing_with_a_stand_in(tmp_path):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    rows, max_tokens = make_rows([tmp_path / f"{i}.jpg" for i in range(5)], 1)
    args = Namespace(gpu_memory_utilization=0.9, vllm_site=str(site), vllm_timeout=120)
    result, error = run_vllm(tmp_path / "model", rows, max_tokens, (rows[:2], max_tokens[:2]),
                             tmp_path, args)
    assert error == "", error
    assert result["output_tokens"] == sum(max_tokens) and result["prompt_tokens"] == 45
    kw = json.loads((site / "vllm" / "kw.json").read_text())
    assert kw["load_format"] == "dummy" and kw["limit_mm_per_prompt"] == {"image": 1}
    assert kw["allowed_local_media_path"] == str(tmp_path.resolve())
    assert kw["model"] == str(tmp_path / "model") and kw["PYTHONPATH"] == str(site)

    (site / "vllm" / "__init__.py").write_text("raise RuntimeError('no GPU here')\n")
    result, error = run_vllm(tmp_path / "model", rows, max_tokens, (rows[:2], max_tokens[:2]),
                             tmp_path, args)
    assert result is None and "no GPU here" in error
