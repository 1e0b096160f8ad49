"""The batch job over a tiny Qwen3, Mistral, Qwen3-MoE and Mixtral checkpoint (sliding windows shorter
than the rows' contexts, the families' chat templates and EOS lists), on the tests' local
Ray (CPU). Oracle: every row equals `LLM.generate` on that prompt alone, same model files,
the prompt tokenized here independently of the job."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import save_tiny_family
from ray_jobs import run_batch_job

TEMPLATES = Path(__file__).parent / "chat_templates"
MAX_TOKENS = 12
KV_BYTES = 32 << 20
ROWS = [
    {"prompt": "The quick brown fox jumps over the lazy dog, again and again"},
    {"messages": [{"role": "user", "content": "Name three colours, please."}]},
    {"prompt": "One"},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                  {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3 + 3?"}]},
    {"prompt": "Lorem ipsum dolor sit amet, consectetur adipiscing elit", "max_tokens": 5},
    {"prompt_token_ids": [504, 2988, 314, 17, 99, 1023, 7, 7, 7]},
]
# family: (window, template, tokenizer_config special tokens, generation_config EOS tokens);
# Mistral's template writes bos_token and eos_token (here two of the SmolLM2 vocabulary's).
FAMILIES = {
    "qwen3": (6, "qwen3.jinja", {"eos_token": "<|im_end|>"}, ("<|im_end|>", "<|endoftext|>")),
    "mistral": (5, "mistral-7b-instruct-v0.1.jinja",
                {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, ()),
    # mixtures of experts (their records' `tiny` options): the window on every layer
    "qwen3_moe": (6, "qwen3.jinja", {"eos_token": "<|im_end|>"}, ("<|im_end|>", "<|endoftext|>")),
    "mixtral": (5, "mistral-7b-instruct-v0.1.jinja",
                {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}, ()),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batch_job_equals_engine_row_for_row(family, ray_session, smollm2_gguf_path, tmp_path):
    window, template, specials, eos = FAMILIES[family]
    model = save_tiny_family(tmp_path / family, family, smollm2_gguf_path, sliding_window=window,
                             chat_template=(TEMPLATES / template).read_text(),
                             special_tokens=specials, eos_tokens=eos)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    summary = run_batch_job(path, out, model=str(model), max_tokens=MAX_TOKENS, batch_size=4,
                            kv_cache_bytes=KV_BYTES, progress=False)
    rows = ds.dataset(out).to_table().to_pylist()
    assert summary.rows == len(ROWS) and summary.error_rows == 0, [r["error"] for r in rows]
    llm = LLM(model=str(model), device="cpu", kv_cache_bytes=KV_BYTES)
    assert llm.config.architecture.lower().startswith(family.replace("_", ""))
    assert llm.config.attention_window(1) == window
    tok = llm.tokenizer
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == list(range(len(ROWS)))
    for i, row in enumerate(ROWS):
        if "prompt" in row:
            ids = tok.encode(row["prompt"])
        elif "messages" in row:
            ids = tok.encode(tok.apply_chat_template(row["messages"]), add_special_tokens=False)
        else:
            ids = row["prompt_token_ids"]
        params = SamplingParams(max_tokens=row.get("max_tokens", MAX_TOKENS), temperature=0.0)
        (want,) = llm.generate([ids], [params])  # this prompt alone
        got = by_id[i]
        assert got["error"] is None, got["error"]
        assert got["num_input_tokens"] == len(ids)
        assert got["generated_token_ids"] == want.token_ids, (family, i)
        assert got["generated_text"] == want.text
        assert got["finish_reason"] == want.finish_reason
    # the contexts are longer than the window, so the window is in play
    assert max(r["num_input_tokens"] + r["num_generated_tokens"] for r in by_id.values()) > window
