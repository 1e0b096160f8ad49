"""The batch job end to end on a local Ray with the real default model (CPU).

Oracle: every generated row must equal `LLM.generate` run on that prompt alone (same model,
same sampling values), with the prompt tokenized here independently of the job. Job-level
errors must surface as `error: ...` with exit status 2 before any worker starts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import ray_jobs.dispatch.driver as driver
from nanoserve.errors import InputError
from nanoserve.sampling.params import SamplingParams
from ray_jobs import run_batch_job
from ray_jobs.cli import main as batch_main
from ray_jobs.dispatch.pool import WorkerPool
from ray_jobs.output.manifest import (
    LOCK_NAME,
    MANIFEST_NAME,
    REPORT_NAME,
    SUCCESS_NAME,
    Manifest,
    part_name,
)
from ray_jobs.preparation.result_columns import WORKER_RESULT_SCHEMA
from ray_jobs.workers.worker import BatchWorker, GenerationRequest

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 4

JSONL_ROWS = [
    {"prompt": "The capital of France is", "tag": "a"},
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "tag": "b"},
    {"prompt": "", "tag": "empty"},
    {"prompt": "Once upon a time", "max_tokens": 2},
    {"messages": [{"role": "user"}], "tag": "no content"},
    {"prompt_token_ids": [504, 2988, 314], "tag": "ids"},
    {"prompt": "List three colors:", "temperature": -1.0},
    {"prompt": "word " * 9000, "tag": "too long"},
    {"prompt": "The weather today is", "temperature": 0.9, "seed": 11},
]
JSONL_ERRORS = {2: "empty prompt", 4: "content", 6: "temperature", 7: "context"}


def oracle_ids(llm, row):
    """The prompt's tokens, computed here the documented way (not by the job's code)."""
    tok = llm.tokenizer
    if row.get("prompt") is not None:
        return tok.encode(row["prompt"])
    if row.get("messages") is not None:
        return tok.encode(tok.apply_chat_template(row["messages"], add_generation_prompt=True),
                          add_special_tokens=False)
    return list(row["prompt_token_ids"])


def oracle_params(row):
    return SamplingParams(max_tokens=row.get("max_tokens") or MAX_TOKENS,
                          temperature=row.get("temperature") or 0.0, seed=row.get("seed"))


def assert_rows_match_oracle(llm, input_rows, out_by_id, errors):
    for i, row in enumerate(input_rows):
        got = out_by_id[i]
        if i in errors:
            assert got["finish_reason"] == "error" and errors[i] in got["error"], got["error"]
            assert got["generated_token_ids"] is None and got["num_generated_tokens"] == 0
            continue
        ids = oracle_ids(llm, row)
        (want,) = llm.generate([ids], [oracle_params(row)])  # this prompt alone
        assert got["error"] is None
        assert got["num_input_tokens"] == len(ids)
        assert got["generated_token_ids"] == want.token_ids, (i, row)
        assert got["generated_text"] == want.text
        assert got["finish_reason"] == want.finish_reason
        assert got["num_generated_tokens"] == len(want.token_ids)


@pytest.fixture(scope="module")
def jsonl_job(tmp_path_factory, ray_session):
    folder = tmp_path_factory.mktemp("jsonl-job")
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in JSONL_ROWS))
    out = folder / "out"
    # at most 2 rows decoding at once in the worker's engine (of the 6 a worker holds)
    summary = run_batch_job(path, out, max_tokens=MAX_TOKENS, batch_size=3, max_running_rows=2,
                            progress=False)
    return summary, out


def test_jsonl_job_writes_every_row_once(jsonl_job):
    summary, out = jsonl_job
    table = ds.dataset(out).to_table()
    assert sorted(table["id"].to_pylist()) == list(range(len(JSONL_ROWS)))
    assert summary.rows == len(JSONL_ROWS) and summary.error_rows == len(JSONL_ERRORS)
    assert (out / SUCCESS_NAME).exists()
    assert Manifest.load(out).complete and Manifest.load(out).rows_done == len(JSONL_ROWS)
    assert table.schema.field("generated_token_ids").type == pa.list_(pa.int32())
    assert table.schema.names[-6:] == ["generated_text", "generated_token_ids", "num_input_tokens",
                                       "num_generated_tokens", "finish_reason", "error"]
    assert summary.output_tokens == sum(table["num_generated_tokens"].to_pylist())
    assert 0.0 <= summary.padding_waste < 1.0


def test_jsonl_job_rows_equal_each_prompt_generated_alone(jsonl_job, smollm2_llm):
    _, out = jsonl_job
    by_id = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    assert_rows_match_oracle(smollm2_llm, JSONL_ROWS, by_id, JSONL_ERRORS)


def test_jsonl_job_passes_input_columns_through(jsonl_job):
    _, out = jsonl_job
    by_id = {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}
    for i, row in enumerate(JSONL_ROWS):
        for key, value in row.items():
            if key == "messages":
                assert [{k: v for k, v in m.items() if v is not None}
                        for m in by_id[i]["messages"]] == value
            else:
                assert by_id[i][key] == value


def test_pandas_and_ray_data_read_the_output(jsonl_job, ray_session):
    _, out = jsonl_job
    df = pd.read_parquet(out)
    assert sorted(df["id"]) == list(range(len(JSONL_ROWS)))
    rows = ray_session.data.read_parquet(str(out)).take_all()
    assert sorted(r["id"] for r in rows) == list(range(len(JSONL_ROWS)))


PARQUET_TABLE = pa.table({
    "id": ["q-b", "q-a", "q-c"],
    "prompt": ["Hello, my name is", "2, 4, 6, 8,", "The opposite of hot is"],
    "score": [0.5, None, 2.5],
    "meta": [{"k": 1}, None, {"k": 3}],
})


@pytest.fixture(scope="module")
def parquet_job(tmp_path_factory, ray_session):
    folder = tmp_path_factory.mktemp("parquet-job")
    pq.write_table(PARQUET_TABLE, folder / "prompts.parquet", row_group_size=2)
    out = folder / "out"
    options = {"max_tokens": MAX_TOKENS, "batch_size": 2, "progress": False}
    summary = run_batch_job(folder / "prompts.parquet", out, **options)
    return folder / "prompts.parquet", out, options, summary


def test_parquet_job_rows_equal_each_prompt_generated_alone(parquet_job, smollm2_llm):
    _, out, _, summary = parquet_job
    assert summary.rows == 3 and summary.error_rows == 0 and summary.num_shards == 2
    out_rows = pq.read_table(out).to_pylist()  # pyarrow.parquet reads the folder too
    assert sorted(r["id"] for r in out_rows) == sorted(PARQUET_TABLE["id"].to_pylist())
    by_id = {r["id"]: r for r in out_rows}
    inputs = PARQUET_TABLE.to_pylist()
    for row in inputs:
        got = by_id[row["id"]]
        assert (got["prompt"], got["score"], got["meta"]) == (row["prompt"], row["score"], row["meta"])
    assert_rows_match_oracle(smollm2_llm, inputs, {i: by_id[r["id"]] for i, r in enumerate(inputs)}, {})


def test_rerun_resumes_only_missing_batches(parquet_job):
    path, out, options, _ = parquet_job
    before = pq.read_table(out).sort_by("id")
    # Forget batch 0 (two rows), as if the run had stopped before writing it.
    m = Manifest.load(out)
    m.done.discard(0)
    m.rows_done -= 2
    m.complete = False
    m.save(out)
    (out / part_name(0)).unlink()
    (out / SUCCESS_NAME).unlink()
    summary = run_batch_job(path, out, **options)
    assert (summary.rows, summary.rows_resumed, summary.num_shards) == (2, 1, 1)
    assert pq.read_table(out).sort_by("id").equals(before)
    assert (out / SUCCESS_NAME).exists()
    again = run_batch_job(path, out, **options)  # complete: nothing to do, no worker started
    assert (again.rows, again.rows_resumed) == (0, 3)


def test_rerun_with_other_settings_is_refused(parquet_job, monkeypatch):
    path, out, options, _ = parquet_job
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    with pytest.raises(InputError, match=r"sampling\.max_tokens differ"):
        run_batch_job(path, out, **{**options, "max_tokens": MAX_TOKENS + 1})


def _no_workers(*args, **kwargs):
    raise AssertionError("a job-level error must be found before any worker starts")


@pytest.mark.parametrize("make_input, message", [
    (lambda d: d / "missing.jsonl", "error: no such file or folder: .*missing.jsonl"),
    (lambda d: _write(d / "in.jsonl", '{"text": "hi", "n": 1}\n'),
     "error: no prompt column: .*columns found: 'text', 'n'"),
    (lambda d: _write(d / "in.jsonl", '{"prompt": "hi"}\n{"prompt": \n'),
     r"error: .*in\.jsonl:2: not valid JSON"),
    (lambda d: _write(d / "in.csv", "prompt\nhi\n"), "error: .*unknown input type '.csv'"),
])
def test_job_level_errors_exit_2_before_any_worker(tmp_path, capsys, monkeypatch, make_input,
                                                   message):
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    rc = batch_main([str(make_input(tmp_path)), "-o", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1
    assert re.match(message, err[0]), err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_running_rows_below_one_exits_2_before_any_worker(tmp_path, capsys, monkeypatch,
                                                               value):
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    path = _write(tmp_path / "in.jsonl", '{"prompt": "hi"}\n')
    rc = batch_main([str(path), "-o", str(tmp_path / "out"), "--max-running-rows", value])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: max_running_rows must be an int >= 1, got {value}"], err


def test_unusable_model_exits_2_before_any_worker(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    path = _write(tmp_path / "in.jsonl", '{"prompt": "hi"}\n')
    rc = batch_main([str(path), "-o", str(tmp_path / "out"), "--model", str(tmp_path / "no.gguf")])
    assert rc == 2
    assert capsys.readouterr().err.startswith("error: no such model")


def _write(path, text):
    path.write_text(text)
    return path


GPU_SCRIPT = textwrap.dedent("""
    import dataclasses, json, shutil, sys
    import ray
    from ray_jobs import run_batch_job
    from ray_jobs.dispatch.local_ray import start_local_ray
    temp_dir = start_local_ray(num_cpus=2, num_gpus=2)  # two logical GPUs on a CPU machine
    try:
        summary = run_batch_job(sys.argv[1], sys.argv[2], max_tokens=1, batch_size=1,
                                progress=False)
        print("WORKERS=" + json.dumps([dataclasses.asdict(w) for w in summary.workers]))
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
""")


def test_one_worker_per_logical_gpu(tmp_path, smollm2_gguf_path, private_ray_env):
    """A Ray with two logical GPUs (on the CPU): two actors, pinned to different GPU ids,
    both given batches. Runs in its own process, so it has its own Ray."""
    path = _write(tmp_path / "in.jsonl",
                  "".join(json.dumps({"prompt": f"Number {i} is"}) + "\n" for i in range(2)))
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT, str(path), str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=private_ray_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("WORKERS="))
    workers = json.loads(line.removeprefix("WORKERS="))
    assert len(workers) == 2
    assert sorted(tuple(w["gpu_ids"]) for w in workers) == [(0,), (1,)]
    assert all(w["spans"] >= 1 for w in workers)
    assert all(w["device"] == "cpu" for w in workers)  # logical GPUs, no CUDA: the CPU
    assert sorted(ds.dataset(tmp_path / "out").to_table()["id"].to_pylist()) == [0, 1]


def test_output_folder_holds_only_parts_and_underscore_files(jsonl_job):
    _, out = jsonl_job
    names = sorted(p.name for p in out.iterdir())
    assert names[:3] == sorted([SUCCESS_NAME, MANIFEST_NAME, REPORT_NAME])
    assert LOCK_NAME not in names  # the job removed its lock as it ended
    assert all(n.startswith("part-") and n.endswith(".parquet") for n in names[3:])


def test_unknown_dtype_exits_2_before_any_worker(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    path = _write(tmp_path / "in.jsonl", '{"prompt": "hi"}\n')
    rc = batch_main([str(path), "-o", str(tmp_path / "out"), "--dtype", "float8"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("error: unknown dtype 'float8'")


def test_truncated_model_file_exits_2_before_any_worker(tmp_path, capsys, monkeypatch,
                                                         smollm2_gguf_path):
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        bad.write_bytes(f.read(8 << 20))  # the header and part of the tensor data
    path = _write(tmp_path / "in.jsonl", '{"prompt": "hi"}\n')
    rc = batch_main([str(path), "-o", str(tmp_path / "out"), "--model", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: ") and "cut.gguf" in err[0], err


def test_batch_worker_alone_matches_generate_and_isolates_a_bad_row(smollm2_llm):
    """`BatchWorker` without Ray: rows in order, equal to `LLM.generate` alone; rows that
    cannot run (longer than the context, empty) become error rows before any work, so the
    good rows still run as one batch (no row is re-run alone)."""
    worker = BatchWorker.from_llm(smollm2_llm)
    alone = []
    run_alone = worker._run_alone
    worker._run_alone = lambda *a: alone.append(a) or run_alone(*a)
    ids = smollm2_llm.tokenizer.encode("Hi there")
    params = SamplingParams(max_tokens=3)
    context = smollm2_llm.max_context
    table = worker.run_batch([GenerationRequest(tuple(ids), params),
                              GenerationRequest((1,) * 9000, params),  # longer than the context
                              GenerationRequest((1,) * context, params),  # no room to generate
                              GenerationRequest((), params),
                              GenerationRequest(tuple(ids), params)])
    assert table.schema.equals(WORKER_RESULT_SCHEMA)  # one row per sample, with its index
    (want,) = smollm2_llm.generate([ids], [params])
    good, long, full, empty, good2 = table.to_pylist()
    assert good == good2
    assert (good["generated_token_ids"], good["generated_text"], good["finish_reason"]) == (
        want.token_ids, want.text, want.finish_reason)
    assert good["num_input_tokens"] == len(ids) and good["error"] is None
    assert long["finish_reason"] == "error" and "9000 tokens" in long["error"]
    assert full["finish_reason"] == "error" and f"context is {context} tokens" in full["error"]
    assert (empty["finish_reason"], empty["error"]) == (
        "error", "empty prompt: a row needs at least one token")
    assert alone == []
    assert worker.gpu_ids() == []  # no GPU given by Ray to this process


def test_summary_splits_the_wall_time_into_phases(jsonl_job):
    """`timings` names each phase of the run once, in order, and the phases add up to the
    wall time; each worker was ready before its last result, within the run."""
    summary, _ = jsonl_job
    assert list(summary.timings) == list(driver.PHASES)
    assert all(v >= 0 for v in summary.timings.values())
    assert sum(summary.timings.values()) == pytest.approx(summary.wall_time_s)
    (worker,) = summary.workers
    assert 0 < worker.ready_s <= worker.last_result_s <= summary.wall_time_s
    assert len(worker.result_s) == worker.spans >= 1  # one per result it sent back
    assert list(worker.result_s) == sorted(worker.result_s)
    assert worker.ready_s <= worker.result_s[0] and worker.result_s[-1] == worker.last_result_s
    line = summary.format().splitlines()[-1]
    assert line.startswith("time: prepare ") and ", shutdown " in line


def test_rerun_with_nothing_left_has_only_a_prepare_phase(jsonl_job):
    summary, out = jsonl_job
    again = run_batch_job(out.parent / "prompts.jsonl", out, max_tokens=MAX_TOKENS, batch_size=3,
                          progress=False)
    assert (again.rows, again.rows_resumed) == (0, summary.rows)
    assert list(again.timings) == ["prepare"]
    assert again.timings["prepare"] == pytest.approx(again.wall_time_s)


def test_ready_line_says_batching_steps_and_pool(smollm2_llm):
    """The progress line once workers load: from a real worker's `info()` (CPU: continuous
    batching, no graphs), and for continuous workers whose graphs were captured on one and
    did not fit on the other."""
    from ray_jobs.dispatch.pool import ready_line
    from ray_jobs.workers.worker import BatchWorker

    info = BatchWorker.from_llm(smollm2_llm).info()
    tokens = smollm2_llm.pool.num_blocks * smollm2_llm.pool.block_size
    assert ready_line([info]) == (f"nanoserve: 1 worker(s) ready: continuous batching of up "
                                  f"to {smollm2_llm.max_batch_size} rows; "
                                  f"KV pool {tokens:,} tokens a worker")
    steps = {"step_mode": "graph", "graphs": 20, "graph_mib": 1206.4, "capture_s": 3.94,
             "capture_error": None, "prefill_graphs": 0}
    ok = dict(info, scheduler="continuous", steps=steps)
    failed = dict(ok, steps=dict(steps, step_mode="static", graphs=0, graph_mib=0.0,
                                 capture_s=0.0, capture_error="out of memory"))
    assert ready_line([ok, failed]) == (
        f"nanoserve: 2 worker(s) ready: continuous batching of up to "
        f"{smollm2_llm.max_batch_size} rows; decode steps as 20 CUDA graphs a "
        "worker (1,206 MiB, captured in 3.9 s); CUDA graphs not captured on 1 of 2 worker(s) "
        "(out of memory): their decode steps run uncaptured, slower; "
        f"KV pool {tokens:,} tokens a worker")
    with_prefills = dict(ok, steps=dict(steps, prefill_graphs=112, prefill_capture_s=2.04))
    assert "captured in 3.9 s); 112 prefill graphs (captured in 2.0 s); KV pool" in ready_line(
        [with_prefills])
