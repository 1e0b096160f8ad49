"""What BERT and ModernBERT blocks share: packed rows, bidirectional attention over them,
the activations config.json names.

Rows arrive packed back to back: hidden [N, d] with row b owning tokens
cu_seqlens[b]:cu_seqlens[b + 1] (no padding in the projections, MLPs and norms). Attention
alone puts each row's q/k/v back in a [B, T, H, D] rectangle (T the longest row) and runs
torch's SDPA once with a mask [B, 1, T, T] that lets a query see the real keys of its own
row (bidirectional: no causal mask), within +- `window` positions where a layer has one;
padded query slots are computed and dropped. No KV cache: an encoder runs once per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nanoserve.errors import ModelError


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # transformers' NewGELUActivation: the tanh form, written out
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


_ACTIVATIONS = {"gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_new,
                "relu": F.relu, "silu": F.silu, "swish": F.silu, "tanh": torch.tanh}


def activation(name: str):
    """transformers' ACT2FN entry of `name` (exact GELU for 'gelu')."""
    if name not in _ACTIVATIONS:
        raise ModelError(f"activation {name!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


@dataclass
class PackedRows:
    """Where each packed token sits: cu_seqlens [B + 1] int, row [N] and col [N] long (its
    row and its position in that row), lens [B], and T the longest row. Masks are built once
    per window and reused by every layer of that window."""

    cu_seqlens: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    lens: torch.Tensor
    max_len: int
    _masks: dict = field(default_factory=dict)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor) -> PackedRows:
        cu = cu_seqlens.long()
        lens = cu[1:] - cu[:-1]
        row = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), lens)
        col = torch.arange(int(cu[-1]), device=cu.device) - cu[:-1][row]
        return cls(cu, row, col, lens, int(lens.max()) if len(lens) else 0)

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, T, T] bool: key j of the row is real and, with a window, |i - j| <= window."""
        if window not in self._masks:
            t = torch.arange(self.max_len, device=self.lens.device)
            allowed = (t[None, None, :] < self.lens[:, None, None]).expand(-1, self.max_len, -1)
            if window is not None:
                allowed = allowed & ((t[:, None] - t[None, :]).abs() <= window)[None]
            self._masks[window] = allowed[:, None]
        return self._masks[window]


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: PackedRows,
                     window: int | None = None) -> torch.Tensor:
    """q, k, v [N, H, D] of packed rows -> [N, H, D]: softmax(q k^T / sqrt(D)) v over the
    keys of each query's own row (see the module docstring)."""
    B, T = len(rows.lens), rows.max_len
    N, H, D = q.shape

    def rect(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [B, H, T, D]
        out = x.new_zeros(B, T, H, D)
        out[rows.row, rows.col] = x
        return out.transpose(1, 2)

    out = F.scaled_dot_product_attention(rect(q), rect(k), rect(v), attn_mask=rows.mask(window))
    return out.transpose(1, 2)[rows.row, rows.col]  # [N, H, D]


__all__ = ["PackedRows", "activation", "packed_attention"]
