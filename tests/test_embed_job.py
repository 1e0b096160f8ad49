"""Embedding jobs (`run_batch_job(..., task="embed")`, ray_jobs/tasks/embed.py) and the Ray
Data processor with task="embed", on the tests' local Ray (CPU). Oracle: transformers' base
model over each row alone + the pooling its sentence-transformers files name, on the ids
of transformers' tokenizer cut to the limit (the model's tokenizer closes every text with
`<|endoftext|>`, as Qwen3-Embedding's does, and a cut keeps it)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch

from nanoserve.errors import InputError, NanoserveError
from nanoserve.testing import save_tiny_embedding
from ray_jobs import run_batch_job

LIMIT = 16
ROWS = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Hello"},
    {"text": "A longer document that goes past the input limit: " + "word " * 30},
    {"text": "   "},  # an error row
    {"text": "Embeddings for search and retrieval"},
    {"text": "one two three"},
]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory, smollm2_gguf_path):
    """Last-token pooling, normalised (sentence-transformers' files), a closing token."""
    return save_tiny_embedding(tmp_path_factory.mktemp("embed-job"), smollm2_gguf_path,
                               pooling="lasttoken", closing_token="<|endoftext|>")


@pytest.fixture(scope="module")
def hf_oracle(embed_model):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(embed_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(embed_model)

    def vector(text: str, limit: int = LIMIT, dims: int | None = None) -> torch.Tensor:
        ids = tok(text, truncation=True, max_length=limit)["input_ids"]
        with torch.no_grad():
            v = model(torch.tensor([ids])).last_hidden_state[0, -1]
        v = v[:dims] if dims else v
        return torch.nn.functional.normalize(v, dim=-1)

    return vector


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_rows(rows, hf_oracle, limit=LIMIT, dims=None, atol=1e-4):
    by_id = {r["id"]: r for r in rows}
    assert sorted(by_id) == list(range(len(ROWS)))
    for i, row in enumerate(ROWS):
        got = by_id[i]
        if not row["text"].strip():
            assert got["embedding"] is None and "empty" in got["error"]
            continue
        assert got["error"] is None, got["error"]
        want = hf_oracle(row["text"], limit, dims)
        torch.testing.assert_close(torch.tensor(got["embedding"], dtype=torch.float32), want,
                                   atol=atol, rtol=0)


def test_embed_job_equals_transformers_and_resumes(ray_session, embed_model, hf_oracle,
                                                   tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    kw = dict(model=str(embed_model), task="embed", max_input_tokens=LIMIT, batch_size=2,
              progress=False)
    summary = run_batch_job(src, out, **kw)
    assert (summary.rows, summary.error_rows, summary.truncated_rows) == (len(ROWS), 1, 1)
    assert "truncated: 1 row(s)" in summary.format()
    table = ds.dataset(out).to_table()
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    assert "num_input_tokens" in table.column_names and "generated_text" not in table.column_names
    rows = table.to_pylist()
    assert max(r["num_input_tokens"] for r in rows) == LIMIT
    check_rows(rows, hf_oracle)
    again = run_batch_job(src, out, **kw)  # complete: nothing computed again
    assert again.rows == 0 and again.rows_resumed == len(ROWS)
    with pytest.raises(InputError, match="pooling"):
        run_batch_job(src, out, **{**kw, "pooling": "mean"})
    # float16 vectors, Matryoshka-cut to 32 dimensions, as a separate job
    half = run_batch_job(src, tmp_path / "half", **kw, embedding_dtype="float16", dimensions=32)
    assert half.rows == len(ROWS)
    table = ds.dataset(tmp_path / "half").to_table()
    assert table.schema.field("embedding").type == pa.list_(pa.float16(), 32)
    check_rows(table.to_pylist(), hf_oracle, dims=32, atol=2e-3)


def test_embed_job_stopped_by_a_dying_worker_resumes(ray_session, embed_model, hf_oracle,
                                                     tmp_path, monkeypatch):
    """A worker killed by one row: with no deaths allowed the job stops after writing the
    other batches; the rerun (no fault) computes only what is missing, each row once."""
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    kw = dict(model=str(embed_model), task="embed", max_input_tokens=LIMIT, batch_size=1,
              max_in_flight_per_worker=1, progress=False)
    monkeypatch.setenv("NANOSERVE_FAULT_KILL_ON_TEXT", "Hello")  # the shortest row: last
    with pytest.raises(NanoserveError, match="died"):
        run_batch_job(src, out, **kw, max_deaths_in_a_row=0)
    written = ds.dataset(out).to_table().num_rows
    assert 0 < written < len(ROWS)
    monkeypatch.delenv("NANOSERVE_FAULT_KILL_ON_TEXT")
    summary = run_batch_job(src, out, **kw)
    assert summary.rows_resumed == written and summary.rows == len(ROWS) - written
    check_rows(ds.dataset(out).to_table().to_pylist(), hf_oracle)


def test_data_processor_embeds(ray_session, embed_model, hf_oracle):
    import ray.data

    from ray_jobs.data_processor import build_processor

    rows = [{"id": i, **r} for i, r in enumerate(ROWS)]
    process = build_processor(str(embed_model), task="embed", num_gpus=0, batch_size=4,
                              max_input_tokens=LIMIT)
    out = process(ray.data.from_items(rows)).take_all()
    assert len(out) == len(ROWS)
    check_rows([{**r, "embedding": None if r["embedding"] is None else list(r["embedding"])}
                for r in out], hf_oracle)


def test_nanoserve_embed_command(ray_session, embed_model, hf_oracle, tmp_path, capsys):
    from nanoserve_cli import main

    src = write_rows(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    base = ["embed", str(src), "-o", str(out), "--model", str(embed_model),
            "--max-input-tokens", str(LIMIT), "--no-progress"]
    assert main(base + ["--dimensions", "65"]) == 2
    assert "hidden size" in capsys.readouterr().err
    assert main(base + ["--no-truncate"]) == 0
    printed = capsys.readouterr().out
    assert "rows: 6 (2 error rows)" in printed and "truncated: 0 row(s)" in printed
    rows = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    assert "above the limit of 16" in rows[2]["error"]
    torch.testing.assert_close(torch.tensor(rows[0]["embedding"]), hf_oracle(ROWS[0]["text"]),
                               atol=1e-4, rtol=0)


def test_row_that_kills_its_worker_is_isolated(ray_session, embed_model, hf_oracle, tmp_path,
                                               monkeypatch):
    """As for generation: the batch that kills its worker runs again, then (a row alone)
    becomes an error row; every other row is embedded once."""
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    monkeypatch.setenv("NANOSERVE_FAULT_KILL_ON_TEXT", "Hello")
    summary = run_batch_job(src, out, model=str(embed_model), task="embed", batch_size=1,
                            max_input_tokens=LIMIT, progress=False)
    assert summary.rows == len(ROWS) and summary.error_rows == 2 and summary.worker_restarts
    rows = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    assert "worker died" in rows[1]["error"] and rows[1]["embedding"] is None
    check_rows([r for i, r in rows.items() if i != 1] + [{**rows[1], "error": None,
                "embedding": hf_oracle("Hello").tolist()}], hf_oracle)
