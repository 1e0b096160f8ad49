"""The Qwen2.5-VL vision tower: image patches in, one LM-width vector per merged 2 x 2
block of patches out. Parameter names are transformers' (`visual.*` without the prefix).

    patches [N, C*T*P*P] --patch_embed (the Conv3d with stride = kernel: one linear)-->
    [N, E] --window reorder--> blocks (RMSNorm, attention with 2D rotary, RMSNorm, SwiGLU)
    --merger (RMSNorm, 4 patches -> 1 row, Linear-GELU-Linear)--> [N / 4, d_lm]
    --undo the window order--> rows in the image's raster order of merged blocks

Window attention: the merged blocks are regrouped into windows of `window_size` pixels
(`window_size / P / merge` blocks a side); a block attends within its window, except in
`fullatt_block_indexes` layers, where it attends within its whole image (frame). Each
segment (a window or an image) is attended alone, non-causally (`cu_seqlens`).
2D rotary: a patch's (row, column) in the image rotate the first and second half of each
head's frequency pairs (head_dim / 4 frequencies each).
Shapes: N patches, E = hidden_size, H heads, D = E / H.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.multimodal.vision_config import VisionConfig


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        P, T = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.in_channels, T, P, P))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a Conv3d whose stride is its kernel, over one kernel-sized input per patch: a linear
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.reshape(w.shape[0], -1))  # [N, E]


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[int]) -> torch.Tensor:
        N, E = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.num_heads, -1).unbind(1)  # each [N, H, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = _segment_attention(q, k, v, segments)  # [N, H, D]
        return self.proj(out.reshape(N, E))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in float32 (as transformers' vision rotary), x [N, H, D], cos/sin [N, D]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _segment_attention(q, k, v, segments: list[int]) -> torch.Tensor:
    """Non-causal attention within each run of `segments` consecutive rows; q/k/v
    [N, H, D] -> [N, H, D]. Segments of one length go through one batched call."""
    out = torch.empty_like(q)
    starts = [0]
    for n in segments:
        starts.append(starts[-1] + n)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(segments):
        if n:
            by_len.setdefault(n, []).append(starts[i])
    for n, firsts in by_len.items():
        idx = (torch.tensor(firsts, device=q.device)[:, None]
               + torch.arange(n, device=q.device)).reshape(-1)  # [S * n]
        S = len(firsts)
        qs, ks, vs = (t.index_select(0, idx).view(S, n, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))  # [S, H, n, D]
        o = F.scaled_dot_product_attention(qs, ks, vs)  # [S, H, n, D]
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(S * n, *q.shape[1:]))
    return out


class _MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        E, inner = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(E, inner)
        self.up_proj = nn.Linear(E, inner)
        self.down_proj = nn.Linear(inner, E)
        acts = {"silu": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}
        self.act = acts[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size)
        self.norm2 = _RMSNorm(cfg.hidden_size)
        self.attn = _Attention(cfg)
        self.mlp = _MLP(cfg)

    def forward(self, x, cos, sin, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = _RMSNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4:
            from nanoserve.errors import ModelError

            raise ModelError(f"vision hidden_size {cfg.hidden_size} over {cfg.num_heads} heads "
                             f"is not a head size divisible by 4")
        self.cfg = cfg
        self.patch_embed = _PatchEmbed(cfg)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg)

    def rotary_inv_freq(self, device) -> torch.Tensor:
        D = self.cfg.hidden_size // self.cfg.num_heads
        half = D // 2
        steps = torch.arange(0, half, 2, dtype=torch.float, device=device)
        return 1.0 / (self.cfg.rope_theta ** (steps / half))  # [D / 4]

    def forward(self, pixel_values: torch.Tensor,
                grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [N, C*T*P*P] (images one after another, as `preprocess` lays them
        out) and each image's (t, gh, gw) -> [N / merge**2, out_hidden_size]."""
        m = self.cfg.spatial_merge_size
        unit = m * m
        pos, order, windows, frames = _layout(grids, m, self.cfg.window_size // m
                                              // self.cfg.patch_size)
        dev = pixel_values.device
        order_t = torch.tensor(order, device=dev)
        x = self.patch_embed(pixel_values)  # [N, E]
        N = x.shape[0]
        # window order: whole merge blocks move, so a window's patches are consecutive
        x = x.view(N // unit, unit, x.shape[-1])[order_t].reshape(N, x.shape[-1])
        freqs = torch.tensor(pos, device=dev, dtype=torch.float)[..., None] \
            * self.rotary_inv_freq(dev)  # [N, 2, D/4]
        freqs = freqs.flatten(1)  # [N, D/2]: rows' frequencies, then columns'
        freqs = freqs.view(N // unit, unit, freqs.shape[-1])[order_t].reshape(N, -1)
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        cos, sin = emb.cos(), emb.sin()
        full = set(self.cfg.fullatt_block_indexes)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames if i in full else windows)
        merged = self.merger(x)  # [N / unit, d_lm], window order
        return merged[torch.argsort(order_t)]


def _layout(grids: list[tuple[int, int, int]], m: int, window: int
            ) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """(each patch's (row, column), in input order; the merge blocks' window order; the
    windows' lengths in patches; the frames' lengths in patches) for images laid out as
    `preprocess` does (merge blocks in raster order, a block's m x m patches together)."""
    pos: list[list[int]] = []
    order: list[int] = []
    windows: list[int] = []
    frames: list[int] = []
    base = 0
    for t, gh, gw in grids:
        bh, bw = gh // m, gw // m  # merge blocks per column and row
        for _ in range(t):
            for by in range(bh):
                for bx in range(bw):
                    pos += [[by * m + dy, bx * m + dx] for dy in range(m) for dx in range(m)]
            frames.append(gh * gw)
        for f in range(t):
            for wy in range(0, bh, window):
                for wx in range(0, bw, window):
                    blocks = [base + f * bh * bw + y * bw + x
                              for y in range(wy, min(wy + window, bh))
                              for x in range(wx, min(wx + window, bw))]
                    order += blocks
                    windows.append(len(blocks) * m * m)
        base += t * bh * bw
    return pos, order, windows, frames
