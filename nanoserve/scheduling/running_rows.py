"""How many rows an engine decodes at once when its user sets no limit (torch-free: the
batch job's driver reads it too).

A decode step of more rows shares the weights' read among more tokens; above ~256 rows of
an 8B model its GEMMs are compute-bound (benchmarks/RESULTS.md), and what then bounds the
running set is the KV pool: rows that outgrow it are preempted and computed again. So the
default on a GPU is as many rows as the pool holds at ROW_TOKENS tokens each, within
[CPU_DEFAULT_ROWS, MAX_DEFAULT_ROWS] (vLLM's default on GPUs of 70 GB or more is 1,024), in
multiples of 32 (the captured steps' buckets above 256: `nanoserve.scheduling.model_runner.
decode_buckets`). On the CPU, where a step's time grows with its rows, CPU_DEFAULT_ROWS.
"""

from __future__ import annotations

MAX_DEFAULT_ROWS = 1024
CPU_DEFAULT_ROWS = 256
ROW_TOKENS = 512  # a batch job's rows run to ~1,000 tokens; half of that held on average


def default_max_rows(pool_tokens: int, on_gpu: bool) -> int:
    """The running-row limit for a pool of `pool_tokens` tokens (see the module docstring)."""
    if not on_gpu:
        return CPU_DEFAULT_ROWS
    rows = pool_tokens // ROW_TOKENS // 32 * 32
    return max(CPU_DEFAULT_ROWS, min(MAX_DEFAULT_ROWS, rows))


__all__ = ["CPU_DEFAULT_ROWS", "MAX_DEFAULT_ROWS", "ROW_TOKENS", "default_max_rows"]
