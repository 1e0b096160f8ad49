"""The batch job: dataset I/O, batching, the Ray worker actor, the driver and its CLI.

    from ray_jobs import run_batch_job
    summary = run_batch_job("prompts.jsonl", "out/", max_tokens=64)

Module map: `io` (input stream, output parts), `prepare` (prompt column, tokenization,
error rows), `batching` (static batches by token length), `manifest` (job identity,
resume), `worker` (`BatchWorker`, one model per process), `pool` (the job's actors),
`local_ray` (which Ray the job runs on), `timeline` (phase timings), `options`
(`JobOptions`), `driver` (`run_batch_job`), `report` (the job's HTML report),
`data_processor` (the engine over a Ray Data dataset), `cli` (`nanoserve batch`). Names
are imported lazily so `nanoserve --help` stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JobOptions", "JobSummary", "run_batch_job"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ray_jobs import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'ray_jobs' has no attribute {name!r}")
