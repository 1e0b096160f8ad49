"""Mixture-of-experts checkpoints: per-expert tensors stacked into one tensor per projection.

Names as stored, per MoE layer N and expert e, and what they become:

| stored (per expert)                                    | stacked                                   |
|--------------------------------------------------------|-------------------------------------------|
| `mlp.experts.e.gate_proj` / `up_proj` (Qwen3-MoE)       | `mlp.experts.gate_up_proj` [E, 2I, d]     |
| `block_sparse_moe.experts.e.w1` / `w3` (Mixtral)       |   (gate rows, then up rows)               |
| `mlp.experts.e.down_proj` / `block_sparse_moe...w2`    | `mlp.experts.down_proj` [E, d, I]         |
| `block_sparse_moe.gate.weight` (Mixtral's router)      | `mlp.gate.weight` [E, d]                  |

(all under `model.layers.N.`, the per-expert ones with `.weight`; each family's module and
expert names are its `MoeLayout` in nanoserve/model/families.py). A checkpoint already
stored stacked (transformers 5.x's module names: `mlp.experts.gate_up_proj`) loads as it is;
transformers 5.25's `save_pretrained` writes the per-expert names.

FP8 experts (e4m3 with their scales, nanoserve/model/quantization.py) stay e4m3, with the scale
beside each stacked tensor as `<name>_scale`: block-wise [E, rows/bn, cols/bk] when the
block grid of gate and up stacks into the fused one (I, d multiples of the blocks), or one
scale per row [E, rows] (per-tensor and per-channel scales, expanded exactly). Block-wise
experts whose grid does not stack (tiny test shapes; the published ones do) are
dequantized to float32 here, and requantized per row where the device computes FP8.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nanoserve.errors import ModelError
from nanoserve.model.config import STACKED, ModelConfig

if TYPE_CHECKING:
    import torch


def _stack(config: ModelConfig, items: dict[str, Any],
           stack: Callable[[list[Any], list[Any], str], Any]) -> dict[str, Any]:
    """items (tensors or shapes by name) with each MoE layer's per-expert entries replaced by
    stack(per-expert source names, items, target), in place (a layer's per-expert tensors
    are freed as its stacked ones are made: the host never holds the experts twice)."""
    moe = config.family.moe
    if not config.moe_layers or moe is None:
        return items
    if moe.module != "mlp":  # e.g. Mixtral's `block_sparse_moe.`: renamed `mlp.`
        block = re.compile(rf"^(model\.layers\.\d+\.){re.escape(moe.module)}\.")
        for name in [n for n in items if block.match(n)]:
            items[block.sub(r"\1mlp.", name)] = items.pop(name)
    for layer in config.moe_layers:
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in items or p + "down_proj" in items:
            continue  # stored stacked
        spellings = moe.expert_names
        names = next((n for n in spellings if f"{p}0.{n[0]}.weight" in items), spellings[0])
        for target, parts in (("gate_up_proj", names[:2]), ("down_proj", names[2:])):
            sources = [[f"{p}{e}.{part}" for part in parts] for e in range(config.num_experts)]
            for group in sources:
                for s in group:
                    if s + ".weight" not in items:
                        raise ModelError(f"tensor {s + '.weight'!r} is missing (expert "
                                         f"weights of layer {layer})")
            items.update(stack(sources, items, p + target))
    return items


def stacked_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
    """Header shapes with the experts stacked (torch-free: a job's driver checks headers)."""
    def stack(sources, items, target):
        rows = sum(items[s + ".weight"][0] for s in sources[0])
        return {target: (len(sources), rows, items[sources[0][0] + ".weight"][1])}
    return _stack(config, dict(shapes), stack)


def stack_experts(config: ModelConfig, tensors: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """`tensors` with the experts stacked (the module docstring), in place: per-expert
    tensors are popped as they are stacked. Returns `tensors`."""
    def stack(sources, items, target):
        import torch

        weights = [[items.pop(s + ".weight") for s in group] for group in sources]
        from nanoserve.weights.fp8 import FP8

        if weights[0][0].dtype != FP8:
            return {target: torch.stack([torch.cat(g) for g in weights])}
        return _stack_fp8(config, sources, items, weights, target)
    return _stack(config, tensors, stack)


def _stack_fp8(config, sources, items, weights, target) -> dict[str, torch.Tensor]:
    import torch

    from nanoserve.weights.fp8 import dequantize

    scheme = config.quantization
    if scheme is None:
        raise ModelError(f"expert weights of {target} are FP8 but config.json has no "
                         f"quantization_config")
    scales = []
    for group in sources:
        for s in group:
            name = f"{s}.{scheme.weight_scale_name}"
            if name not in items:
                raise ModelError(f"tensor {s}.weight is FP8 but its scale {name!r} is missing")
            scales.append(items.pop(name).float())
            items.pop(s + ".input_scale", None)
    per = len(sources[0])  # matrices per expert: 2 (gate, up) or 1 (down)
    block = scheme.block
    rows, cols = weights[0][0].shape
    if block is not None and rows % block[0] == 0 and cols % block[1] == 0:
        stacked = [torch.cat(scales[e * per:(e + 1) * per]) for e in range(len(sources))]
        return {target: torch.stack([torch.cat(g) for g in weights]),
                target + "_scale": torch.stack(stacked)}
    if block is not None:  # the block grid does not stack: exact float32, requantized
        # per row where the device computes FP8 (nanoserve/weights/fp8.py's `_fp8_experts`)
        return {target: torch.stack([
            torch.cat([dequantize(q, scales[e * per + j], block) for j, q in enumerate(group)])
            for e, group in enumerate(weights)])}
    qs, row_scales = [], []
    for e, group in enumerate(weights):
        qs.append(torch.cat(group))
        row_scales.append(torch.cat([scales[e * per + j].reshape(-1).expand(q.shape[0])
                                     for j, q in enumerate(group)]))
    return {target: torch.stack(qs), target + "_scale": torch.stack(row_scales)}


def expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The stacked MoE tensors `layer` needs, by name, with their shapes."""
    e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    p = f"model.layers.{layer}.mlp."
    shapes = {p + "gate.weight": (e, d), p + "experts.gate_up_proj": (e, 2 * i, d),
              p + "experts.down_proj": (e, d, i)}
    s = config.shared_expert_intermediate_size
    if s:  # Qwen2-MoE's shared expert and its gate
        shapes.update({p + "shared_expert.gate_proj.weight": (s, d),
                       p + "shared_expert.up_proj.weight": (s, d),
                       p + "shared_expert.down_proj.weight": (d, s),
                       p + "shared_expert_gate.weight": (1, d)})
    return shapes


__all__ = ["STACKED", "expert_shapes", "stack_experts", "stacked_shapes"]
