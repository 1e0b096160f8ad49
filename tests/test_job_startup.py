"""What a batch job does before its first batch: the driver imports no engine (torch), and
a fresh run starts its workers while the rows are being prepared (a rerun that resumes
starts them only when a batch needs one)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from ray_jobs import run_batch_job
from ray_jobs.manifest import SUCCESS_NAME, Manifest, part_name
from ray_jobs.pool import WorkerPool
from ray_jobs.prepare import RowPreparer


def test_the_driver_imports_no_engine():
    """The command line and the job's driver (everything up to sending token ids to the
    workers) load without torch, Triton, gguf or transformers."""
    code = ("import sys, nanoserve_cli, ray_jobs.driver, ray_jobs.cli, ray_jobs.report\n"
            "from nanoserve.sampling import SamplingParams\n"
            "from nanoserve.weights import validate_checkpoint\n"
            "from nanoserve.tokenizer import Tokenizer\n"
            "print(sorted(m for m in ('torch', 'triton', 'gguf', 'transformers') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _write(path, n):
    path.write_text("".join(json.dumps({"prompt": f"Row {i}: tell me about the sea"}) + "\n"
                            for i in range(n)))
    return path


def _spy(monkeypatch):
    """Record, each time rows are prepared, whether the pool was ready by then (waiting up
    to `wait_s` for it)."""
    ready = threading.Event()
    seen: list[bool] = []
    wait_s = [0.0]
    real_start = WorkerPool.start
    real_prepare = RowPreparer.prepare

    def start(*args, **kwargs):
        pool = real_start(*args, **kwargs)
        ready.set()
        return pool

    def prepare(self, chunk, first_position):
        seen.append(ready.wait(wait_s[0]) if wait_s[0] else ready.is_set())
        return real_prepare(self, chunk, first_position)

    monkeypatch.setattr(WorkerPool, "start", start)
    monkeypatch.setattr(RowPreparer, "prepare", prepare)
    return ready, seen, wait_s


def test_fresh_run_loads_workers_while_rows_are_prepared(tmp_path, ray_session, tiny_job_model,
                                                         monkeypatch):
    """A fresh run: the workers start before the first rows are prepared (here preparing
    waits for them, and they become ready meanwhile). A rerun that resumes (a part went
    missing) prepares its rows before any worker starts, as before."""
    ready, seen, wait_s = _spy(monkeypatch)
    path = _write(tmp_path / "in.jsonl", 6)
    out = tmp_path / "out"
    options = {"model": str(tiny_job_model), "max_tokens": 2, "batch_size": 2,
               "kv_cache_bytes": 32 << 20, "progress": False, "chunk_rows": 3}
    wait_s[0] = 300.0
    summary = run_batch_job(path, out, **options)
    assert summary.rows == 6 and summary.error_rows == 0
    assert seen and all(seen), seen

    manifest = Manifest.load(out)
    manifest.done.discard(1)
    manifest.rows_done -= 2
    manifest.complete = False
    manifest.save(out)
    (out / part_name(1)).unlink()
    (out / SUCCESS_NAME).unlink()
    ready.clear()
    seen.clear()
    wait_s[0] = 0.0
    again = run_batch_job(path, out, **options)
    assert (again.rows, again.rows_resumed) == (2, 4)
    assert seen and not any(seen), seen
