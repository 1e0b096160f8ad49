"""The batch job: dataset I/O, the shard walk, the Ray worker actors, the driver and its
CLI; generation and embedding are its two tasks.

    from ray_jobs import run_batch_job, run_embed_job
    summary = run_batch_job("prompts.jsonl", "out/", max_tokens=64)
    summary = run_embed_job("docs.jsonl", "vectors/")  # = run_batch_job(..., task="embed")

Module map (docs/modules.md): `io` and `shards` (input stream, shard descriptors), `driver`
(`run_job`: the one job walk), `pool` (the job's actors), `tasks` (a shard's walk on a
worker, and what a task plugs into it), `task_generate` and `task_embed` (the two tasks),
`prepare` (prompt column, tokenization, error rows), `worker` (`BatchWorker`, one model per
process), `manifest` (job identity, resume), `report` (the job's HTML report),
`data_processor` (either task over a Ray Data dataset), `cli` (`nanoserve batch`,
`nanoserve embed`). Names are imported lazily so `nanoserve --help` stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JobOptions", "JobSummary", "run_batch_job", "run_embed_job", "run_job"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ray_jobs.dispatch import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'ray_jobs' has no attribute {name!r}")
