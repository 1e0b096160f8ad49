"""The batch job: dataset I/O, batching, the Ray worker actor, the driver and its CLI.

    from ray_jobs import run_batch_job
    summary = run_batch_job("prompts.jsonl", "out/", max_tokens=64)

Module map: `io` (input stream, output parts), `prepare` (prompt column, tokenization,
error rows), `batching` (static batches by token length), `manifest` (job identity,
resume), `worker` (`BatchWorker`, one model per process), `pool` (the job's actors),
`local_ray` (which Ray the job runs on), `timeline` (phase timings), `options`
(`JobOptions`), `driver` (`run_batch_job`), `report` (the job's HTML report),
`data_processor` (the engine over a Ray Data dataset), `cli` (`nanoserve batch`),
`embed_job` and `embed_cli` (embedding jobs, `nanoserve embed`). Names
are imported lazily so `nanoserve --help` stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JobOptions", "JobSummary", "run_batch_job"]


def run_batch_job(input: Any, output_dir: Any, **options: Any) -> Any:
    """`ray_jobs.driver.run_batch_job` (task="generate", the default), or with task="embed"
    the embedding job (`ray_jobs.embed_job.run_embed_job`: a vector per row)."""
    task = options.pop("task", "generate")
    if task == "embed":
        from ray_jobs.embed_job import run_embed_job

        return run_embed_job(input, output_dir, **options)
    if task != "generate":
        from nanoserve.errors import InputError

        raise InputError(f"task must be 'generate' or 'embed', got {task!r}")
    from ray_jobs.driver import run_batch_job as run

    return run(input, output_dir, **options)


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ray_jobs import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'ray_jobs' has no attribute {name!r}")
