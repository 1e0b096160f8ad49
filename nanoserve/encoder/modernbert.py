"""ModernBERT's encoder.

    x = LayerNorm(tok[id])                                          # no position embedding
    per block i (pre-norm; block 0 has no attention norm):
        x = x + Wo(attention(rotary(q), rotary(k), v of attn_norm(x)))
        x = x + Wo_mlp(act(a) * g),  a, g = Wi(mlp_norm(x)).chunk(2)   # GeGLU
    x = final_norm(x)

Global layers (`layer_types` 'full_attention', every `global_attn_every_n_layers`-th from
layer 0) attend over the whole row with rotary base `global_rope_theta`; local ones
('sliding_attention') see the keys within +- local_attention // 2 row positions, with rotary
base `local_rope_theta`. Biases only where config.json asks (`norm_bias`, `attention_bias`,
`mlp_bias`; none by default). Rotary is the half-split form (rotate_half), positions are the
token's place in its row, computed in float32.

Shapes: ids [N] (rows packed by `PackedRows`), hidden [N, d], q/k/v [N, H, D].
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.encoder.config import EncoderConfig
from nanoserve.encoder.layers import PackedRows, activation, packed_attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D], cos/sin [N, D] float32 -> x rotated, in x's dtype."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


class ModernBertBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig, layer: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.norm_bias) if layer else None
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.attention_bias)
        self.attn_out = nn.Linear(d, d, bias=cfg.attention_bias)
        self.mlp_norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.wi = nn.Linear(d, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.wo = nn.Linear(cfg.intermediate_size, d, bias=cfg.mlp_bias)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, rows: PackedRows, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.qkv(h).view(-1, 3, self.heads, self.head_dim).unbind(1)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        x = x + self.attn_out(packed_attention(q, k, v, rows, self.window).reshape(x.shape))
        a, g = self.wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.wo(self.act(a) * g)


class ModernBertEncoder(nn.Module):
    """Embeddings, blocks and the final norm: packed ids [N] -> last hidden states [N, d]."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, d)
        self.emb_norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.layers = nn.ModuleList(ModernBertBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.norm_bias)

    def _cos_sin(self, theta: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.cfg.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32,
                                                 device=positions.device) / D))
        freqs = positions.float()[:, None] * inv_freq[None]  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos(), emb.sin()

    def forward(self, ids: torch.Tensor, rows: PackedRows,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        del token_type_ids  # ModernBERT has none
        x = self.emb_norm(self.word(ids))
        rope = {None: self._cos_sin(self.cfg.global_rope_theta, rows.col)}
        for layer in self.layers:
            if layer.window is not None and layer.window not in rope:
                rope[layer.window] = self._cos_sin(self.cfg.local_rope_theta, rows.col)
            x = layer(x, rows, *rope[layer.window])
        return self.final_norm(x)


__all__ = ["ModernBertBlock", "ModernBertEncoder", "rotary"]
