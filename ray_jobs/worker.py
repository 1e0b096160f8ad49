"""The batch worker: one `LLM` held for the life of the process, fed whole batches.

`BatchWorker` is a plain class (usable without Ray); the driver wraps it as a Ray actor,
one per GPU (`num_gpus=1`) or on the CPU (`num_cpus=1`) where the cluster has no GPUs.
The device is chosen inside the worker: `cuda` when Ray gave it a GPU and torch sees one,
else `cpu` (so logical GPUs on a CPU machine still work, on the CPU).

`run_batch` takes `GenerationRequest`s (token ids and their `SamplingParams`) and returns an
Arrow table with one row per request, in order, in `RESULT_SCHEMA`. A batch that fails as a
whole is retried row by row, so one bad row becomes one `error` row instead of failing its
batch; the table's schema metadata carries the engine's prefill counts (padding waste).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from nanoserve.errors import NanoserveError
from nanoserve.sampling import SamplingParams
from ray_jobs.io import RESULT_SCHEMA

PREFILL_SLOTS_KEY = b"nanoserve.prefill_slots"  # rows x longest prompt, summed over sub-batches
PREFILL_TOKENS_KEY = b"nanoserve.prefill_real_tokens"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


def ray_gpu_ids() -> list:
    """The GPU ids Ray assigned to this process ([] outside Ray or without GPUs)."""
    try:
        import ray
    except ImportError:
        return []
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


def pick_device() -> str:
    import torch

    return "cuda" if ray_gpu_ids() and torch.cuda.is_available() else "cpu"


class BatchWorker:
    def __init__(self, model: str, dtype: str = "auto", kv_cache_fraction: float = 0.5,
                 device: str | None = None, num_threads: int | None = None) -> None:
        """Load the model once. `device` None picks one (see the module docstring);
        `num_threads` caps torch's CPU threads (at most the machine's cores)."""
        import torch

        from nanoserve.llm import LLM

        if num_threads is not None:
            torch.set_num_threads(max(1, min(num_threads, os.cpu_count() or 1)))
        self.llm = LLM(model=model, dtype=dtype, device=device or pick_device(),
                       kv_cache_fraction=kv_cache_fraction)

    @classmethod
    def from_llm(cls, llm: Any) -> BatchWorker:
        """A worker around an already loaded `LLM`."""
        worker = cls.__new__(cls)
        worker.llm = llm
        return worker

    def info(self) -> dict[str, Any]:
        """Where this worker runs: Ray's GPU ids, the torch device, the host and process."""
        return {"gpu_ids": ray_gpu_ids(), "device": str(self.llm.device),
                "host": socket.gethostname(), "pid": os.getpid()}

    def gpu_ids(self) -> list:
        return ray_gpu_ids()

    def run_batch(self, batch_rows: list[GenerationRequest]) -> pa.Table:
        prompts = [list(r.prompt_token_ids) for r in batch_rows]
        params = [r.params for r in batch_rows]
        try:
            results = [_completion_row(c) for c in self.llm.generate(prompts, params)]
            stats = [getattr(self.llm, "last_stats", None)]
        except (NanoserveError, ValueError, RuntimeError):
            if len(batch_rows) == 1:
                raise
            results, stats = [], []
            for p, sp in zip(prompts, params):
                results.append(self._run_alone(p, sp))
                stats.append(getattr(self.llm, "last_stats", None))
        table = pa.Table.from_pylist(results, schema=RESULT_SCHEMA)
        slots = sum(getattr(s, "prefill_slots", 0) for s in stats if s is not None)
        real = sum(getattr(s, "prefill_real_tokens", 0) for s in stats if s is not None)
        return table.replace_schema_metadata({PREFILL_SLOTS_KEY: str(slots).encode(),
                                              PREFILL_TOKENS_KEY: str(real).encode()})

    def _run_alone(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        try:
            return _completion_row(self.llm.generate([prompt], [params])[0])
        except (NanoserveError, ValueError, RuntimeError) as e:
            return error_row(f"generation failed: {type(e).__name__}: {e}", len(prompt))


def _completion_row(c: Any) -> dict[str, Any]:
    return {"generated_text": c.text, "generated_token_ids": list(c.token_ids),
            "num_input_tokens": c.num_prompt_tokens, "num_generated_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason, "error": None}


def error_row(message: str, num_input_tokens: int = 0) -> dict[str, Any]:
    return {"generated_text": None, "generated_token_ids": None,
            "num_input_tokens": num_input_tokens, "num_generated_tokens": 0,
            "finish_reason": "error", "error": message}
