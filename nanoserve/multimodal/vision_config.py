"""The Qwen2.5-VL vision tower's configuration and tensor shapes (torch-free: the driver and
the checkpoint checks read them without the engine). The tower itself:
nanoserve/multimodal/vision_model.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int  # E
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the LM's hidden size
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # pixels a window spans, each side
    fullatt_block_indexes: tuple[int, ...] = field(default_factory=tuple)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        rope = d.get("rope_parameters") or {}
        return cls(
            depth=int(d["depth"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]), num_heads=int(d["num_heads"]),
            out_hidden_size=int(d["out_hidden_size"]),
            patch_size=int(d.get("patch_size", 14)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            window_size=int(d.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in d.get("fullatt_block_indexes", ())),
            in_channels=int(d.get("in_channels", 3)),
            hidden_act=d.get("hidden_act", "silu"),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def vision_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every vision tensor by its name under `visual.`, with its shape."""
    E, inner, m = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size**2
    P, T = cfg.patch_size, cfg.temporal_patch_size
    shapes = {"patch_embed.proj.weight": (E, cfg.in_channels, T, P, P)}
    for i in range(cfg.depth):
        p = f"blocks.{i}."
        shapes.update({
            p + "norm1.weight": (E,), p + "norm2.weight": (E,),
            p + "attn.qkv.weight": (3 * E, E), p + "attn.qkv.bias": (3 * E,),
            p + "attn.proj.weight": (E, E), p + "attn.proj.bias": (E,),
            p + "mlp.gate_proj.weight": (inner, E), p + "mlp.gate_proj.bias": (inner,),
            p + "mlp.up_proj.weight": (inner, E), p + "mlp.up_proj.bias": (inner,),
            p + "mlp.down_proj.weight": (E, inner), p + "mlp.down_proj.bias": (E,),
        })
    shapes.update({
        "merger.ln_q.weight": (E,),
        "merger.mlp.0.weight": (E * m, E * m), "merger.mlp.0.bias": (E * m,),
        "merger.mlp.2.weight": (cfg.out_hidden_size, E * m),
        "merger.mlp.2.bias": (cfg.out_hidden_size,),
    })
    return shapes


__all__ = ["VisionConfig", "vision_shapes"]
