"""The batch job under failure, on the tests' local Ray (CPU): workers killed mid-batch,
a row that kills its worker every time, workers killed while they load the model, workers
that cannot start, too many workers, a KV pool too small for a batch, device out-of-memory
errors.

Model: a tiny random Llama (hidden 64, 2 layers) that uses the default model's tokenizer,
so a worker starts in a few seconds and a restart is cheap. Oracle: every answered row
must equal `LLM.generate` on that prompt alone (same model files, greedy), the prompt
tokenized here independently of the job; every input row must be in the output exactly
once. Faults are injected through the worker's documented testing hooks
(`NANOSERVE_FAULT_*`, see `ray_jobs.workers.worker`) or by SIGKILLing a worker's process by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

import ray_jobs.dispatch.job_run as job_run
from nanoserve.errors import ModelError, NanoserveError
from nanoserve.sampling.params import SamplingParams
from nanoserve.testing import assert_rows_match_engine
from ray_jobs import run_batch_job
from ray_jobs.cli import main as batch_main
from ray_jobs.workers.worker import FAULT_HOLD_LOAD_WHILE_FILE

MAX_TOKENS = 3
KV_BYTES = 32 << 20  # a small KV pool: workers start faster than with the 1 GiB CPU default
PROMPTS = [f"Item {i}: the {w} fox jumps over {i * 7} lazy dogs"
           for i, w in enumerate(["quick", "slow", "red", "blue", "tall", "small", "old", "new",
                                  "calm", "loud", "shy", "bold"])]


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def output_rows(out):
    return ds.dataset(out).to_table().to_pylist()


def assert_every_row_once(rows, n):
    ids = [r["id"] for r in rows]
    assert sorted(ids) == list(range(n)), ids


def assert_matches_oracle(llm, prompts, row):
    ids = llm.tokenizer.encode(prompts[row["id"]])
    (want,) = llm.generate([ids], [SamplingParams(max_tokens=MAX_TOKENS)])  # this prompt alone
    assert row["error"] is None, row["error"]
    assert row["num_input_tokens"] == len(ids)
    assert row["generated_token_ids"] == want.token_ids, row["id"]
    assert row["generated_text"] == want.text
    assert row["finish_reason"] == want.finish_reason


def run_job(tiny_job_model, path, out, **options):
    options = {"model": str(tiny_job_model), "max_tokens": MAX_TOKENS, "batch_size": 2,
               "kv_cache_bytes": KV_BYTES, "progress": False, **options}
    return run_batch_job(path, out, **options)


def test_worker_killed_mid_shard_is_replaced_and_its_shards_run_again(
        ray_session, tiny_job_model, tiny_llm, tmp_path, monkeypatch):
    """SIGKILL the worker's process (pid from the actor's own `info()`) right after the
    third batch is sent to it, while the second is running: both run again on a fresh
    actor; every row is written once and equals the engine's output."""
    original = job_run._JobRun._submit
    killed = []

    def submit_then_kill(self, span, index):
        original(self, span, index)
        if self.sent == 3 and not killed:
            pid = self.pool.workers[index].info["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    monkeypatch.setattr(job_run._JobRun, "_submit", submit_then_kill)
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS)
    summary = run_job(tiny_job_model, path, tmp_path / "out")
    assert killed
    assert summary.worker_restarts == 1 and summary.workers[0].restarts == 1
    assert summary.rows == len(PROMPTS) and summary.error_rows == 0
    assert "1 worker restart(s)" in summary.format()
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, len(PROMPTS))
    for row in rows:
        assert_matches_oracle(tiny_llm, PROMPTS, row)


def test_continuous_worker_killed_holding_two_shards(
        ray_session, tiny_job_model, tiny_llm, tmp_path, monkeypatch):
    """The continuous scheduler: a worker runs the rows of its two in-flight batches in one
    running batch. SIGKILL it right after its second batch is sent: both batches run again
    on a fresh actor; every row is written once and equals the engine's output."""
    original = job_run._JobRun._submit
    killed = []

    def submit_then_kill(self, span, index):
        original(self, span, index)
        worker = self.pool.workers[index]
        if self.sent == 2 and not killed:
            assert worker.in_flight == 2
            os.kill(worker.info["pid"], signal.SIGKILL)
            killed.append(worker.info["pid"])

    monkeypatch.setattr(job_run._JobRun, "_submit", submit_then_kill)
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS)
    summary = run_job(tiny_job_model, path, tmp_path / "out", scheduler="continuous")
    assert killed and summary.worker_restarts == 1
    assert summary.rows == len(PROMPTS) and summary.error_rows == 0
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, len(PROMPTS))
    for row in rows:
        assert_matches_oracle(tiny_llm, PROMPTS, row)


def test_poison_row_is_isolated_and_only_it_becomes_an_error_row(
        ray_session, tiny_job_model, tiny_llm, tmp_path, monkeypatch, capsys):
    """A row whose prompt kills its worker every time: its shard (4 rows) kills the worker
    twice, is cut in halves, the half holding it kills it and is cut again, the row alone
    kills it: 4 restarts (5 if the shard sent before it finished but its reply was lost in
    the first death), then that row is an `error` row and every other row is answered."""
    monkeypatch.setenv("NANOSERVE_FAULT_KILL_ON_TEXT", "POISON")
    prompts = PROMPTS[:8]
    prompts[5] = "This POISON row kills its worker"
    path = write_prompts(tmp_path / "in.jsonl", prompts)
    summary = run_job(tiny_job_model, path, tmp_path / "out", batch_size=4)
    assert summary.worker_restarts in (2 + 1 + 1, 1 + 2 + 1 + 1)
    assert summary.rows == 8 and summary.error_rows == 1
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, 8)
    for row in rows:
        if row["id"] == 5:
            assert row["finish_reason"] == "error" and row["generated_token_ids"] is None
            assert "the worker died while processing this row" in row["error"]
        else:
            assert_matches_oracle(tiny_llm, prompts, row)
    err = capsys.readouterr().err
    deaths = re.findall(r"nanoserve: worker 0 died while running shard \d+", err)
    assert len(deaths) == summary.worker_restarts


def test_workers_that_die_on_every_shard_stop_the_job(ray_session, tiny_job_model, tmp_path,
                                                      monkeypatch):
    """Every row kills its worker (a broken node, not a bad row): after
    `max_deaths_in_a_row` deaths with nothing finished in between the job stops, rather
    than turning every row into an error row one restart at a time."""
    monkeypatch.setenv("NANOSERVE_FAULT_KILL_ON_TEXT", "Item")
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:4])
    with pytest.raises(NanoserveError, match=r"workers died 3 times in a row without answering "
                                             r"a shard \(last: .*\); the job stopped \(rerun it "
                                             r"to resume\)"):
        run_job(tiny_job_model, path, tmp_path / "out", max_deaths_in_a_row=2)
    assert list((tmp_path / "out").glob("part-*")) == []


def test_worker_that_cannot_load_the_model_fails_the_job_in_one_line(
        ray_session, tiny_job_model, tmp_path, monkeypatch, capsys):
    """A load that raises (here a ModelError from the worker's hook; a bad checkpoint, an
    unsupported model, no device memory for the weights) stops the job at once: one line,
    exit status 2, nothing written, no worker started again."""
    monkeypatch.setenv("NANOSERVE_FAULT_LOAD", "raise")
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2])
    rc = batch_main([str(path), "-o", str(tmp_path / "out"), "--model", str(tiny_job_model),
                     "--max-tokens", "2", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.splitlines()
    errors = [ln for ln in err if ln.startswith("error:")]
    assert len(errors) == 1 and re.match(
        "error: a worker could not load the model: .*NANOSERVE_FAULT_LOAD=raise", errors[0]), err
    assert not any("died while loading" in ln for ln in err), err
    assert list((tmp_path / "out").glob("part-*")) == []


def holding(hold: Path, n: int, timeout_s: float = 120.0) -> list[int]:
    """The pids of the first `n` workers waiting in their constructor on `hold` (the
    worker's NANOSERVE_FAULT_HOLD_LOAD_WHILE_FILE hook), once there are that many."""
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        path = Path(f"{hold}.holding")
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [int(ln.split()[0]) for ln in lines[:n]]
        if not hold.exists():
            break
        time.sleep(0.05)
    raise TimeoutError(f"{len(lines)} of {n} workers reached the load hold")


def test_worker_killed_while_loading_is_replaced_and_the_job_completes(
        ray_session, tiny_job_model, tiny_llm, tmp_path, monkeypatch, capsys):
    """Two workers held in their constructor, before loading the model; one is SIGKILLed
    there (as the kernel's out-of-memory killer or a reclaimed node would). It is replaced
    by a fresh actor (held too, so the replacement certainly starts), with one line saying
    so; the job completes: every row once, equal to the engine's output alone."""
    hold = tmp_path / "hold-load"
    hold.write_text("held")
    monkeypatch.setenv(FAULT_HOLD_LOAD_WHILE_FILE, str(hold))
    killed: list[int] = []
    failure: list[BaseException] = []

    def kill_one_then_release():
        try:
            first = holding(hold, 2)
            os.kill(first[1], signal.SIGKILL)
            killed.append(first[1])
            holding(hold, 3)  # its replacement reached the hold
        except BaseException as e:  # the test reports it
            failure.append(e)
        finally:
            hold.unlink(missing_ok=True)

    thread = threading.Thread(target=kill_one_then_release, daemon=True)
    thread.start()
    try:
        path = write_prompts(tmp_path / "in.jsonl", PROMPTS)
        summary = run_job(tiny_job_model, path, tmp_path / "out", num_workers=2,
                          worker_start_timeout_s=120)
    finally:
        hold.unlink(missing_ok=True)
        thread.join(timeout=130)
    assert not failure, failure
    assert killed
    err = capsys.readouterr().err
    died = re.findall(r"nanoserve: worker (\d) died while loading the model \((.*)\); "
                      r"replacing it \(restart 1 of at most 8\)", err)
    assert len(died) == 1, err
    assert died[0][1] == "its worker process has died", err
    assert "could not load" not in err
    assert summary.worker_restarts == 1 and len(summary.workers) == 2
    assert summary.workers[int(died[0][0])].restarts == 1
    assert summary.rows == len(PROMPTS) and summary.error_rows == 0
    assert_rows_match_engine(tiny_llm, PROMPTS, output_rows(tmp_path / "out"), MAX_TOKENS)


def test_a_slot_whose_workers_keep_dying_while_loading_is_given_up(
        ray_session, tiny_job_model, tmp_path, monkeypatch, capsys):
    """Every worker process exits while loading (the hook's `exit`; as one the kernel's
    out-of-memory killer ends every time would): the slot's actor is replaced up to the
    restart budget (`max_deaths_in_a_row`, here 1), then given up; with no worker left the
    job stops with one line naming the likely cause. Nothing is written."""
    monkeypatch.setenv("NANOSERVE_FAULT_LOAD", "exit")
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2])
    with pytest.raises(NanoserveError) as caught:
        run_job(tiny_job_model, path, tmp_path / "out", max_deaths_in_a_row=1)
    message = str(caught.value)
    assert re.fullmatch(
        r"worker 0 died 2 times in a row while loading the model \(last: its worker process "
        r"has died\), and no worker is left: the likely cause is too little host memory on "
        r"its node for the model \(the kernel's out-of-memory killer: see dmesg there\), or "
        r"a failing node; the job stopped \(rerun it to resume\)", message), message
    err = capsys.readouterr().err
    assert len(re.findall(r"nanoserve: worker 0 died while loading the model \(its worker "
                          r"process has died\); replacing it \(restart 1 of at most 1\)",
                          err)) == 1, err
    assert "giving it up: the likely cause is too little host memory" in err
    assert list((tmp_path / "out").glob("part-*")) == []


def test_more_workers_than_the_cluster_can_place_are_capped_with_a_warning(
        ray_session, tiny_job_model, tiny_llm, tmp_path, capsys):
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:6])
    summary = run_job(tiny_job_model, path, tmp_path / "out", num_workers=5)
    assert "5 workers asked for, but the cluster has 2 CPU(s)" in capsys.readouterr().err
    assert len(summary.workers) == 2
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, 6)
    for row in rows:
        assert_matches_oracle(tiny_llm, PROMPTS, row)


@contextlib.contextmanager
def cpus_held(ray, num_cpus: int):
    """An actor holding `num_cpus` of the local cluster's CPUs for the block's duration."""

    @ray.remote(num_cpus=num_cpus)
    class Holder:
        def ready(self):
            return True

    holder = Holder.remote()
    try:
        ray.get(holder.ready.remote())
        yield
    finally:
        ray.kill(holder)


def test_no_room_for_any_worker_fails_after_the_start_timeout(
        ray_session, tiny_job_model, tmp_path):
    """Every CPU of the cluster held by another actor: the job's worker cannot be placed,
    and the job says so after `worker_start_timeout_s` instead of waiting forever."""
    with cpus_held(ray_session, 2):
        path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2])
        with pytest.raises(NanoserveError, match=r"no worker was ready within 3 s: the cluster "
                                                 r"has no free CPU"):
            run_job(tiny_job_model, path, tmp_path / "out", worker_start_timeout_s=3)


def test_batch_bigger_than_the_kv_pool_is_split_and_a_row_too_big_alone_is_an_error(
        ray_session, tiny_job_model, tiny_llm, tmp_path):
    """A KV pool of 4 blocks (64 tokens): a batch of 4 rows needing 8 blocks is run in
    sub-batches that fit; a prompt that needs more than 4 blocks alone is an `error` row."""
    prompts = PROMPTS[:8]
    prompts[3] = " ".join(["word"] * 80)  # 80 tokens: 6 blocks of 16 tokens alone
    path = write_prompts(tmp_path / "in.jsonl", prompts)
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers x (k, v) x kv heads x head dim x fp32 x tokens
    summary = run_job(tiny_job_model, path, tmp_path / "out", batch_size=4,
                      kv_cache_bytes=4 * per_block)
    assert summary.rows == 8 and summary.error_rows == 1
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, 8)
    for row in rows:
        if row["id"] == 3:
            assert row["finish_reason"] == "error"
            assert "does not fit the worker's KV cache even alone" in row["error"]
            assert "the cache holds 4" in row["error"]
        else:
            assert_matches_oracle(tiny_llm, prompts, row)


def test_retry_errors_computes_again_only_the_shards_with_error_rows(
        ray_session, tiny_job_model, tiny_llm, tmp_path, capsys):
    """A row too big for a small KV pool is an error row; a plain rerun keeps it; a rerun
    with a bigger pool and --retry-errors computes again only its batch (the other parts
    keep their bytes and mtimes), and then every row equals the engine's output alone."""
    prompts = PROMPTS[:8]
    prompts[3] = " ".join(["word"] * 80)  # 80 tokens: 6 blocks of 16 tokens alone
    path = write_prompts(tmp_path / "in.jsonl", prompts)
    out = tmp_path / "out"
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # layers x (k, v) x kv heads x head dim x fp32 x tokens
    first = run_job(tiny_job_model, path, out, batch_size=4, kv_cache_bytes=4 * per_block)
    assert first.error_rows == 1 and first.num_shards == 2
    parts = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("part-*")}
    bad_part = next(name for name in parts
                    if ds.dataset(out / name).to_table().column("error").null_count < 4)

    again = run_job(tiny_job_model, path, out, batch_size=4, kv_cache_bytes=KV_BYTES)
    assert (again.rows, again.rows_resumed) == (0, 8)  # resuming alone retries nothing
    assert sum(r["error"] is not None for r in output_rows(out)) == 1

    rc = batch_main([str(path), "-o", str(out), "--model", str(tiny_job_model),
                     "--max-tokens", str(MAX_TOKENS), "--batch-size", "4",
                     "--kv-cache-memory", str(KV_BYTES / 2**30), "--retry-errors",
                     "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    assert re.search(r"^rows: 4 \(stop \d+, length \d+, error 0\), 4 done by an earlier run$",
                     captured.out, re.M), captured.out
    assert "--retry-errors: computing again 1 shard(s)" in captured.err
    rows = output_rows(out)
    assert_every_row_once(rows, 8)
    for row in rows:
        assert_matches_oracle(tiny_llm, prompts, row)
    for name, (mtime_ns, data) in parts.items():
        now = (out / name).stat().st_mtime_ns, (out / name).read_bytes()
        assert (now == (mtime_ns, data)) == (name != bad_part), name
    assert (out / "_SUCCESS").exists()


def test_device_out_of_memory_is_retried_smaller_and_reported(
        ray_session, tiny_job_model, tiny_llm, tmp_path, monkeypatch, capsys):
    """The model's forward raises torch.OutOfMemoryError on more than one row: the static
    engine halves each batch of 4 until rows run alone; no row fails, and the count is
    reported."""
    monkeypatch.setenv("NANOSERVE_FAULT_OOM_ABOVE_ROWS", "1")
    prompts = PROMPTS[:8]
    path = write_prompts(tmp_path / "in.jsonl", prompts)
    summary = run_job(tiny_job_model, path, tmp_path / "out", batch_size=4, scheduler="static")
    assert summary.error_rows == 0
    assert summary.device_oom_errors == 2 * (1 + 2)  # per batch: 4 rows, then 2 and 2
    assert "6 device out-of-memory error(s)" in summary.format()
    assert "ran out of device memory 3 time(s)" in capsys.readouterr().err
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, 8)
    for row in rows:
        assert_matches_oracle(tiny_llm, prompts, row)


def test_out_of_memory_even_for_one_row_is_an_error_row_not_a_failed_job(
        ray_session, tiny_job_model, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOSERVE_FAULT_OOM_ABOVE_ROWS", "0")
    path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:3])
    summary = run_job(tiny_job_model, path, tmp_path / "out")
    assert summary.rows == 3 and summary.error_rows == 3
    rows = output_rows(tmp_path / "out")
    assert_every_row_once(rows, 3)
    assert all("ran out of memory even for this row alone" in r["error"] for r in rows)


def test_load_failure_stops_the_job_without_waiting_for_a_worker_still_unplaced(
        ray_session, tiny_job_model, tmp_path, monkeypatch):
    """Two workers on a cluster with room for one: the placed one cannot load the model.
    The job stops with that worker's error as soon as it reports it, rather than waiting
    out `worker_start_timeout_s` (here far longer than the test) for the other one."""
    monkeypatch.setenv("NANOSERVE_FAULT_LOAD", "raise")
    with cpus_held(ray_session, 1):
        path = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2])
        with pytest.raises(ModelError, match=r"a worker could not load the model: "
                                             r".*NANOSERVE_FAULT_LOAD=raise"):
            run_job(tiny_job_model, path, tmp_path / "out", num_workers=2,
                    worker_start_timeout_s=600)
    assert list((tmp_path / "out").glob("part-*")) == []
