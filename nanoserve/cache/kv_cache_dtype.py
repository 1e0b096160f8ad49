"""The KV cache's dtype (`LLM(kv_cache_dtype=...)`, `--kv-cache-dtype`) and, for an FP8
cache, its per-layer scales.

- "auto": the model's dtype (bfloat16 on a GPU, float32 on the CPU).
- "fp8" (or "fp8_e4m3"): float8 e4m3, one byte per element, so the pool holds twice the
  tokens of a bfloat16 one in the same memory. Keys and values are stored as x / scale
  and read as entry * scale, with one K scale and one V scale per layer
  (`nanoserve_kernels/kv_quant.py`). It needs a CUDA GPU of compute capability 8.9 or newer (Ada,
  Hopper, Blackwell): Triton has no e4m3 conversions before that. On the CPU it is refused:
  torch converts e4m3 to float32 at about 11 ns an element on the CPU, as much again as the
  decode read's gather costs, so an FP8 pool there would only trade speed for memory.

Scales come from the checkpoint when it has them (per layer N, under
`model.layers.N.self_attn.`), else they are 1.0 (no calibration: values within +-448 are
stored as they are, larger ones clamped), as vLLM does without them:
- `k_scale`, `v_scale` (vLLM, llm-compressor / compressed-tensors `kv_cache_scheme`);
- `attn.k_scale`, `attn.v_scale` (vLLM's own parameter names);
- `k_proj.k_scale`, `v_proj.v_scale` (NVIDIA ModelOpt);
- `k_proj.output_scale`, `v_proj.output_scale` (older compressed-tensors, AMD Quark);
- `kv_scale` (deprecated: one scale for both).
A scale per KV head (`[num_kv_heads]`) is reduced to its largest value, which keeps every
head within range. Layers without a scale of their own take 1.0. Without scales, a model
whose keys or values exceed 448 in magnitude (some checkpoints with large k biases) has
them clamped: such a model needs a checkpoint calibrated with scales.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nanoserve.errors import ModelError, NanoserveError
from nanoserve_kernels.kv_quant import FP8_DTYPE

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
MIN_FP8_CAPABILITY = (8, 9)

_SCALE_NAMES = {  # suffix under `model.layers.N.self_attn.` -> which scales it sets
    "k_scale": "k", "v_scale": "v",
    "attn.k_scale": "k", "attn.v_scale": "v",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "kv_scale": "kv",
}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The pool's dtype for `kv_cache_dtype`; an FP8 cache where it cannot run is refused
    with one line."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise NanoserveError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype
    need = "needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper)"
    if device.type != "cuda":
        raise NanoserveError(f"kv_cache_dtype={kv_cache_dtype!r} {need}; this engine runs on "
                             f"the {device.type.upper()}: use kv_cache_dtype='auto'")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise NanoserveError(f"kv_cache_dtype={kv_cache_dtype!r} {need}; "
                             f"{torch.cuda.get_device_name(device)} is "
                             f"{capability[0]}.{capability[1]}: use kv_cache_dtype='auto'")
    return FP8_DTYPE


def read_kv_scales(model_path: str | Path, num_layers: int
                   ) -> tuple[list[float], list[float], int]:
    """(k_scales, v_scales, layers found) from a checkpoint folder's safetensors files;
    1.0 where a layer has none (a GGUF file has none). Reads only the scale tensors."""
    from safetensors import SafetensorError, safe_open

    k, v = [1.0] * num_layers, [1.0] * num_layers
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    found: set[int] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    layer, which = _parse_scale_name(name)
                    if which is None or not 0 <= layer < num_layers:
                        continue
                    value = _scale_value(f.get_tensor(name), name, file)
                    if "k" in which:
                        k[layer] = value
                    if "v" in which:
                        v[layer] = value
                    found.add(layer)
        except SafetensorError as e:
            raise ModelError(f"{file}: cannot read KV cache scales: {e}") from None
    return k, v, len(found)


def _parse_scale_name(name: str) -> tuple[int, str | None]:
    """`model.layers.N.self_attn.<suffix>` -> (N, 'k' | 'v' | 'kv'), else (-1, None)."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
        return -1, None
    which = _SCALE_NAMES.get(".".join(parts[4:]))
    if which is None or not parts[2].isdigit():
        return -1, None
    return int(parts[2]), which


def _scale_value(t: torch.Tensor, name: str, file: Path) -> float:
    if t.numel() == 0 or t.dim() > 1:
        raise ModelError(f"{file}: {name} must be a scalar or one scale per KV head, "
                         f"got shape {tuple(t.shape)}")
    value = float(t.float().max())
    if not 0.0 < value < float("inf"):
        raise ModelError(f"{file}: {name} must be positive and finite, got {value}")
    return value


__all__ = ["KV_CACHE_DTYPES", "MIN_FP8_CAPABILITY", "read_kv_scales", "resolve_kv_cache_dtype"]
