"""What a batch job tells its user: rows by finish reason, a warning for constrained rows cut
by max_tokens (summary, stderr, report), parts in input order, phases named for what ran,
and what each task (generation, embedding) adds to the progress bar and the summary.

One job on the tiny random model (default model's tokenizer): its JSON-schema rows cannot
finish in 3-4 tokens, so they end by length."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

import ray_jobs.dispatch.driver as driver
import ray_jobs.dispatch.job_run as job_run
from ray_jobs import run_batch_job
from ray_jobs.output.manifest import REPORT_NAME

KV_BYTES = 32 << 20
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}},
          "required": ["name"], "additionalProperties": False}
# Prompt lengths out of input order, so a batch sorted by length differs from input order.
ROWS = [
    {"prompt": "short", "guided_json": SCHEMA},
    {"prompt": "a much longer prompt than the others, by a good many tokens",
     "guided_json": SCHEMA, "max_tokens": 4},
    {"prompt": ""},  # an error row
    {"prompt": "a middling prompt of a few words"},
    {"prompt": "tiny", "guided_regex": "[a-z]{30}"},
    {"prompt": "another prompt of middling length here"},
]


@pytest.fixture(scope="module")
def cut_job(tmp_path_factory, ray_session, tiny_job_model):
    folder = tmp_path_factory.mktemp("cut-job")
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = folder / "out"
    summary = run_batch_job(path, out, model=str(tiny_job_model), max_tokens=3,
                            batch_size=16, kv_cache_bytes=KV_BYTES, progress=False)
    return summary, out


def test_summary_counts_rows_by_finish_reason(cut_job):
    summary, _ = cut_job
    reasons = summary.finish_reasons
    assert list(reasons)[:3] == ["stop", "length", "error"]
    assert sum(reasons.values()) == summary.rows == 6
    assert reasons["error"] == summary.error_rows == 1
    assert reasons["length"] >= 3  # the constrained rows at least
    first = summary.format().splitlines()[0]
    assert first == (f"rows: 6 (stop {reasons['stop']}, length {reasons['length']}, "
                     f"error 1)")


def test_constrained_rows_cut_by_length_are_one_warning_line(cut_job):
    summary, _ = cut_job
    (warning,) = summary.warnings
    assert warning.startswith("warning: 3 constrained row(s) ended by length "
                              "(max_tokens 3-4): ")
    assert "raise --max-tokens" in warning
    assert summary.format().splitlines()[-1] == warning


def test_report_shows_finish_reasons_and_the_warning(cut_job):
    summary, out = cut_job
    page = (out / REPORT_NAME).read_text()
    reasons = ", ".join(f"{k} {v}" for k, v in summary.finish_reasons.items())
    assert f'<td data-key="finish_reasons">{reasons}</td>' in page
    assert '<p class="warning">warning: 3 constrained row(s)' in page
    data = json.loads(re.search(r'id="nanoserve-report-data">(.*?)</script>', page,
                                re.S).group(1).replace("<\\/", "</"))
    assert data["summary"]["finish_reasons"] == summary.finish_reasons
    assert data["summary"]["warnings"] == list(summary.warnings)


def test_each_part_holds_its_rows_in_input_order(cut_job):
    """A part holds one shard: consecutive input rows, in input order, its error row in its
    place, whatever order the engine ran them in."""
    _, out = cut_job
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 1  # 6 rows, shards of up to batch_size (16) rows
    ids = [pq.read_table(p, columns=["id"])["id"].to_pylist() for p in parts]
    assert ids == [[0, 1, 2, 3, 4, 5]]  # ids are positions


def test_a_single_computed_batch_is_one_generate_phase(cut_job):
    """The only result back is not a 'first shard' phase followed by 0 s of 'generate'."""
    summary, _ = cut_job
    assert list(summary.timings) == ["prepare", "ray", "workers", "generate", "shutdown"]
    line = summary.format().splitlines()[-2]
    assert line.startswith("time: ") and "first shard" not in line


def test_warning_goes_to_stderr_too(tmp_path, ray_session, tiny_job_model, capfd):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "x", "guided_regex": "[a-z]{30}"}) + "\n")
    summary = run_batch_job(path, tmp_path / "out", model=str(tiny_job_model), max_tokens=2,
                            kv_cache_bytes=KV_BYTES, progress=False)
    assert summary.finish_reasons == {"stop": 0, "length": 1, "error": 0}
    err = capfd.readouterr().err
    assert "warning: 1 constrained row(s) ended by length (max_tokens 2)" in err


def test_no_warning_without_constrained_rows():
    run = SimpleNamespace(cut_constrained={}, empty_answers=0)
    assert job_run._JobRun._warnings(run) == ()


def test_progress_rates_of_the_generation_and_embedding_tasks():
    from ray_jobs.tasks.embed import EMBED
    from ray_jobs.tasks.generate import GENERATE

    counts = dict(output_tokens=30, input_rows=10, input_tokens=250)
    assert job_run._JobRun._rates(SimpleNamespace(kind=GENERATE, **counts), 2.0) == \
        "15.0 out tok/s"
    assert job_run._JobRun._rates(SimpleNamespace(kind=EMBED, **counts), 2.0) == \
        "5.0 rows/s, 125.0 input tok/s"
    assert (GENERATE.command, EMBED.command) == ("batch", "embed")  # "nanoserve embed" bar


def test_one_summary_says_each_tasks_own_lines():
    """One `JobSummary` for both tasks: the rows line, the task's own lines, then the
    lines every job has."""
    common = dict(output_dir="out", rows=6, error_rows=1, rows_resumed=2, input_tokens=100,
                  output_tokens=40, wall_time_s=2.0, output_tokens_per_s=20.0,
                  padding_waste=0.25, num_shards=3, worker_restarts=1)
    generate = driver.JobSummary(**common, finish_reasons={"stop": 4, "length": 1, "error": 1})
    assert generate.format().splitlines() == [
        "rows: 6 (stop 4, length 1, error 1), 2 done by an earlier run",
        "tokens: 100 input, 40 output",
        "wall time: 2.0 s, 20.0 output tokens/s",
        "padding waste: 25.0% of the padded prefill",
        "shards: 3 on 0 worker(s); output: out",
        "recovered: 1 worker restart(s), 0 device out-of-memory error(s)"]
    embed = driver.JobSummary(**common, task="embed", truncated_rows=2, dimensions=64)
    assert embed.format().splitlines() == [
        "rows: 6 (1 error rows), 2 done by an earlier run",
        "truncated: 2 row(s) cut to the input limit",
        "vectors: 64 dimensions; tokens: 100 input",
        "wall time: 2.0 s, 3.0 rows/s, 50.0 tokens/s",
        "shards: 3 on 0 worker(s); output: out",
        "recovered: 1 worker restart(s), 0 device out-of-memory error(s)"]


def test_the_generation_rate_stands_beside_the_whole_walls():
    """The wall time's rate counts the job's fixed cost (Ray's start, the workers' load);
    beside it, the rate over the first-batch and generate phases, when the run had them."""
    common = dict(output_dir="out", rows=6, error_rows=0, rows_resumed=0, input_tokens=100,
                  output_tokens=40, wall_time_s=20.0, output_tokens_per_s=2.0,
                  padding_waste=0.0, num_shards=3, finish_reasons={"stop": 6})
    timed = driver.JobSummary(**common, timings={"prepare": 1.0, "ray": 9.0, "workers": 5.0,
                                                 "first_shard": 1.5, "generate": 2.5,
                                                 "shutdown": 1.0})
    assert "wall time: 20.0 s, 2.0 output tokens/s (generation: 4.0 s, 10.0 output tokens/s)" \
        in timed.format().splitlines()
    resumed = driver.JobSummary(**common, timings={"prepare": 1.0})  # nothing left to run
    assert "wall time: 20.0 s, 2.0 output tokens/s" in resumed.format().splitlines()
