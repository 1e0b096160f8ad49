"""Tensor parallelism (Megatron-style): rank r of N holds a slice of every layer's weights
and runs its slice of the forward; collectives join the slices where the math needs it.

The sharding, per decoder layer (Hq/Hkv heads, I the MLP's inner width, E experts):
- attention: the fused q/k/v projection is split by output columns, whole heads per rank:
  rank r holds query heads [r Hq/N, (r+1) Hq/N) and the KV heads they read; with Hkv >= N
  the KV heads split evenly (Hkv/N per rank), with Hkv < N (N a multiple of Hkv) each rank
  holds the one KV head its query heads share, replicated over N/Hkv ranks. q/k/v biases
  split with their rows; Qwen3's q_norm/k_norm (per head, over head_dim) are replicated.
  Each rank's attention is whole for its heads (no collective); o_proj is split by input
  rows (the heads it reads), so each rank's o_proj output is a partial sum over its heads:
  **one all-reduce (sum) of o_proj's output** gives the full [B, T, d].
- dense MLP: gate and up split by output columns (I/N each, the same column range of
  both), down_proj by input rows: silu(gate) * up is elementwise, so each rank's down_proj
  output is a partial sum over its I/N: **one all-reduce of down_proj's output**.
- mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE): the router is replicated (every rank
  picks the same experts); every expert's gate/up columns and down rows are split as the
  dense MLP's (moe_intermediate_size/N each), and a shared expert the same way (its
  sigmoid gate replicated). The routed output sum_k w_k down_k(...) is linear in each
  expert's partial down output, so **one all-reduce after the weighted sum** (the block's
  output) gives the full one.
- the token embedding and every RMSNorm are replicated (the embedding is not split: a
  lookup, no collective); the LM head is split over the vocabulary (ceil(V/N) rows per
  rank, the last rank zero-padded) with **one all-gather of the logits** [.., V/N] -> [.., V],
  so every rank ends the step with the same full logits.
So a layer has two all-reduces of [B, T, d], and a step one all-gather of its logits.
The rank's model is an ordinary `LlamaForCausalLM` built from the sharded config
(`sharded_config`: heads, KV heads and inner widths divided), so its paged KV cache
(`CacheShape.of(model.config)`) holds only the rank's own KV heads.

The step's inputs: a forward pre-hook on the decoder broadcasts the step's token ids and
positions from the group's rank 0, so every rank runs rank 0's step (rank 0 owns the
schedule and its samples; the other ranks' block tables come from the same inputs by the
same deterministic code, nanoserve/static/tensor_parallel.py).

Not with tensor parallelism (refused, `ModelError`): FP8 checkpoints (the FP8 GEMMs'
scaled outputs would need their scales applied before the all-reduce, and their per-row
scales split with the rows), LoRA adapters (`LoraWeights.attach`: their slots would have
to be split with the projections), classifier, headless and vision checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.errors import ModelError
from nanoserve.model.config import ModelConfig
from nanoserve.model.model import LlamaForCausalLM, LlamaMLP, build_model
from nanoserve.model.moe import SparseMoeBlock


@dataclass(frozen=True)
class TensorParallel:
    """Where this process stands: `rank` of `world_size` in `group` (a torch.distributed
    process group; None: the default group, ranks numbered as in it)."""

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def src(self) -> int:
        """The global rank of the group's rank 0 (the one that broadcasts each step)."""
        if self.group is None:
            return 0
        import torch.distributed as dist

        return dist.get_global_rank(self.group, 0)


def kv_heads_of(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, KV heads) rank tp.rank holds: Hkv/N of them, or the one its query
    heads share (replicated) when there are fewer KV heads than ranks."""
    n, hkv = tp.world_size, config.num_key_value_heads
    if hkv >= n:
        return tp.rank * (hkv // n), hkv // n
    return tp.rank // (n // hkv), 1


def sharded_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The config of rank tp.rank's slice: heads, KV heads and inner widths divided (see the
    module docstring); refuses what does not divide, FP8, and headless models."""
    n = tp.world_size
    if config.quantization is not None:
        raise ModelError("tensor parallelism does not take FP8 checkpoints yet: the FP8 "
                         "projections' scales would have to be applied before the all-reduce")
    if config.headless or config.is_classifier or config.vision is not None:
        raise ModelError(f"tensor parallelism runs text generation models only, not "
                         f"{config.architecture} without an LM head or with a vision tower")
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    if hq % n:
        raise ModelError(f"num_attention_heads ({hq}) is not a multiple of the tensor "
                         f"parallel size ({n})")
    if (hkv >= n and hkv % n) or (hkv < n and n % hkv):
        raise ModelError(f"num_key_value_heads ({hkv}) and the tensor parallel size ({n}): "
                         f"one must be a multiple of the other")
    widths = {"intermediate_size": config.intermediate_size,
              "moe_intermediate_size": config.moe_intermediate_size,
              "shared_expert_intermediate_size": config.shared_expert_intermediate_size}
    for name, w in widths.items():
        if w % n:
            raise ModelError(f"{name} ({w}) is not a multiple of the tensor parallel size ({n})")
    return replace(config, num_attention_heads=hq // n,
                   num_key_value_heads=kv_heads_of(config, tp)[1],
                   **{name: w // n for name, w in widths.items()})


def _cols(t: torch.Tensor, start: int, size: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, size)


def shard_state_dict(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                     tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Rank tp.rank's slice of a checkpoint's tensors (`load_checkpoint`'s names), as views
    where a slice is contiguous in the stored tensor. lm_head (or the tied embedding) stays
    whole here: `shard_model` splits it after the build."""
    n, r = tp.world_size, tp.rank
    D = config.head_dim
    hq = config.num_attention_heads // n
    kv0, hkv = kv_heads_of(config, tp)
    inner = config.intermediate_size // n
    moe = config.moe_intermediate_size // n
    shared = config.shared_expert_intermediate_size // n
    out = {}
    for name, t in state_dict.items():
        leaf = name.split(".self_attn.")[-1] if ".self_attn." in name else None
        if leaf in ("q_proj.weight", "q_proj.bias"):
            t = _cols(t, r * hq * D, hq * D)
        elif leaf in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            t = _cols(t, kv0 * D, hkv * D)
        elif leaf == "o_proj.weight":
            t = _cols(t, r * hq * D, hq * D, dim=1)
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            t = _cols(t, r * inner, inner)
        elif name.endswith("mlp.down_proj.weight"):
            t = _cols(t, r * inner, inner, dim=1)
        elif name.endswith(("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")):
            t = _cols(t, r * shared, shared)
        elif name.endswith("shared_expert.down_proj.weight"):
            t = _cols(t, r * shared, shared, dim=1)
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, d]: gate rows, then up rows
            full = config.moe_intermediate_size
            t = torch.cat((_cols(t, r * moe, moe, dim=1), _cols(t, full + r * moe, moe, dim=1)),
                          dim=1)
        elif name.endswith("mlp.experts.down_proj"):  # [E, d, I]
            t = _cols(t, r * moe, moe, dim=2)
        out[name] = t
    return out


class VocabParallelHead(nn.Module):
    """The LM head's rows [r c, (r+1) c) of V (c = ceil(V/N); the last rank's zero-padded
    to c): logits of its slice, all-gathered to the full [..., V] on every rank."""

    def __init__(self, weight: torch.Tensor, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size, self.tp = weight.shape[0], tp
        per = -(-self.vocab_size // tp.world_size)
        lo = min(tp.rank * per, self.vocab_size)
        part = weight[lo:lo + per]
        if part.shape[0] < per:
            part = torch.cat((part, part.new_zeros(per - part.shape[0], part.shape[1])))
        self.weight = nn.Parameter(part, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        part = F.linear(hidden, self.weight).contiguous()  # [..., c]
        if self.tp.world_size == 1:
            return part[..., :self.vocab_size]
        import torch.distributed as dist

        parts = [torch.empty_like(part) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, part, group=self.tp.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def shard_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], tp: TensorParallel,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> LlamaForCausalLM:
    """Rank tp.rank's model: built from `sharded_config` and `shard_state_dict`, with the
    collectives of the module docstring hooked in (o_proj, down_proj and MoE outputs
    all-reduced; the vocabulary-split head all-gathered; the step's token ids and positions
    broadcast from rank 0). `model.config` is the sharded config."""
    model = build_model(sharded_config(config, tp), shard_state_dict(config, state_dict, tp),
                        dtype, device)
    model.lm_head = VocabParallelHead(model.lm_head.weight, tp)
    model.tensor_parallel = tp  # read by LoraWeights.attach, which refuses a shard
    if tp.world_size == 1:
        return model

    def reduce(_module, _args, out):
        return tp.all_reduce(out)

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(reduce)
        if isinstance(layer.mlp, LlamaMLP):
            layer.mlp.down_proj.register_forward_hook(reduce)
        else:
            assert isinstance(layer.mlp, SparseMoeBlock)
            layer.mlp.register_forward_hook(reduce)
    model.model.register_forward_pre_hook(_broadcast_inputs(tp))
    return model


def _broadcast_inputs(tp: TensorParallel):
    """A pre-hook on `LlamaModel`: its token ids and positions replaced by rank 0's."""
    import torch.distributed as dist

    src = tp.src()

    def hook(_module, args):
        args = list(args)
        for i in (0, 1):  # input_ids, positions
            t = args[i].contiguous()
            dist.broadcast(t, src=src, group=tp.group)
            args[i] = t
        return tuple(args)

    return hook


__all__ = ["TensorParallel", "VocabParallelHead", "kv_heads_of", "shard_model",
           "shard_state_dict", "sharded_config"]
