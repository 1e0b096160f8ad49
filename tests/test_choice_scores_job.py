"""Label scores through the batch job (`--choice ... --choice-scores`, and per row
`guided_choice` + `choice_scores: true`), the OpenAI request path and the Ray Data
processor: each scored row's `choice_scores` equals transformers' label probabilities on the
same tiny model (`hf_oracle.label_probabilities`: its forward over prompt + label), its text
and tokens are the most likely label's, and ties / empty label lists are one-line errors."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from hf_oracle import hf_tokenizer, label_probabilities

from nanoserve.errors import InputError
from ray_jobs import run_batch_job
from ray_jobs.workers.options import JobOptions

LABELS = ["positive", "positive outlook", "negative"]
KV_BYTES = 32 << 20
ROWS = [
    {"id": 0, "prompt": "Great film. Sentiment:"},
    {"id": 1, "prompt": "Awful food. Sentiment:", "guided_choice": ["yes", "no", "yes sir"],
     "choice_scores": True},
    {"id": 2, "prompt": "Tie:", "guided_choice": ["a", "a"], "choice_scores": True},
    {"id": 3, "prompt": "Generate:", "guided_choice": ["x", "y"], "choice_scores": False},
    {"id": 4, "prompt": "Mood:", "guided_choice": ["very good", "quite bad"],
     "choice_scores": True},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows_by_id(out):
    return {r["id"]: r for r in ds.dataset(out, format="parquet").to_table().to_pylist()}


@pytest.fixture(scope="module")
def oracle(tiny_job_model):
    """want(prompt, labels): ({label: probability}, prompt ids, {label: its ids}) from
    transformers' model and tokenizer over the same folder."""
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_job_model, dtype=torch.float32).eval()
    tok = hf_tokenizer(tiny_job_model)

    def want(prompt, labels):
        ids = tok(prompt)["input_ids"]
        label_ids = {lb: tok(lb, add_special_tokens=False)["input_ids"] for lb in labels}
        probs = label_probabilities(hf, ids, list(label_ids.values()))
        return dict(zip(labels, probs)), ids, label_ids

    return want


def assert_scored(row, want, atol=1e-4):
    """A scored row: its probabilities transformers', its text and token columns the most
    likely label's, its input tokens the prompt's."""
    probs, prompt_ids, label_ids = want
    got = dict(row["choice_scores"])
    assert list(got) == list(probs) and row["error"] is None
    assert all(abs(got[k] - probs[k]) < atol for k in probs), (got, probs)
    best = max(probs, key=probs.get)
    assert row["generated_text"] == best and row["finish_reason"] == "stop"
    assert row["generated_token_ids"] == label_ids[best]
    assert row["num_generated_tokens"] == len(label_ids[best])
    assert row["num_input_tokens"] == len(prompt_ids)


@pytest.fixture(scope="module")
def scored_job(tmp_path_factory, ray_session, tiny_job_model):
    folder = tmp_path_factory.mktemp("choice-scores-job")
    path = write_jsonl(folder / "rows.jsonl", ROWS)
    run_batch_job(path, folder / "out", model=str(tiny_job_model), max_tokens=4,
                  batch_size=4, kv_cache_bytes=KV_BYTES, choice=tuple(LABELS),
                  choice_scores=True, progress=False)
    return rows_by_id(folder / "out")


def test_job_rows_carry_label_probabilities(scored_job, oracle):
    for k, labels in ((0, LABELS), (1, ROWS[1]["guided_choice"]), (4, ROWS[4]["guided_choice"])):
        want = oracle(ROWS[k]["prompt"], labels)
        assert_scored(scored_job[k], want)
    # row 4's labels are two tokens each: the most likely one's token columns say so
    assert min(map(len, oracle(ROWS[4]["prompt"], ROWS[4]["guided_choice"])[2].values())) == 2
    assert scored_job[2]["finish_reason"] == "error"
    assert "'a' is given twice" in scored_job[2]["error"] and "\n" not in scored_job[2]["error"]
    # choice_scores false: the row generates under its choice constraint, no scores
    assert scored_job[3]["choice_scores"] is None
    assert scored_job[3]["generated_text"] in ("x", "y")


def test_job_flag_errors_are_one_line():
    with pytest.raises(InputError, match="--choice-scores needs the labels"):
        JobOptions(choice_scores=True)
    with pytest.raises(InputError, match="'b' is given twice"):
        JobOptions(choice=("b", "b"), choice_scores=True)


def test_openai_request_file_scores_labels(tmp_path, ray_session, tiny_job_model, oracle):
    body = {"prompt": "Pick one:", "guided_choice": ["red", "green"], "choice_scores": True}
    path = write_jsonl(tmp_path / "req.jsonl", [{"custom_id": "r1", "method": "POST",
                                                 "url": "/v1/completions", "body": body}])
    run_batch_job(path, tmp_path / "out", model=str(tiny_job_model), max_tokens=4,
                  batch_size=4, kv_cache_bytes=KV_BYTES, progress=False)
    (line,) = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    choice = line["response"]["body"]["choices"][0]
    want, prompt_ids, _ = oracle("Pick one:", ["red", "green"])
    assert choice["text"] == max(want, key=want.get)
    assert all(abs(choice["choice_scores"][k] - want[k]) < 1e-4 for k in want)
    assert line["response"]["body"]["usage"]["prompt_tokens"] == len(prompt_ids)


def test_ray_data_processor_scores_labels(ray_session, tiny_job_model, oracle):
    from nanoserve.sampling.structured import StructuredOutputs
    from ray_jobs.data_processor import build_processor

    process = build_processor(str(tiny_job_model), num_gpus=0, kv_cache_bytes=KV_BYTES,
                              max_tokens=4, choice_scores=True,
                              structured_outputs=StructuredOutputs(choice=tuple(LABELS)))
    (row,) = process(ray_session.data.from_items([{"prompt": "Great film. Sentiment:"}])
                     ).take_all()
    assert_scored(row, oracle("Great film. Sentiment:", LABELS))


def test_cli_choice_scores_and_chat_template_kwargs(ray_session, tiny_job_model, oracle,
                                                    tmp_path, capsys):
    from nanoserve_cli import main as nanoserve_main

    path = write_jsonl(tmp_path / "rows.jsonl", [{"id": 0, "prompt": "Great film. Sentiment:"}])
    rc = nanoserve_main(["batch", str(path), "-o", str(tmp_path / "out"), "--model",
                         str(tiny_job_model), "--max-tokens", "4",
                         *[a for label in LABELS for a in ("--choice", label)],
                         "--choice-scores", "--chat-template-kwargs",
                         '{"enable_thinking": false}', "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert_scored(rows_by_id(tmp_path / "out")[0], oracle("Great film. Sentiment:", LABELS))
    rc = nanoserve_main(["batch", str(path), "-o", str(tmp_path / "out2"), "--model",
                         str(tiny_job_model), "--choice", "a", "--choice", "a", "--choice-scores",
                         "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "'a' is given twice" in err[0]
