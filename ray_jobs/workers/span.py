"""Stage workers: the record of a worker's answer to one span of a shard (`SpanRecord`),
read from its table's rows and the engine's counters in its footer (`span_record`).

The shard walk (`ray_jobs.workers.tasks.ShardRunner`) makes it beside the part it writes;
the driver folds each into the job report's running totals (`ray_jobs.report.report.ReportLog`).
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from ray_jobs.workers.worker import (
    DECODE_ROW_STEPS_KEY,
    FINISHED_ROW_STEPS_KEY,
    PREFILL_SLOTS_KEY,
    PREFILL_TOKENS_KEY,
    PROMPT_TOKENS_CACHED_KEY,
)


@dataclasses.dataclass(frozen=True)
class SpanRecord:
    """One answered span: a shard's rows sent in one call (the whole shard unless it was cut
    after worker deaths). Times are seconds from the job's start."""

    shard_id: int
    worker: int
    finished_s: float
    rows: int  # result rows: one per sample
    error_rows: int
    prompt_tokens: int
    output_tokens: int
    prefill_slots: int  # rows x longest prompt, summed over the engine's (sub-)batches
    prefill_real_tokens: int
    decode_row_steps: int
    finished_row_steps: int
    prompt_tokens_cached: int | None = None  # None: the engine has no prefix cache


def span_record(shard_id: int, worker: int, finished_s: float, table: pa.Table) -> SpanRecord:
    """The record of a worker's answer (its engine's tables, `BatchWorker.run_batch`'s: one
    row per sample). `rows` counts samples (what `batch_size` bounds); `prompt_tokens` counts
    each prompt once (its first sample's row), as the engine prefills it once."""
    meta = table.schema.metadata or {}
    cached = meta.get(PROMPT_TOKENS_CACHED_KEY)
    prompt_tokens = table["num_input_tokens"].to_pylist()
    if "sample_index" in table.schema.names:
        prompt_tokens = [n for n, i in zip(prompt_tokens, table["sample_index"].to_pylist())
                         if not i]
    return SpanRecord(
        shard_id, worker, finished_s, table.num_rows,
        error_rows=sum(r == "error" for r in table["finish_reason"].to_pylist()),
        prompt_tokens=sum(n or 0 for n in prompt_tokens),
        output_tokens=sum(n or 0 for n in table["num_generated_tokens"].to_pylist()),
        prefill_slots=int(meta.get(PREFILL_SLOTS_KEY, 0)),
        prefill_real_tokens=int(meta.get(PREFILL_TOKENS_KEY, 0)),
        decode_row_steps=int(meta.get(DECODE_ROW_STEPS_KEY, 0)),
        finished_row_steps=int(meta.get(FINISHED_ROW_STEPS_KEY, 0)),
        prompt_tokens_cached=None if cached is None else int(cached))


__all__ = ["SpanRecord", "span_record"]
