"""Ctrl-C at the moments that matter, and the output folder's lock.

A real `nanoserve batch` in its own process group with its own private local Ray gets a real
SIGINT on its whole group, as a terminal's Ctrl-C does, at a moment the driver's testing hook
holds it (`NANOSERVE_FAULT_HOLD_AFTER_PARTS`: after this run's first recorded part, or after
the job's last one). Mid-job, it prints the run's summary and writes the report, lets the
folder go and exits 130; after the last part it completes the folder first and exits 0. The
same command then resumes, and its report covers the whole job, the earlier run's parts
included. Model: the tiny random Llama with the default model's tokenizer."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from nanoserve.errors import InputError
from ray_jobs import run_batch_job
from ray_jobs.output.manifest import (
    LOCK_NAME,
    MANIFEST_NAME,
    REPORT_NAME,
    SUCCESS_NAME,
    Manifest,
    hold_output_dir,
)
from ray_jobs.report.report import REPORT_DATA_ID

REPO = Path(__file__).resolve().parents[1]
LIMIT_S = 300
ROWS = 6  # in 3 batches of 2


def report_of(out: Path) -> dict:
    page = (out / REPORT_NAME).read_text()
    found = re.search(rf'id="{REPORT_DATA_ID}">(.*?)</script>', page, re.S)
    return json.loads(found.group(1).replace("<\\/", "</"))


def session_alive(sid: int) -> list[int]:
    """Pids (zombies excepted) of the processes of session `sid`, after waiting up to 30 s
    for them to end."""
    def alive():
        pids = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry))
        return pids

    deadline = time.monotonic() + 30
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive()


def ctrl_c_when_held(command, env, hold: Path, tmp_path: Path, name: str):
    """Run `command` in a new process group; when its driver holds at the hook, send SIGINT
    to the group; return (exit status, stdout, stderr). No process of it may outlive it."""
    hold.write_text("")
    holding = Path(f"{hold}.holding")
    with open(tmp_path / f"{name}.out", "w+") as out, open(tmp_path / f"{name}.err", "w+") as err:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + LIMIT_S
            while not holding.exists():
                assert proc.poll() is None, (tmp_path / f"{name}.err").read_text()[-3000:]
                assert time.monotonic() < deadline, "the driver never reached the hook"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole group
            proc.wait(timeout=LIMIT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            hold.unlink(missing_ok=True)
            holding.unlink(missing_ok=True)
        assert session_alive(proc.pid) == [], "processes of the job outlived it"
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def test_ctrl_c_mid_job_then_after_the_last_part(tiny_job_model, tmp_path, private_ray_env):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Row {i} of the job"}) + "\n"
                            for i in range(ROWS)))
    out = tmp_path / "out"
    hold = tmp_path / "hold"
    env = private_ray_env
    command = [sys.executable, "-m", "nanoserve_cli", "batch", str(path), "-o", str(out),
               "--model", str(tiny_job_model), "--batch-size", "2", "--max-tokens", "2",
               "--address", "local", "--no-progress", "--kv-cache-memory", "0.03125"]

    # Mid-job: held after its first part is recorded.
    rc, stdout, stderr = ctrl_c_when_held(
        command, {**env, "NANOSERVE_FAULT_HOLD_AFTER_PARTS": f"1:{hold}"}, hold, tmp_path,
        "first")
    assert rc == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "interrupted (rerun the same command to resume)"
    lines = stdout.strip().splitlines()
    assert lines[0].startswith("rows: 2 (") and f"report: {out / REPORT_NAME}" in lines
    assert lines[-1] == "interrupted: 1 of 3 shards are written; rerun the same command to resume"
    assert not (out / LOCK_NAME).exists() and not (out / SUCCESS_NAME).exists()
    job = report_of(out)["job"]
    assert (job["total_shards"], job["shards"], job["rows"]) == (
        3, {"this run": 1, "earlier runs": 0}, {"this run": 2, "earlier runs": 0})
    assert report_of(out)["summary"]["interrupted"] == [1, 3]
    done = Manifest.load(out).done
    for part in out.glob("part-*.parquet"):  # parts its worker wrote after the driver held:
        if int(part.stem.split("-")[1]) not in done:  # gone, so the rerun computes them
            part.unlink()

    # The same command resumes; held once every part is recorded: Ctrl-C then lets it finish.
    rc, stdout, stderr = ctrl_c_when_held(
        command, {**env, "NANOSERVE_FAULT_HOLD_AFTER_PARTS": f"last:{hold}"}, hold, tmp_path,
        "again")
    assert rc == 0, stderr[-3000:]
    assert "nanoserve: Ctrl-C came after the last part was written: the job was completed " \
           "first" in stderr
    lines = stdout.strip().splitlines()
    assert re.fullmatch(r"rows: 4 \(.*\), 2 done by an earlier run", lines[0]), lines
    assert f"report: {out / REPORT_NAME}" in lines and not lines[-1].startswith("interrupted")
    assert (out / SUCCESS_NAME).exists() and not (out / LOCK_NAME).exists()
    assert json.loads((out / MANIFEST_NAME).read_text())["complete"]
    data = report_of(out)
    job = data["job"]
    assert job["total_shards"] == sum(job["shards"].values()) == 3
    assert job["shards"] == {"this run": 2, "earlier runs": 1}  # the first run's, read back
    assert sum(job["rows"].values()) == ROWS == sum(job["finish_reasons"].values())
    assert job["rows"]["this run"] == data["summary"]["rows"]
    assert sorted(r["id"] for r in ds.dataset(out).to_table().to_pylist()) == list(range(ROWS))


def test_a_refused_or_finished_job_leaves_no_lock(tmp_path, no_ray, tiny_job_model):
    """A job refused on its output folder (files nanoserve did not write) leaves the folder
    as it found it: no `_nanoserve.lock` either."""
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="holds files nanoserve did not write"):
        run_batch_job(path, out, model=str(tiny_job_model), progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_lock_follows_its_file(tmp_path, monkeypatch):
    """The holder removes the lock file as it lets go. A job that opened the file just
    before (its holder then removed it) locks a file no longer in the folder: it lets go and
    locks the new one, so two jobs never both hold the folder."""
    out = tmp_path / "out"
    first = hold_output_dir(out)
    first.__enter__()
    assert (out / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    real_flock, released = fcntl.flock, []

    def flock(fd, op):  # the first holder lets go between this job's open and its flock
        if not released:
            released.append(first.__exit__(None, None, None))
            assert not (out / LOCK_NAME).exists()
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with hold_output_dir(out):
        assert released and (out / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with pytest.raises(InputError, match="another nanoserve job"):
            with hold_output_dir(out):
                pass
    assert list(out.iterdir()) == []
