"""The batch job: dataset I/O, the shard walk, the Ray worker actors, the driver and its
CLI; generation, embedding, classification and pair scores are its tasks.

    from ray_jobs import run_batch_job, run_embed_job
    summary = run_batch_job("prompts.jsonl", "out/", max_tokens=64)
    summary = run_embed_job("docs.jsonl", "vectors/")  # = run_batch_job(..., task="embed")

Module map (docs/modules.md): one package per stage a row goes through, each importing only
the stages before it (tests/test_layering.py), above the job's base, `options` (`JOB`: the
job's own options, declared once):
  input        `io`, `shards`, `storage`, `json_shapes`, `openai_requests`: the input
               listed, scanned and read a shard at a time; filesystems; OpenAI request lines
  preparation  `prepare`, `row_images`, `batching`: prompt column, tokenization, images,
               error rows; a static engine's batches of a shard
  output       `manifest`: job identity, the parts' names, resume; `openai_files`: each
               shard's OpenAI output lines, `output.jsonl` / `errors.jsonl` joined
  workers      `tasks` (a shard's walk on a worker), `worker` (`BatchWorker`, one model per
               process), `options` (`JobOptions`), `span` (the record of an answer)
  tasks        `generate`, `embed`, `classify` (classify and score): the tasks
  report       `report` (the job's HTML report), `timeline` (its phases)
  dispatch     `driver` (`run_job`: the one job walk), `pool` (the job's actors),
               `autoscale`, `placement`, `local_ray`
and at the top `data_processor` (any task over a Ray Data dataset) and `cli`
(`nanoserve batch`, `embed`, `classify`, `score`). Names are imported lazily so `nanoserve --help`
stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["JobOptions", "JobSummary", "run_batch_job", "run_embed_job", "run_job"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ray_jobs.dispatch import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'ray_jobs' has no attribute {name!r}")
