"""The greedy token of each row of a decode step, written where the next step reads it.

    tokens[i] = argmax(logits[i])      (the first index of the largest value)
    last_tok[slots[i]] = tokens[i]

logits [b, V] (any float dtype, last dimension contiguous), slots [b] int64, last_tok [R]
int64 (written in place); returns tokens [b] int64. One launch replaces torch's argmax and
index_copy_, and it reads the logits with enough programs to fill the GPU at any b.
A NaN counts as larger than every number (torch.argmax's rule), and the first NaN wins.

- `argmax_scatter_reference`: torch.argmax and index_copy_.
- `argmax_scatter`: Triton, in two launches: programs (row, chunk of CHUNK logits) write
  their chunk's largest value and its first index; one program per row picks the largest
  of those (the first chunk among equals) and writes the token twice.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, next_power_of_2, tl, triton

CHUNK = 4096  # logits per program of the first launch


def argmax_scatter_reference(logits: torch.Tensor, slots: torch.Tensor,
                             last_tok: torch.Tensor) -> torch.Tensor:
    tokens = torch.argmax(logits, dim=-1)
    last_tok.index_copy_(0, slots, tokens)
    return tokens


@triton.jit
def _chunk_max_kernel(logits_ptr, val_ptr, idx_ptr, V, stride_row, num_chunks,
                      CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(logits_ptr + row * stride_row + offs, mask=valid,
                other=float("-inf")).to(tl.float32)
    is_nan = x != x
    x = tl.where(is_nan, float("-inf"), x)
    m = tl.max(x, 0)
    first_max = tl.min(tl.where(valid & (x == m), offs, V), 0)
    first_nan = tl.min(tl.where(is_nan, offs, V), 0)
    has_nan = first_nan < V
    best = tl.where(has_nan, first_nan, first_max)
    m = tl.where(has_nan, float("nan"), m)
    tl.store(val_ptr + row * num_chunks + c, m)
    tl.store(idx_ptr + row * num_chunks + c, best)


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, slots_ptr, tokens_ptr, last_tok_ptr, num_chunks,
                 C_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    mask = c < num_chunks
    vals = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=0)
    is_nan = (vals != vals) & mask
    has_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    big = 2**31 - 1
    m = tl.max(tl.where(is_nan, float("-inf"), vals), 0)
    first_max = tl.min(tl.where(mask & (vals == m), c, big), 0)
    first_nan = tl.min(tl.where(is_nan, c, big), 0)
    pick = tl.where(has_nan, first_nan, first_max)
    token = tl.sum(tl.where(c == pick, idxs, 0), 0).to(tl.int64)
    tl.store(tokens_ptr + row, token)
    slot = tl.load(slots_ptr + row)
    tl.store(last_tok_ptr + slot, token)


def argmax_scatter(logits: torch.Tensor, slots: torch.Tensor,
                   last_tok: torch.Tensor) -> torch.Tensor:
    """Triton form of `argmax_scatter_reference` (slots are not range-checked)."""
    if not HAS_TRITON:
        raise RuntimeError("argmax_scatter needs Triton; use the reference instead")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [b, V] with V contiguous, got {tuple(logits.shape)}")
    b, V = logits.shape
    if slots.shape != (b,) or slots.dtype != torch.int64 or last_tok.dtype != torch.int64:
        raise ValueError("slots [b] and last_tok must be int64")
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return tokens
    if V == 0:
        raise ValueError("argmax of an empty vocabulary")
    num_chunks = triton.cdiv(V, CHUNK)
    vals = torch.empty((b, num_chunks), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((b, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(b, num_chunks)](logits, vals, idxs, V, logits.stride(0), num_chunks,
                                       CHUNK=CHUNK, num_warps=8)
    _pick_kernel[(b,)](vals, idxs, slots, tokens, last_tok, num_chunks,
                       C_PAD=max(2, next_power_of_2(num_chunks)), num_warps=1)
    return tokens


__all__ = ["CHUNK", "argmax_scatter", "argmax_scatter_reference"]
