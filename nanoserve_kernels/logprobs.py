"""Log-probabilities of chosen tokens, their ranks and the k most likely tokens, per row.

    lp = log_softmax(logits[i].float())
    out[i] = [lp[t_i], rank_i, top ids (k), top logprobs (k)]      (float32, [m, 2 + 2k])
    rank_i = 1 + #{v : logits[i, v] > logits[i, t_i]}

logits [m, V] (any float dtype, last dimension contiguous), tokens [m] int64, 0 <= k <= 20.
Token ids are stored as float32 (exact below 2**24). The top k are in descending order;
among equal values the order is unspecified (as `torch.topk`'s).

- `logprob_rows_reference`: torch's log_softmax, gather, a comparison and topk: about ten
  launches, and a float32 copy of the logits written and read several times.
- `logprob_rows`: Triton, two launches that read the logits once. Programs (row, chunk of
  CHUNK logits) write their chunk's max, sum of exp(x - max), count of logits above the
  chosen one, and their chunk's k largest (taken one at a time: max, then masked out); one
  program per row merges the chunks (the log-sum-exp, the rank, the k largest of the
  candidates) and writes the row. The engine calls it through `nanoserve_kernels.backend`.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton

CHUNK = 4096  # logits per program of the first launch
MAX_K = 20


def logprob_rows_reference(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    x = logits.float()
    lp = torch.log_softmax(x, dim=-1)  # [m, V]
    chosen = lp.gather(1, tokens.view(-1, 1))  # [m, 1]
    # the rank from the logits themselves: two logits that differ can round to one logprob
    rank = (x > x.gather(1, tokens.view(-1, 1))).sum(dim=-1, keepdim=True).float() + 1
    parts = [chosen, rank]
    if k:
        top_lp, top_id = lp.topk(k, dim=-1)  # [m, k]
        parts += [top_id.float(), top_lp]  # ids < 2**24 are exact in float32
    return torch.cat(parts, dim=1)


@triton.jit
def _logprob_chunk_kernel(logits_ptr, tokens_ptr, max_ptr, sum_ptr, cnt_ptr, topv_ptr,
                          topi_ptr, V, stride_row, num_chunks, K: tl.constexpr,
                          KP: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < V
    base = logits_ptr + row * stride_row
    x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32)
    tok = tl.load(tokens_ptr + row)
    chosen = tl.load(base + tok).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(valid, tl.exp(x - m), 0.0), 0)
    cnt = tl.sum((valid & (x > chosen)).to(tl.int32), 0)
    out = row * num_chunks + c
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)
    tl.store(cnt_ptr + out, cnt)
    if K > 0:
        slots = tl.arange(0, KP)
        vals = tl.full((KP,), float("-inf"), tl.float32)
        ids = tl.zeros((KP,), tl.int32)
        for j in tl.static_range(K):
            best = tl.max(x, 0)
            at = tl.min(tl.where(valid & (x == best), offs, V + CHUNK), 0)
            vals = tl.where(slots == j, best, vals)
            ids = tl.where(slots == j, at, ids)
            x = tl.where(offs == at, float("-inf"), x)
        tl.store(topv_ptr + out * KP + slots, vals)
        tl.store(topi_ptr + out * KP + slots, ids)


@triton.jit
def _logprob_merge_kernel(tokens_ptr, logits_ptr, stride_row, max_ptr, sum_ptr, cnt_ptr,
                          topv_ptr, topi_ptr, out_ptr, num_chunks, K: tl.constexpr,
                          KP: tl.constexpr, C_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C_PAD)
    cm = c < num_chunks
    at = row * num_chunks + c
    maxes = tl.load(max_ptr + at, mask=cm, other=float("-inf"))
    sums = tl.load(sum_ptr + at, mask=cm, other=0.0)
    m = tl.max(maxes, 0)
    lse = m + tl.log(tl.sum(tl.where(cm, sums * tl.exp(maxes - m), 0.0), 0))
    rank = tl.sum(tl.load(cnt_ptr + at, mask=cm, other=0), 0) + 1
    tok = tl.load(tokens_ptr + row)
    chosen = tl.load(logits_ptr + row * stride_row + tok).to(tl.float32)
    out = out_ptr + row * (2 + 2 * K)
    tl.store(out, chosen - lse)
    tl.store(out + 1, rank.to(tl.float32))
    if K > 0:
        flat = tl.arange(0, C_PAD * KP)  # candidate (chunk, slot) pairs
        fm = (flat // KP < num_chunks) & (flat % KP < K)
        cand = tl.load(topv_ptr + row * num_chunks * KP + flat, mask=fm, other=float("-inf"))
        cid = tl.load(topi_ptr + row * num_chunks * KP + flat, mask=fm, other=0)
        big = C_PAD * KP
        for j in tl.static_range(K):
            best = tl.max(cand, 0)
            # among equal values the smallest token id, so the k picks are distinct entries
            pick = tl.min(tl.where(fm & (cand == best), cid, 2**31 - 1), 0)
            where = tl.min(tl.where(fm & (cand == best) & (cid == pick), flat, big), 0)
            tl.store(out + 2 + j, pick.to(tl.float32))
            tl.store(out + 2 + K + j, best - lse)
            cand = tl.where(flat == where, float("-inf"), cand)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Triton form of `logprob_rows_reference` (tokens are not range-checked)."""
    if not HAS_TRITON:
        raise RuntimeError("logprob_rows needs Triton; use the reference instead")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [m, V] with V contiguous, got {tuple(logits.shape)}")
    m, V = logits.shape
    if tokens.shape != (m,) or tokens.dtype != torch.int64:
        raise ValueError("tokens must be [m] int64")
    if not 0 <= k <= min(MAX_K, V):
        raise ValueError(f"k must be in 0..{min(MAX_K, V)}, got {k}")
    out = torch.empty((m, 2 + 2 * k), dtype=torch.float32, device=logits.device)
    if m == 0:
        return out
    num_chunks = triton.cdiv(V, CHUNK)
    kp = max(2, next_power_of_2(max(k, 1)))
    dev = logits.device
    maxes = torch.empty((m, num_chunks), dtype=torch.float32, device=dev)
    sums = torch.empty((m, num_chunks), dtype=torch.float32, device=dev)
    cnts = torch.empty((m, num_chunks), dtype=torch.int32, device=dev)
    topv = torch.empty((m, num_chunks, kp), dtype=torch.float32, device=dev)
    topi = torch.empty((m, num_chunks, kp), dtype=torch.int32, device=dev)
    _logprob_chunk_kernel[(m, num_chunks)](logits, tokens, maxes, sums, cnts, topv, topi, V,
                                           logits.stride(0), num_chunks, K=k, KP=kp,
                                           CHUNK=CHUNK, num_warps=8)
    _logprob_merge_kernel[(m,)](tokens, logits, logits.stride(0), maxes, sums, cnts, topv,
                                topi, out, num_chunks, K=k, KP=kp,
                                C_PAD=max(2, next_power_of_2(num_chunks)), num_warps=4)
    return out


__all__ = ["CHUNK", "MAX_K", "logprob_rows", "logprob_rows_reference"]
