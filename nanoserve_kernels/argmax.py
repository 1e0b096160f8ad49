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

A structured output's step takes the argmax among each row's allowed tokens only:

    tokens[i] = argmax over {j : bit j of bitmask[i] is set} of logits[i, j], or -1 if none

bitmask [b, ceil(V/32)] int32 (bit j of word w allows token 32 w + j; bits past V are
ignored). The -1 says the row's grammar allows no token at all: the caller ends the row
(`nanoserve.sampling.sequence.Sequence.append`) and must not feed -1 to the model.
- `masked_argmax_reference`: torch (the bits expanded to a [b, V] bool mask).
- `masked_argmax`: Triton, the same two launches reading the row's bitmask words beside its
  logits: one launch pair where the torch form is seven kernels over [b, V] tensors.
"""

from __future__ import annotations

import sys

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton

CHUNK = 4096  # logits per program of the first launch


def argmax_scatter_reference(logits: torch.Tensor, slots: torch.Tensor,
                             last_tok: torch.Tensor) -> torch.Tensor:
    tokens = torch.argmax(logits, dim=-1)
    last_tok.index_copy_(0, slots, tokens)
    return tokens


_BIT_INDEX: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def allowed_mask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bool mask [n, vocab] of a bitmask [n, >= ceil(vocab/32)] int32, on its device.
    On the CPU numpy unpacks the bits (little-endian words: byte order is bit order); elsewhere
    torch expands them (any device, CUDA graphs too)."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        import numpy as np

        bits = np.unpackbits(np.ascontiguousarray(bitmask.numpy()).view(np.uint8), axis=1,
                             count=vocab, bitorder="little")
        return torch.from_numpy(bits).bool()
    key = (vocab, str(bitmask.device))
    if key not in _BIT_INDEX:
        vid = torch.arange(vocab, device=bitmask.device)
        _BIT_INDEX[key] = (vid // 32, (vid % 32).to(torch.int32))
    word, shift = _BIT_INDEX[key]
    return ((bitmask.index_select(1, word) >> shift) & 1).bool()


def masked_argmax_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """(Also the CPU's masked argmax: two passes over [b, V] where it can.)"""
    allowed = allowed_mask(bitmask, logits.shape[-1])
    x = torch.where(allowed, logits, float("-inf"))
    tokens = x.argmax(dim=-1)
    # argmax said 0 for a row whose allowed logits are all -inf or that allows nothing:
    # those rows (rare; finding them waits for the device) take their first allowed token
    dead = (x.gather(1, tokens[:, None])[:, 0] == float("-inf")).nonzero()[:, 0]
    if len(dead):
        some = allowed[dead]
        first = some.to(torch.uint8).argmax(dim=-1)
        tokens[dead] = torch.where(some.any(dim=-1), first, -1)
    return tokens


@triton.jit
def _chunk_max_kernel(logits_ptr, val_ptr, idx_ptr, mask_ptr, V, stride_row, stride_mask,
                      num_chunks, CHUNK: tl.constexpr, MASKED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    if MASKED:  # a token outside the row's bitmask is not a candidate; none left: index V
        words = tl.load(mask_ptr + row * stride_mask + offs // 32, mask=valid, other=0)
        valid = valid & (((words >> (offs % 32)) & 1) != 0)
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
def _pick_kernel(val_ptr, idx_ptr, slots_ptr, tokens_ptr, last_tok_ptr, V, num_chunks,
                 C_PAD: tl.constexpr, SCATTER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    mask = c < num_chunks
    idxs = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=V)
    mask = mask & (idxs < V)  # a chunk without a candidate (masked rows only) is skipped
    vals = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    is_nan = (vals != vals) & mask
    has_nan = tl.max(is_nan.to(tl.int32), 0) > 0
    big = 2**31 - 1
    m = tl.max(tl.where(is_nan, float("-inf"), vals), 0)
    first_max = tl.min(tl.where(mask & (vals == m), c, big), 0)
    first_nan = tl.min(tl.where(is_nan, c, big), 0)
    pick = tl.where(has_nan, first_nan, first_max)
    token = tl.sum(tl.where(c == pick, idxs, 0), 0).to(tl.int64)
    token = tl.where(tl.max(mask.to(tl.int32), 0) > 0, token, -1)
    tl.store(tokens_ptr + row, token)
    if SCATTER:
        slot = tl.load(slots_ptr + row)
        tl.store(last_tok_ptr + slot, token)


def _launch(logits, bitmask, slots, last_tok):
    b, V = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return tokens
    if V == 0:
        raise ValueError("argmax of an empty vocabulary")
    num_chunks = triton.cdiv(V, CHUNK)
    vals = torch.empty((b, num_chunks), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((b, num_chunks), dtype=torch.int32, device=logits.device)
    masked = bitmask is not None
    _chunk_max_kernel[(b, num_chunks)](logits, vals, idxs, bitmask if masked else logits, V,
                                       logits.stride(0), bitmask.stride(0) if masked else 0,
                                       num_chunks, CHUNK=CHUNK, MASKED=masked, num_warps=8)
    scatter = slots is not None
    _pick_kernel[(b,)](vals, idxs, slots if scatter else tokens, tokens,
                       last_tok if scatter else tokens, V, num_chunks,
                       C_PAD=max(2, next_power_of_2(num_chunks)), SCATTER=scatter, num_warps=1)
    return tokens


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [b, V] with V contiguous, got {tuple(logits.shape)}")


def argmax_scatter(logits: torch.Tensor, slots: torch.Tensor,
                   last_tok: torch.Tensor) -> torch.Tensor:
    """Triton form of `argmax_scatter_reference` (slots are not range-checked)."""
    if not HAS_TRITON:
        raise RuntimeError("argmax_scatter needs Triton; use the reference instead")
    _check_logits(logits)
    if slots.shape != logits.shape[:1] or slots.dtype != torch.int64 \
            or last_tok.dtype != torch.int64:
        raise ValueError("slots [b] and last_tok must be int64")
    return _launch(logits, None, slots, last_tok)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Triton form of `masked_argmax_reference`: [b] int64, -1 where no token is allowed."""
    if not HAS_TRITON:
        raise RuntimeError("masked_argmax needs Triton; use the reference instead")
    _check_logits(logits)
    b, V = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != b \
            or bitmask.shape[1] < -(-V // 32) or bitmask.stride(-1) != 1:
        raise ValueError(f"bitmask must be int32 [{b}, >= {-(-V // 32)}] with its words "
                         f"contiguous, got {bitmask.dtype} {tuple(bitmask.shape)}")
    return _launch(logits, bitmask, None, None)


__all__ = ["CHUNK", "allowed_mask", "argmax_scatter", "argmax_scatter_reference", "masked_argmax",
           "masked_argmax_reference"]
