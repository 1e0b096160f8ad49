"""The batch job with LoRA adapters (`nanoserve batch --lora NAME=PATH`), on the tests' local
Ray (CPU): a Parquet input whose `lora` column picks each row's adapter (null: the base
model), rows of every adapter interleaved; an OpenAI batch request file whose `model` picks
one. Oracle: every row equals `LLM.generate` on that prompt alone under the same adapter
(the engine itself is held to PEFT's merged models in tests/test_lora.py); an unknown
adapter name is that row's error row, not a dead job. Job-level errors (a broken adapter
folder, a `lora` column that is not text, a rerun with other adapters) come before any
worker starts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from nanoserve.errors import InputError, ModelError
from nanoserve.llm import LLM
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import save_tiny_byte_llama
from ray_jobs import run_batch_job
from tests.test_lora import save_peft_adapter

MAX_TOKENS = 8
KV_BYTES = 16 << 20
PROMPTS = ["The quick brown fox", "jumps over", "the lazy dog, again and again", "One",
           "Lorem ipsum dolor", "sit amet", "What is 2 + 2?", "A longer prompt that runs on"]
NAMES = [None, "qv", "all", "qv", None, "all", "nope", "all"]


@pytest.fixture(scope="module")
def lora_job_model(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-job")
    base = save_tiny_byte_llama(root / "base")
    qv = save_peft_adapter(base, root / "qv", ["q_proj", "v_proj"], 4, 8, False, seed=11)
    every = save_peft_adapter(base, root / "all", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"],
                              8, 16, True, seed=12)
    return base, {"qv": qv, "all": every}


def _specs(folders) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, path in folders.items())


def _oracle(base, folders, prompts, names):
    llm = LLM(str(base), device="cpu", kv_cache_bytes=KV_BYTES, lora=folders)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    return [llm.generate([p], params, lora=[n])[0] for p, n in zip(prompts, names)]


def test_a_lora_column_picks_each_rows_adapter(lora_job_model, ray_session, tmp_path):
    base, folders = lora_job_model
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS, "lora": pa.array(NAMES, pa.string())}), path)
    out = tmp_path / "out"
    summary = run_batch_job(path, out, model=str(base), max_tokens=MAX_TOKENS, batch_size=3,
                            kv_cache_bytes=KV_BYTES, lora=_specs(folders), progress=False)
    rows = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    assert summary.rows == len(PROMPTS) and summary.error_rows == 1
    bad = rows[NAMES.index("nope")]
    assert bad["finish_reason"] == "error" and "unknown LoRA adapter 'nope'" in bad["error"]
    assert "all, qv" in bad["error"]
    ok = [i for i, n in enumerate(NAMES) if n != "nope"]
    want = _oracle(base, folders, [PROMPTS[i] for i in ok], [NAMES[i] for i in ok])
    for i, w in zip(ok, want):
        assert rows[i]["lora"] == NAMES[i]  # the column passes through
        assert rows[i]["error"] is None, rows[i]["error"]
        assert rows[i]["generated_token_ids"] == w.token_ids, (i, NAMES[i])
        assert rows[i]["generated_text"] == w.text
    assert len({tuple(rows[i]["generated_token_ids"]) for i in (1, 2, 4)}) == 3  # they differ
    # a rerun on the finished folder with other adapters is refused before any work
    other = {"qv": folders["all"], "all": folders["qv"]}
    with pytest.raises(InputError, match="other settings"):
        run_batch_job(path, out, model=str(base), max_tokens=MAX_TOKENS, batch_size=3,
                      kv_cache_bytes=KV_BYTES, lora=_specs(other), progress=False)


def test_an_openai_request_picks_an_adapter_by_its_model(lora_job_model, ray_session,
                                                         tmp_path):
    base, folders = lora_job_model
    bodies = [("a", "qv"), ("b", "gpt-4o-mini"), ("c", "all")]  # a model that is no adapter:
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",  # the base model
              "body": {"model": model, "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                       "temperature": 0}} for i, (cid, model) in enumerate(bodies)]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run_batch_job(path, out, model=str(base), kv_cache_bytes=KV_BYTES, lora=_specs(folders),
                  progress=False)
    answers = {}
    for line in (out / "output.jsonl").read_text().splitlines():
        answer = json.loads(line)
        answers[answer["custom_id"]] = answer["response"]["body"]["choices"][0]["text"]
    want = _oracle(base, folders, PROMPTS[:3], ["qv", None, "all"])
    assert [answers[cid] for cid, _ in bodies] == [w.text for w in want]


def test_job_level_lora_errors_come_before_ray(lora_job_model, tmp_path, no_ray):
    base, folders = lora_job_model
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS[:2], "lora": [1, 2]}), path)
    with pytest.raises(InputError, match="column 'lora'.*must hold text, not int64"):
        run_batch_job(path, tmp_path / "o1", model=str(base), lora=_specs(folders),
                      progress=False)
    pq.write_table(pa.table({"prompt": PROMPTS[:2]}), path)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                            "use_dora": True}))
    with pytest.raises(ModelError, match="use_dora = true is not supported"):
        run_batch_job(path, tmp_path / "o2", model=str(base), lora=(f"x={broken}",),
                      progress=False)
    with pytest.raises(InputError, match="--lora must be NAME=PATH"):
        run_batch_job(path, tmp_path / "o3", model=str(base), lora=(str(broken),),
                      progress=False)
    with pytest.raises(InputError, match="continuous scheduler only"):
        run_batch_job(path, tmp_path / "o4", model=str(base), lora=_specs(folders),
                      scheduler="static", progress=False)
