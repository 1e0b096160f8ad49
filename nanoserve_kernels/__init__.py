"""Triton kernels of the engine and their PyTorch reference twins (the oracles).

The engine calls the dispatchers re-exported here from `nanoserve_kernels.backend`:
`decode_attention`, `prefill_attention`, `paged_prefill_attention`, `store_kv` and
`use_triton(device)`. Kernels and references live in `nanoserve_kernels.paged_attention`,
`nanoserve_kernels.paged_prefill`, `nanoserve_kernels.prefill_attention` (import its
functions with `from nanoserve_kernels.prefill_attention import ...`: the package attribute
`nanoserve_kernels.prefill_attention` is the dispatcher) and `nanoserve_kernels.kv_store`.

This package never imports `nanoserve`. Setting `NANOSERVE_TRITON_INTERPRET=1` before the
first import also sets `TRITON_INTERPRET=1`, so that the kernels are defined for Triton's CPU
interpreter.
"""

import os

if os.environ.get("NANOSERVE_TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanoserve_kernels.backend import (  # noqa: E402
    decode_attention,
    interpreter_requested,
    paged_prefill_attention,
    prefill_attention,
    store_kv,
    use_triton,
)

__all__ = [
    "decode_attention",
    "interpreter_requested",
    "paged_prefill_attention",
    "prefill_attention",
    "store_kv",
    "use_triton",
]
