"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): a router and E SwiGLU
experts, of which each token runs its top k, weighted by its (renormalised) router
probabilities; Qwen2-MoE adds a shared expert every token runs, weighted by
sigmoid(x w_gate) (`SharedExpert`, in the compute dtype).

Parameter names are transformers 5.x's own modules' (`mlp.gate.weight` [E, d],
`mlp.experts.gate_up_proj` [E, 2I, d] with gate rows then up rows, `mlp.experts.down_proj`
[E, d, I]); nanoserve/weights/moe_weights.py stacks older per-expert checkpoints into them.
The experts run as one fused call (nanoserve_kernels/fused_moe.py: Triton on a GPU, its
PyTorch reference on the CPU), in the compute dtype or in FP8 e4m3 with per-channel or
per-block scales (`MoeExperts.fp8`).
Shapes: M tokens, d hidden, E experts, k experts per token, I each expert's inner width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.config import ModelConfig
from nanoserve_kernels import backend as kernel_backend


class MoeExperts(nn.Module):
    """The E experts' weights, stacked: gate_up_proj [E, 2I, d], down_proj [E, d, I]; FP8
    ones carry their scales (gate_up_proj_scale [E, 2I] or [E, 2I/bn, d/bk], down_proj_scale
    [E, d] or [E, d/bn, I/bk]; `block` = (bn, bk) for the latter)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.gate_up_proj_scale: torch.Tensor | None = None
        self.down_proj_scale: torch.Tensor | None = None
        self.block: tuple[int, int] | None = None

    @classmethod
    def fp8(cls, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
            down_scale: torch.Tensor, block: tuple[int, int] | None) -> MoeExperts:
        """FP8 experts from e4m3 weights and float32 scales (see the class docstring)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.register_buffer("gate_up_proj", gate_up.contiguous())
        self.register_buffer("down_proj", down.contiguous())
        self.register_buffer("gate_up_proj_scale", gate_up_scale.float().contiguous())
        self.register_buffer("down_proj_scale", down_scale.float().contiguous())
        self.block = block
        return self

    def scales(self) -> dict:
        """The fused call's scale arguments (none for experts in the compute dtype)."""
        if self.gate_up_proj_scale is None:
            return {}
        return {"w13_scale": self.gate_up_proj_scale, "w2_scale": self.down_proj_scale,
                "block": self.block}


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP of width S (gate_proj, up_proj [S, d],
    down_proj [d, S])."""

    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, width, bias=False)
        self.up_proj = nn.Linear(d, width, bias=False)
        self.down_proj = nn.Linear(width, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)),
                            dim=-1)  # [M, 2S]
        return F.linear(kernel_backend.silu_and_mul(gate_up), self.down_proj.weight)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        # the router [E, d]; built on the meta device, its weight from the checkpoint
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = MoeExperts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(config.hidden_size,
                                              config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> [..., d]."""
        rows = x.reshape(-1, x.shape[-1])  # [M, d]
        logits = F.linear(rows, self.gate.weight)  # [M, E]
        out = kernel_backend.fused_moe(rows, logits, self.experts.gate_up_proj,
                                       self.experts.down_proj, self.top_k, self.renormalize,
                                       **self.experts.scales())
        if self.shared_expert is not None:  # out + sigmoid(x w_gate) * shared(x), as transformers
            gate = torch.sigmoid(F.linear(rows, self.shared_expert_gate.weight))  # [M, 1]
            out = out + gate * self.shared_expert(rows)
        return out.view(x.shape)


__all__ = ["MoeExperts", "SharedExpert", "SparseMoeBlock"]
