"""Random weights drawn on the device (vLLM's `load_format="dummy"`): a model of any shape
from its `config.json` alone, for benchmarks whose checkpoint would not fit the disk (a
70B-shaped model: 140 GB in bf16, 70 GB in FP8).

With `quantization="fp8"` each projection (fused q/k/v, o, fused gate/up, down; each
expert's matrix of a mixture of experts) is drawn in bf16 and quantized per row at once, so the device never holds more than one bf16 matrix
beside the FP8 model. Weights are N(0, 0.02^2), norms 1, biases 0: values do not change
the speed of anything a benchmark measures.
"""

from __future__ import annotations

import torch

from nanoserve.model.config import STACKED, ModelConfig
from nanoserve.model.model import LlamaForCausalLM, build_model
from nanoserve.model.moe import MoeExperts
from nanoserve.weights.fp8 import (
    Fp8Linear,
    fuse_activation_quant,
    layer_projections,
    quantize_per_channel,
)
from nanoserve.weights.weights import expected_shapes

STD = 0.02


def random_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 quantization: str | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A model of `config`'s shape with random weights built on `device`; FP8 projections
    with `quantization="fp8"` (the caller has checked the device computes FP8)."""
    g = torch.Generator(device).manual_seed(seed)
    shapes = expected_shapes(config)
    projections = {}
    if quantization == "fp8":
        for layer in range(config.num_hidden_layers):
            if config.is_moe_layer(layer):
                prefix = f"model.layers.{layer}.mlp.experts"
                projections[prefix] = _fp8_experts(
                    [shapes.pop(f"{prefix}.{name}") for name in STACKED], g, device)
            for proj, parts in layer_projections(config, layer).items():
                names = [f"model.layers.{layer}.{p}" for p in parts]
                parts_shapes = [shapes.pop(n + ".weight") for n in names]  # [out, in] each
                rows, cols = sum(s[0] for s in parts_shapes), parts_shapes[0][1]
                w = torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16)
                q, scale = quantize_per_channel(w.mul_(STD))
                del w
                bias = None
                if names[0] + ".bias" in shapes:
                    bias = torch.zeros(sum(shapes.pop(n + ".bias")[0] for n in names),
                                       dtype=dtype, device=device)
                projections[f"model.layers.{layer}.{proj}"] = Fp8Linear(q, scale.reshape(-1),
                                                                        bias=bias)
    state_dict = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state_dict[name] = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            state_dict[name] = torch.zeros(shape, dtype=dtype, device=device)
        else:
            t = torch.randn(shape, generator=g, device=device, dtype=dtype)
            state_dict[name] = t.mul_(STD)
    model = build_model(config, state_dict, dtype, device, projections=projections)
    return fuse_activation_quant(model) if projections else model


def _fp8_experts(shapes: list[tuple[int, ...]], g: torch.Generator,
                 device: str | torch.device) -> MoeExperts:
    """Random FP8 experts of the stacked shapes [E, 2I, d], [E, d, I]: each expert's matrix
    drawn in bf16 and quantized per row before the next is drawn."""
    parts = []
    for e_count, rows, cols in shapes:
        q = torch.empty((e_count, rows, cols), dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty((e_count, rows), dtype=torch.float32, device=device)
        for e in range(e_count):
            w = torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16)
            q[e], s = quantize_per_channel(w.mul_(STD))
            scale[e] = s.reshape(-1)
        parts += [q, scale]
    return MoeExperts.fp8(*parts, block=None)
