"""Tile configs of the fused MoE GEMMs (nanoserve_kernels/fused_moe.py), per shape.

`fused_moe_configs.json` (written by `python -m benchmarks.tune_fused_moe` on a GPU) maps
a shape key "E=<experts>,N=<expert inner width>,K=<hidden>,<weights dtype>" to configs by
token count M: {"1": {...}, "64": {...}, ...}; a call with M tokens takes the config of
the largest tuned M <= its own (the smallest listed, below them all). Shapes not in the
file get `default_config(M)`. A config: BLOCK_M (the row tile, and the sorted pairs'
padding), BLOCK_N, BLOCK_K, num_warps, num_stages.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_FILE = Path(__file__).with_name("fused_moe_configs.json")


def shape_key(num_experts: int, inner: int, hidden: int, weight_dtype: str) -> str:
    return f"E={num_experts},N={inner},K={hidden},{weight_dtype}"


def default_config(m: int, block_k: int | None = None) -> dict[str, int]:
    """A sane untuned config: small row tiles for decode-sized M (each expert then holds
    few of the M * k pairs), larger ones for prefills. block_k: forced (block-wise FP8
    scales: one K block per scale block)."""
    if m <= 32:
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    elif m <= 512:
        config = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    else:
        config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    if block_k is not None:
        config["BLOCK_K"] = block_k
    return config


@functools.cache
def _tuned(path: str) -> dict[str, dict[str, dict[str, int]]]:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else {}


def get_config(m: int, num_experts: int, inner: int, hidden: int, weight_dtype: str,
               block_k: int | None = None, path: Path = CONFIG_FILE) -> dict[str, int]:
    """The config for M tokens of this shape (see the module docstring)."""
    by_m = _tuned(str(path)).get(shape_key(num_experts, inner, hidden, weight_dtype))
    if not by_m:
        return default_config(m, block_k)
    sizes = sorted(int(s) for s in by_m)
    best = max((s for s in sizes if s <= m), default=sizes[0])
    config = dict(by_m[str(best)])
    if block_k is not None:
        config["BLOCK_K"] = block_k
    return config


__all__ = ["CONFIG_FILE", "default_config", "get_config", "shape_key"]
