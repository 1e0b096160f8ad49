"""The batch job's options (`JobOptions`, the `nanoserve batch` flags), checked once when
built. Its own module so that the driver and the worker pool both read it, one way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.errors import NanoserveError
from nanoserve.model_store import DEFAULT_MODEL
from ray_jobs.autoscale import parse_num_workers
from ray_jobs.io import DEFAULT_CHUNK_ROWS

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = ("auto", "static", "continuous")  # as nanoserve.llm.SCHEDULERS (no torch here)


@dataclass(frozen=True)
class JobOptions:
    """The job's options (the CLI's flags). Sampling fields are the defaults that per-row
    columns override."""

    model: str = DEFAULT_MODEL
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    dtype: str = "auto"  # bfloat16 on GPU, float32 on CPU
    # None: one per GPU of the cluster, 1 without GPUs; or "MIN-MAX" / "auto": GPU workers
    # that grow as GPUs join (see ray_jobs.autoscale)
    num_workers: int | str | None = None
    batch_size: int = 64  # rows per batch
    max_batch_tokens: int | None = None  # rows x max(prompt + max_tokens) per batch
    window_batches: int = 8  # batches' worth of rows sorted by length together
    prompt_column: str | None = None
    id_column: str | None = None
    address: str | None = None  # Ray address; None: RAY_ADDRESS, a running cluster, or local
    overwrite: bool = False
    retry_errors: bool = False  # compute again the written batches that hold error rows
    kv_cache_fraction: float = 0.5  # of a GPU's free memory, for the KV pool
    kv_cache_bytes: int | None = None  # the KV pool's exact size per worker (else the above)
    scheduler: str = "auto"  # each worker's engine: continuous (nanoserve.llm.LLM)
    prefix_caching: bool = True  # engines reuse the KV blocks of shared prompt prefixes
    chunk_rows: int = DEFAULT_CHUNK_ROWS  # rows read and tokenized at a time
    max_in_flight_per_worker: int = 2
    worker_start_timeout_s: float = 600.0  # for an actor to be placed and load the model
    max_deaths_in_a_row: int = 8  # worker deaths with no batch finished between them
    progress: bool = True  # a tqdm bar on stderr

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        if self.scheduler not in SCHEDULERS:
            raise NanoserveError(f"unknown scheduler {self.scheduler!r}; choose "
                                 f"{', '.join(SCHEDULERS)}")
        if self.dtype not in DTYPES:
            raise NanoserveError(f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPES)}")
        parse_num_workers(self.num_workers)  # raises NanoserveError if invalid
        if not 0 < self.kv_cache_fraction <= 1:
            raise NanoserveError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise NanoserveError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.worker_start_timeout_s <= 0:
            raise NanoserveError(
                f"worker_start_timeout_s must be > 0, got {self.worker_start_timeout_s}")

    def sampling_defaults(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop, "ignore_eos": self.ignore_eos}


__all__ = ["DTYPES", "SCHEDULERS", "JobOptions"]
