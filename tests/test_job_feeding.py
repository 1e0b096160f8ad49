"""A worker keeps its engine full whatever the batch size (`ray_jobs.dispatch.pool.hold_limits`).

A batch comes back only when its longest row ends. With every batch holding one long row,
a worker fed two batches at a time runs two long rows and little else while the rows of
later batches wait on the driver; fed by its engine's capacity, it runs as many rows as
its engine allows. The oracle is the engine's own count of rows in its decode steps
(`BatchWorker.engine_counters`, carried back with each answer), not time; and every row's
tokens equal the row generated alone.
"""

from __future__ import annotations

import json

import pytest

from nanoserve.sampling.params import SamplingParams
from ray_jobs import run_batch_job
from ray_jobs.dispatch.pool import actor_threads, hold_limits, starve_warning
from ray_jobs.workers.options import JobOptions

BATCH = 4  # rows a batch: one long row and three short ones
BATCHES = 12
MAX_RUNNING = 8  # the engine's most rows at once
LONG, SHORT = 40, 2  # max_tokens (ignore_eos: every row runs to it)


def feeding_rows() -> list[dict]:
    """Equal prompt lengths, so batches keep input order: row 4k of batch k is its long one."""
    return [{"id": i, "prompt_token_ids": [100 + (i * 7 + j) % 300 for j in range(6)],
             "max_tokens": LONG if i % BATCH == 0 else SHORT, "ignore_eos": True}
            for i in range(BATCH * BATCHES)]


def run_feeding_job(tmp_path, model, **options):
    path = tmp_path / "feeding.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in feeding_rows()))
    out = tmp_path / "out"
    summary = run_batch_job(path, out, model=str(model), batch_size=BATCH,
                            max_running_rows=MAX_RUNNING, progress=False, **options)
    return summary, out


@pytest.fixture(scope="module")
def fed_job(tmp_path_factory, ray_session, tiny_job_model):
    return run_feeding_job(tmp_path_factory.mktemp("fed"), tiny_job_model)


def test_default_options_keep_the_engine_full_while_long_rows_hold_their_batches(fed_job):
    summary, _ = fed_job
    (w,) = summary.workers
    assert w.max_rows == MAX_RUNNING
    assert w.decode_steps > 0
    # Six batches held at once: six long rows run together, the short rows around them.
    # Two batches at a time (the old default) ran 2-3 rows a step here.
    assert w.rows_per_step >= 0.6 * MAX_RUNNING, (w.decode_row_steps, w.decode_steps)
    # A round of long rows takes LONG steps; held six at a time, 12 long rows take two
    # rounds (and a few steps to admit), not six.
    assert w.decode_steps <= 3 * LONG, w.decode_steps
    assert 0 < w.busy_fraction <= 1
    assert "rows a decode step on average, of at most 8" in summary.format()


def test_fed_rows_equal_each_row_alone(fed_job, tiny_llm):
    import pyarrow.parquet as pq

    summary, out = fed_job
    got = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert summary.rows == len(got) == BATCH * BATCHES
    for row in feeding_rows():
        (want,) = tiny_llm.generate([row["prompt_token_ids"]], [SamplingParams(
            max_tokens=row["max_tokens"], ignore_eos=True)])
        assert got[row["id"]]["generated_token_ids"] == want.token_ids, row["id"]
        assert got[row["id"]]["finish_reason"] == "length"


def test_two_batches_in_flight_starve_the_engine_and_say_so(tmp_path, ray_session,
                                                            tiny_job_model, capsys):
    """The same job with the old fixed depth: the counters show the starved engine, and
    the job warns at its start."""
    summary, _ = run_feeding_job(tmp_path, tiny_job_model, max_in_flight_per_worker=2)
    (w,) = summary.workers
    assert w.rows_per_step < 0.5 * MAX_RUNNING, (w.decode_row_steps, w.decode_steps)
    assert "the engine will run part empty" in capsys.readouterr().err


def test_hold_limits_follow_the_engine_not_the_batch_count():
    """The numbers written out: a worker holds three times the rows its engine runs at once
    (DESIGN.md), in batches of 64, plus one batch so the batches never bind first."""
    opts = JobOptions(batch_size=64, max_running_rows=256)
    info = {"scheduler": "continuous", "max_rows": 256}
    spans, rows = hold_limits(info, opts)
    assert (spans, rows) == (13, 768)  # 768 = 3 x 256 rows = 12 batches of 64, + 1
    assert actor_threads(opts) == spans
    assert starve_warning(opts) is None
    # Left to the engine: its actor has threads for the most its default can be on the
    # device, and the limits follow the rows its engine reports once loaded.
    default = JobOptions(batch_size=64)
    assert actor_threads(default, on_gpu=False) == spans
    assert actor_threads(default, on_gpu=True) == 49  # 3 x 1,024 rows = 48 batches, + 1
    big = {"scheduler": "continuous", "max_rows": 1024}
    assert hold_limits(big, default) == (49, 3072)
    # A static engine and an embedding worker run one batch at a time: two are enough.
    assert hold_limits({"scheduler": "static", "max_rows": 256}, opts) == (2, None)
    assert hold_limits({"scheduler": "embedding"}, opts) == (2, None)
    # A user's depth is kept, and warned about when it starves the engine.
    explicit = JobOptions(batch_size=64, max_running_rows=256, max_in_flight_per_worker=2)
    assert hold_limits(info, explicit) == (2, None)
    assert "64 x max_in_flight_per_worker 2 = 128 rows" in starve_warning(explicit)
    assert starve_warning(JobOptions(batch_size=64, max_running_rows=32,
                                     max_in_flight_per_worker=2)) is None


def test_a_static_worker_runs_its_shard_sorted_by_length(tmp_path, ray_session, tiny_job_model,
                                                          tiny_llm):
    """A static engine pads a batch to its longest prompt: the worker sorts its shard's rows
    by length before cutting them into the engine's batches, so long and short prompts in
    alternation run as two padding-free pairs of each; the part keeps input order."""
    import pyarrow.parquet as pq

    rows = [{"id": i, "prompt_token_ids": [100 + (i * 5 + j) % 300 for j in
                                           range(24 if i % 2 else 3)], "max_tokens": 2}
            for i in range(8)]
    path = tmp_path / "alternating.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = run_batch_job(path, tmp_path / "out", model=str(tiny_job_model), batch_size=8,
                            max_running_rows=2, scheduler="static", kv_cache_bytes=32 << 20,
                            progress=False)
    assert summary.padding_waste == 0.0  # in input order: 21 of every 48 prefill slots
    got = pq.read_table(tmp_path / "out").to_pylist()
    assert [r["id"] for r in got] == list(range(8))
    for row, r in zip(rows, got):
        (want,) = tiny_llm.generate([row["prompt_token_ids"]], [SamplingParams(max_tokens=2)])
        assert r["generated_token_ids"] == want.token_ids, row["id"]
