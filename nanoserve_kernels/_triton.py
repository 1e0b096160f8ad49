"""Triton, when it is installed, and what the kernel modules need to know about it.

When Triton is missing (e.g. macOS), or cannot run here (no CUDA GPU and no interpreter
asked for: it is then not imported, which saves a CPU process about 0.4 s of start-up), the
kernel modules still import: `triton.jit` is then the identity and `tl.constexpr` a
placeholder, so only the PyTorch references are usable and `HAS_TRITON` is False.

Triton decides at decoration time (`@triton.jit`) whether a kernel is compiled for the GPU
or run by its CPU interpreter, from the environment variable `TRITON_INTERPRET`. Each kernel
module therefore records `interpret_requested()` when it is imported, next to its kernels.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def interpret_requested() -> bool:
    """True when the environment asks Triton for its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


IMPORT_ENV = "NANOSERVE_TRITON_IMPORT"  # "1": import Triton even where it cannot run


def _triton_usable() -> bool:
    """Triton can run here: a CUDA GPU, or its CPU interpreter asked for. Elsewhere (a CPU-only
    machine) importing it would only cost start-up time (about 0.4 s), so it is not imported,
    unless IMPORT_ENV asks (compiling the kernels ahead of time on a machine without a GPU:
    tests/test_kernels_compile.py)."""
    flags = [os.environ.get(name, "0").strip().lower()
             for name in ("NANOSERVE_TRITON_INTERPRET", IMPORT_ENV)]
    if interpret_requested() or any(f in _TRUE for f in flags):
        return True
    import torch

    built_for_gpu = torch.version.cuda is not None or torch.version.hip is not None
    return built_for_gpu and torch.cuda.is_available()


try:
    if not _triton_usable():
        raise ImportError("no GPU and no interpreter asked for")
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _Placeholder:
        """Stands in for `triton` and `triton.language` so kernel modules can be imported."""

        constexpr = None
        float32 = None

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = _Placeholder()
    tl = _Placeholder()

def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); Triton tiles need power-of-two extents."""
    return 1 << max(0, int(n) - 1).bit_length()


__all__ = ["HAS_TRITON", "IMPORT_ENV", "interpret_requested", "next_power_of_2", "tl", "triton"]
