"""Resuming the batch job: a driver SIGKILLed mid-job and run again with the same command,
parts written but not yet recorded, recorded parts gone missing, and reruns with other
settings.

The killed run is the real command (`python -m nanoserve_cli batch ...`) in its own
process group with its own private local Ray; the group is SIGKILLed and no process of
it may outlive the kill. Model: a tiny random Llama with the default model's tokenizer
(see test_failures.py). Oracles: parts written before the kill keep their bytes and
mtime; every input row is in the final output exactly once and equals `LLM.generate` on
that prompt alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

import ray_jobs.dispatch.job_run as job_run
from nanoserve.errors import InputError
from nanoserve.testing import assert_rows_match_engine
from ray_jobs import run_batch_job
from ray_jobs.cli import main as batch_main
from ray_jobs.dispatch.local_ray import OWNER_FILE, TEMP_PREFIX
from ray_jobs.dispatch.pool import WorkerPool
from ray_jobs.output.manifest import (
    MANIFEST_NAME,
    SUCCESS_NAME,
    Manifest,
    hold_output_dir,
    part_name,
)

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 2
LIMIT_S = 300


def prompts_of(n):
    return [f"Row {i} says: {'ab' * (i % 7)} {i * 13}" for i in range(n)]


def write_prompts(path, prompts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def output_rows(out):
    return ds.dataset(out).to_table().to_pylist()


def part_files(out):
    """{name: (mtime_ns, bytes)} of the parts in `out`."""
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.glob("part-*"))}


def live_processes_of_session(sid):
    """Pids of the processes (zombies excepted) whose session is `sid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left in it
        pass


def wait_until_gone(sid):
    deadline = time.monotonic() + 30
    while live_processes_of_session(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return live_processes_of_session(sid)


def assert_rows_match_oracle(llm, prompts, rows):
    assert_rows_match_engine(llm, prompts, rows, MAX_TOKENS)


def test_driver_killed_mid_job_resumes_keeping_written_parts(tiny_job_model, tiny_llm, tmp_path,
                                                            private_ray_env):
    prompts = prompts_of(120)
    path = write_prompts(tmp_path / "in.jsonl", prompts)
    out = tmp_path / "out"
    env = private_ray_env
    ray_tmp = env["TMPDIR"]  # the private Ray's session folders
    command = [sys.executable, "-m", "nanoserve_cli", "batch", str(path), "-o", str(out),
               "--model", str(tiny_job_model), "--batch-size", "2", "--max-tokens", str(MAX_TOKENS),
               "--address", "local", "--no-progress",
               # a static engine holds two shards at a time (a continuous one would hold all
               # 60 of these and write every part before the kill lands)
               "--scheduler", "static"]
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + LIMIT_S
            while not list(out.glob("part-*.parquet")):
                assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no part written in time"
                time.sleep(0.02)
        finally:
            kill_group(first.pid)  # the driver and the local Ray it started
            first.wait()
    assert wait_until_gone(first.pid) == [], "Ray processes outlived the killed driver"
    (left,) = Path(ray_tmp).glob(TEMP_PREFIX + "*")  # the killed driver's private Ray folder
    assert (left / OWNER_FILE).read_text().split()[0] == str(first.pid)
    before = part_files(out)
    assert before and not (out / SUCCESS_NAME).exists(), "the job ended before the kill"
    (out / f".{part_name(999)}.tmp-12345").write_bytes(b"half a part")  # a write cut short

    again = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = again.communicate(timeout=LIMIT_S)
    assert again.returncode == 0, stderr[-3000:]
    assert "done by an earlier run" in stdout, stdout
    assert wait_until_gone(again.pid) == [], "Ray processes outlived the finished driver"
    assert list(Path(ray_tmp).glob(TEMP_PREFIX + "*")) == []  # its own, and the killed one's
    after = part_files(out)
    for name, (mtime_ns, data) in before.items():
        assert after[name] == (mtime_ns, data), f"{name} was rewritten"
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    assert (out / SUCCESS_NAME).exists() and Manifest.load(out).rows_done == len(prompts)
    assert_rows_match_oracle(tiny_llm, prompts, output_rows(out))


@pytest.fixture(scope="module")
def finished_job(ray_session, tiny_job_model, tmp_path_factory):
    """A finished job of 6 rows in 3 batches, run once. On the way it checks that the
    driver never holds more than its in-flight limit of batches (1 worker x 2)."""
    original = job_run._JobRun._submit
    held = []

    def submit(self, span, index):
        original(self, span, index)
        held.append(len(self.in_flight) + len(self.queue))

    folder = tmp_path_factory.mktemp("finished-job")
    path = write_prompts(folder / "in" / "in.jsonl", prompts_of(6))
    # A fixed depth of 2 (not the engine-sized one), the bound this fixture checks.
    options = {"model": str(tiny_job_model), "max_tokens": MAX_TOKENS, "batch_size": 2,
               "kv_cache_bytes": 32 << 20, "progress": False, "max_in_flight_per_worker": 2}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(job_run._JobRun, "_submit", submit)
        run_batch_job(path, folder / "out", **options)
    assert held and max(held) <= 2
    return path, folder / "out", options


@pytest.fixture
def small_job(finished_job, tmp_path):
    """A copy of the finished job's output folder (files, bytes and mtimes) to alter."""
    path, out, options = finished_job
    shutil.copytree(out, tmp_path / "out")
    return prompts_of(6), path, tmp_path / "out", options


def forget(out, batch_id, rows):
    """Make the manifest say what it said before `batch_id` was recorded."""
    m = Manifest.load(out)
    m.done.discard(batch_id)
    m.rows_done -= rows
    m.complete = False
    m.save(out)
    (out / SUCCESS_NAME).unlink(missing_ok=True)


def test_manifest_holds_batch_ids_not_rows(small_job):
    _, _, out, _ = small_job
    saved = json.loads((out / MANIFEST_NAME).read_text())
    assert set(saved) == {"format", "settings", "complete", "rows_done", "done_batches"}
    assert saved["done_batches"] == [[0, 2]] and saved["rows_done"] == 6


def test_unrecorded_parts_are_adopted_if_theirs_and_recomputed_if_not(small_job, tiny_llm):
    """The run died after renaming parts 1 and 2 into place, before recording them; part 2
    then got batch 0's bytes. Part 1 is kept as it is (not computed again); part 2 holds
    other rows (its footer's batch digest says so), so batch 2 is computed again."""
    prompts, path, out, options = small_job
    before = part_files(out)
    (out / part_name(2)).write_bytes((out / part_name(0)).read_bytes())
    forget(out, 1, 2)
    forget(out, 2, 2)
    summary = run_batch_job(path, out, **options)
    assert (summary.rows, summary.rows_resumed) == (2, 4)
    after = part_files(out)
    assert after[part_name(0)] == before[part_name(0)]
    assert after[part_name(1)] == before[part_name(1)]
    assert Manifest.load(out).done == {0, 1, 2} and (out / SUCCESS_NAME).exists()
    assert_rows_match_oracle(tiny_llm, prompts, output_rows(out))


def test_rerun_with_everything_written_starts_no_worker(small_job, monkeypatch):
    """Killed after the last part was recorded but before `_SUCCESS`: the rerun only marks
    the folder complete."""
    _, path, out, options = small_job
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    forget(out, 99, 0)  # not complete, nothing missing
    summary = run_batch_job(path, out, **options)
    assert (summary.rows, summary.rows_resumed, summary.workers) == (0, 6, ())
    assert (out / SUCCESS_NAME).exists() and Manifest.load(out).complete


def test_recorded_part_that_went_missing_is_refused(small_job, monkeypatch):
    _, path, out, options = small_job
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    (out / part_name(2)).unlink()
    with pytest.raises(InputError, match=r"lacks 1 part\(s\) recorded as written "
                                         r"\(part-00002.parquet\); use --overwrite"):
        run_batch_job(path, out, **options)


def test_a_folder_another_job_holds_is_refused_and_freed_when_it_ends(small_job, monkeypatch):
    """One job per output folder: while another holds it (the lock's flock, taken here by
    this process through a second open file), a job on it stops before touching a file or
    starting a worker, naming the holder; once released, the same rerun goes through. A
    job that ends in an error releases the folder too (the SIGKILL case is
    test_driver_killed_mid_job_resumes_keeping_written_parts: its rerun takes the lock)."""
    _, path, out, options = small_job
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    forget(out, 99, 0)  # not complete, nothing missing: a rerun only marks it complete
    before = part_files(out)
    with hold_output_dir(out):
        with pytest.raises(InputError, match=rf"another nanoserve job \(pid {os.getpid()}\) is "
                                             r"writing to output folder .*choose another folder"):
            run_batch_job(path, out, **options)
    assert part_files(out) == before and not (out / SUCCESS_NAME).exists()
    with pytest.raises(InputError, match="other settings"):
        run_batch_job(path, out, **{**options, "max_tokens": MAX_TOKENS + 1})
    summary = run_batch_job(path, out, **options)
    assert (summary.rows, summary.rows_resumed) == (0, 6) and (out / SUCCESS_NAME).exists()


def _no_workers(*args, **kwargs):
    raise AssertionError("a job-level error must be found before any worker starts")


def test_rerun_with_other_model_input_or_sampling_is_refused_unless_overwrite(
        small_job, smollm2_gguf_path, monkeypatch, capsys, tmp_path):
    prompts, path, out, options = small_job
    before = part_files(out)
    monkeypatch.setattr(WorkerPool, "start", _no_workers)
    rc = batch_main([str(path), "-o", str(out), "--model", str(smollm2_gguf_path),
                     "--max-tokens", str(MAX_TOKENS), "--batch-size", "2", "--no-progress"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(errors) == 1
    assert errors[0].startswith(f"error: output folder {out} holds the output of a job with "
                                f"other settings (model.files differ); use --overwrite"), errors
    other_input = write_prompts(tmp_path / "other" / "in.jsonl", [p + "!" for p in prompts])
    with pytest.raises(InputError, match=r"\(input\.files differ\); use --overwrite"):
        run_batch_job(other_input, out, **options)
    with pytest.raises(InputError, match=r"\(sampling\.temperature differ\); use --overwrite"):
        run_batch_job(path, out, **{**options, "temperature": 0.5})
    assert part_files(out) == before  # refusals touch nothing

    monkeypatch.undo()
    summary = run_batch_job(path, out, **{**options, "temperature": 0.5}, overwrite=True)
    assert (summary.rows, summary.rows_resumed) == (6, 0)
    assert Manifest.load(out).settings["sampling"]["temperature"] == 0.5
    assert sorted(r["id"] for r in output_rows(out)) == list(range(6))
