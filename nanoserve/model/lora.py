"""LoRA adapters in the forward: a fixed pool of adapter slots on the device, and the
low-rank update each row's adapter adds after a projection's base GEMM.

    y = base(x)                                   one GEMM for every row of the step
    y[n] += scale_s * (x[n] A_s^T) B_s^T          s = the row's slot; -1: the base model

The pool (`LoraWeights`) holds, for every decoder layer's fused projection that an adapter
targets (`qkv`, `o_proj`, `gate_up`, `down_proj`), a `LoraProjection`: its parts' A and B
for S slots at one rank R (the largest of the engine's adapters), fixed at build time so a
CUDA graph captured over a step keeps reading the same tensors:

    a [S, P * R, K]    part j's A (zero rows past an adapter's own rank) at rows j*R..
    b [S, W, R]        the parts' B one after another, the adapter's scale folded in
                       (scale * B: lora_alpha / r, or / sqrt(r) under rsLoRA)

P: the parts of the projection any adapter targets (q, k, v of `qkv`; gate, up of
`gate_up`); a part an adapter leaves out is zero in its slot. `load(slot, ...)` writes one
adapter into a slot (a copy from host memory); which adapter is in which slot is
`nanoserve.scheduling.lora_slots.AdapterSlots`' business.

A step's rows choose their slots through a `LoraStep` (the slot of each of its tokens,
[N] int32, -1 for none, and that grouping computed once for all layers); the model passes it
to each layer (`nanoserve/model/model.py`), whose projections call `LoraProjection.add` after
their GEMM: the Triton kernels on a GPU, the PyTorch reference elsewhere
(`nanoserve_kernels/lora.py`). An FP8 projection's output is complete (its scales applied)
before the update is added: `attach` turns off the FP8 fusions that would hand a LoRA
projection quantized input or unscaled output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from nanoserve.model.config import ModelConfig
from nanoserve_kernels import backend as kernel_backend
from nanoserve_kernels.lora import Slices, lora_groups, slices_tensor

# The projections an adapter may target (PEFT's target_modules), and the fused projection
# of the model each belongs to, with the parts of that projection in their output order.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ATTENTION = ("qkv", "o_proj")  # the others are the MLP's


def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (out, in) features: A is [r, in], B [out, r]."""
    d, inner = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (inner, d), "up_proj": (inner, d), "down_proj": (d, inner)}


@dataclass
class LoraStep:
    """One step's adapter choice: `index` [N] int (each token's slot, -1: none; N = the
    step's tokens in the order the model flattens them, [B, T] -> B * T) and, where the
    Triton kernels run, its tokens grouped by slot (`lora_groups`), made once per step."""

    index: torch.Tensor
    num_slots: int
    groups: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if kernel_backend.use_triton(self.index.device):
            self.groups = lora_groups(self.index, self.num_slots)


class LoraProjection:
    """One fused projection's adapter slots (see the module docstring for `a` and `b`).
    `parts`: the targets it holds, in output order; `slices`: per part (its columns in the
    projection's output, its rows in b, its width)."""

    def __init__(self, parts: tuple[str, ...], out_offsets: Mapping[str, int],
                 shapes: Mapping[str, tuple[int, int]], rank: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.parts, self.rank = parts, rank
        k = shapes[parts[0]][1]
        widths = [shapes[p][0] for p in parts]
        b_offsets = [sum(widths[:j]) for j in range(len(parts))]
        self.slices: Slices = tuple((out_offsets[p], b_off, w)
                                    for p, b_off, w in zip(parts, b_offsets, widths))
        self.a = torch.zeros(num_slots, len(parts) * rank, k, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, sum(widths), rank, dtype=dtype, device=device)
        self.slices_dev = slices_tensor(self.slices, device)

    def add(self, y: torch.Tensor, x: torch.Tensor, step: LoraStep) -> None:
        """y [..., N_out] (the projection's output, written in place) += each token's
        update from x [..., K]."""
        kernel_backend.lora_add(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.a,
                                self.b, self.slices, step.index, step.groups, self.slices_dev)

    def load(self, slot: int, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into `slot`: `tensors[part]` = (A [r, in], scale * B [out, r])
        for the parts it targets (the others, and ranks past r, become zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        R = self.rank
        for j, (part, (_, b_off, w)) in enumerate(zip(self.parts, self.slices)):
            if part in tensors:
                a, b = tensors[part]
                r = a.shape[0]
                self.a[slot, j * R:j * R + r].copy_(a, non_blocking=True)
                self.b[slot, b_off:b_off + w, :r].copy_(b, non_blocking=True)


class LoraWeights:
    """The engine's adapter slots: a `LoraProjection` per layer and fused projection that
    any of its adapters targets. `targets`: the union of its adapters' target modules;
    `rank`: the largest of their ranks; `num_slots`: how many adapters the device holds at
    once. Built zero (every slot: no update)."""

    def __init__(self, config: ModelConfig, targets: set[str], rank: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        unknown = set(targets) - set(TARGETS)
        if unknown or not targets or rank < 1 or num_slots < 1:
            raise ValueError(f"LoRA slots need targets among {TARGETS}, rank >= 1 and slots "
                             f">= 1, got {sorted(targets)}, {rank}, {num_slots}")
        self.num_slots, self.rank = num_slots, rank
        shapes = part_shapes(config)
        offsets = {}
        for parts in FUSED.values():
            at = 0
            for p in parts:
                offsets[p] = at
                at += shapes[p][0]
        self.layers: list[dict[str, LoraProjection]] = []
        for layer in range(config.num_hidden_layers):
            here = {}
            for fused, parts in FUSED.items():
                held = tuple(p for p in parts if p in targets)
                if held and not (fused not in ATTENTION and config.is_moe_layer(layer)):
                    here[fused] = LoraProjection(held, offsets, shapes, rank, num_slots, dtype,
                                                 torch.device(device))
            self.layers.append(here)

    def load(self, slot: int,
             tensors: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write one adapter into `slot`: `tensors[(layer, target)]` = (A, scale * B)."""
        for layer, projections in enumerate(self.layers):
            for fused, proj in projections.items():
                proj.load(slot, {p: tensors[layer, p] for p in FUSED[fused]
                                 if (layer, p) in tensors})

    def attach(self, model: torch.nn.Module) -> None:
        """Give each decoder layer's attention and MLP their slots (`lora_qkv`, `lora_o`,
        `lora_gate_up`, `lora_down`), and turn off the FP8 fusions around them: a LoRA
        projection reads its input unquantized and hands on its output with its scales
        applied (nanoserve/weights/fp8.py's `fuse_activation_quant`, `keep_scales`).
        A tensor-parallel shard (nanoserve/model/parallel.py) is refused: its slots would
        have to be split with its projections."""
        tp = getattr(model, "tensor_parallel", None)
        if tp is not None and tp.world_size > 1:
            from nanoserve.errors import ModelError

            raise ModelError("LoRA adapters do not run with tensor parallelism yet")
        for layer, projections in zip(model.model.layers, self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.lora_qkv = projections.get("qkv")
            attn.lora_o = projections.get("o_proj")
            if attn.lora_qkv is not None:
                layer.input_layernorm.fp8_out = None
            if "gate_up" in projections or "down_proj" in projections:
                mlp.lora_gate_up = projections.get("gate_up")
                mlp.lora_down = projections.get("down_proj")
                mlp.fp8_act = None
            if "gate_up" in projections:
                layer.post_attention_layernorm.fp8_out = None


__all__ = ["ATTENTION", "FUSED", "TARGETS", "LoraProjection", "LoraStep", "LoraWeights",
           "part_shapes"]
