"""A mixture-of-experts layer's routing, and its token-expert pairs sorted by expert.

Routing (transformers' Qwen3-MoE and Mixtral routers, after the router GEMM):

    logits [M, E]  ->  softmax (float32)  ->  top-k  ->  renormalised to sum 1 (optional)
                   ->  weights [M, k] float32, ids [M, k] int32

- `route_reference`: PyTorch, the oracle; `route`: Triton, one launch, one program per
  block of tokens (the top k found by k rounds of argmax over the row's E values).
- `align_pairs_reference`: PyTorch device ops; `align_pairs`: one Triton program (up to
  8,192 pairs), the same tensors.

Alignment (vLLM's `moe_align_block_size`): pair p = token * k + slot goes to expert
ids.flat[p]. `align_pairs` lists the pairs expert by expert, each expert's run padded with
the sentinel P = M * k to a multiple of the GEMM's row tile `block_m`:

    sorted_ids   [max_pairs] int32: pair ids by expert; P in the padding
    tile_experts [max_pairs / block_m] int32: each row tile's expert; -1 past the last

Every size is a function of M, k, E and block_m alone (`max_pairs` pads for the worst
case: each of min(E, P) experts one tile short of full), and the steps are device ops with
no host sync, so a step that routes can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, next_power_of_2, tl, triton

_ROUTE_TOKENS = 16  # tokens of a routing program


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, E] -> (weights [M, k] float32, ids [M, k] int32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, M, E, stride_l, TOP_K: tl.constexpr,
                  RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows[:, None] < M) & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    row_max = tl.where(row_max == -float("inf"), 0.0, row_max)  # a row past M: no NaN
    e = tl.where(mask, tl.exp(x - row_max[:, None]), 0.0)
    probs = e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None]
    probs = tl.where(mask, probs, -1.0)
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=1)  # [BLOCK_T]: the first of equal maxima
        value = tl.max(probs, axis=1)
        total += value
        tl.store(ids_ptr + rows * TOP_K + slot, best.to(tl.int32), mask=rows < M)
        tl.store(w_ptr + rows * TOP_K + slot, value, mask=rows < M)
        probs = tl.where(cols[None, :] == best[:, None], -1.0, probs)
    if RENORM:  # the same row's k values read back: each program owns its rows
        for slot in tl.static_range(TOP_K):
            w = tl.load(w_ptr + rows * TOP_K + slot, mask=rows < M, other=0.0)
            tl.store(w_ptr + rows * TOP_K + slot, w / total, mask=rows < M)


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of `route_reference` (ties may pick another of equal experts)."""
    if not HAS_TRITON:
        raise RuntimeError("route needs Triton; use the reference instead")
    m, e = logits.shape
    weights = torch.empty((m, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=logits.device)
    if m:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(triton.cdiv(m, _ROUTE_TOKENS),)](
            logits, weights, ids, m, e, logits.stride(0), TOP_K=top_k, RENORM=renormalize,
            BLOCK_T=_ROUTE_TOKENS, BLOCK_E=next_power_of_2(e), num_warps=4)
    return weights, ids


def max_sorted_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The sorted-pair buffer's length: every pair, plus each expert that can hold a pair
    (at most min(E, P)) padded by up to block_m - 1, rounded up to whole tiles."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


def align_pairs_reference(ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [M, k] -> (sorted_ids [max_pairs] int32, tile_experts [max_pairs / block_m]
    int32): see the module docstring. Fixed sizes, no host sync (a dozen device ops)."""
    flat = ids.reshape(-1).long()  # [P]
    num_pairs, device = flat.numel(), ids.device
    size = max_sorted_pairs(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E]: where each expert's padded run ends
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts  # [E]: each expert's first rank among the pairs
    order = torch.sort(flat, stable=True).indices  # [P]: pair ids by expert, then by id
    expert = flat[order]
    dest = starts[expert] + torch.arange(num_pairs, device=device) - first[expert]
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, size, block_m, device=device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True)  # E past the last tile
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return sorted_ids, tile_experts.to(torch.int32)


ALIGN_ONE_PROGRAM_MAX = 8192  # pairs `align_pairs` sorts in its one-program kernel
_ALIGN_BLOCK = 64  # pairs of one step of that kernel


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, tile_exp_ptr, P, size, num_tiles, E,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program: count each expert's pairs, pad the counts to BLOCK_M, fill the buffer
    with the sentinel P, write each tile's expert, then each pair at its expert's start +
    the pairs of its expert before it (pair-id order: the reference's stable sort)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, P, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    for start in range(0, size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + offs, tl.zeros([BLOCK], dtype=tl.int32) + P, mask=offs < size)
    for start in range(0, num_tiles, BLOCK):
        tiles = start + tl.arange(0, BLOCK)
        past = (ends[None, :] <= (tiles * BLOCK_M)[:, None]) & (experts[None, :] < E)
        owner = tl.sum(past.to(tl.int32), axis=1)
        tl.store(tile_exp_ptr + tiles, tl.where(owner < E, owner, -1), mask=tiles < num_tiles)
    tl.debug_barrier()  # the sentinel fill above lands before the pairs below
    running = starts
    for start in range(0, P, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=-1)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, E_PAD]
        before = tl.cumsum(hot, axis=0) - hot  # earlier pairs of the same expert in the block
        pos = tl.sum(hot * (running[None, :] + before), axis=1)
        tl.store(sorted_ptr + pos, offs, mask=offs < P)
        running += tl.sum(hot, axis=0)


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of `align_pairs_reference`, the same tensors: one launch of one program
    up to `ALIGN_ONE_PROGRAM_MAX` pairs (every decode step), the reference's device ops
    beyond (large prefills, where they cost little beside the GEMMs)."""
    num_pairs = ids.numel()
    if not HAS_TRITON or num_pairs > ALIGN_ONE_PROGRAM_MAX or num_pairs == 0:
        return align_pairs_reference(ids, num_experts, block_m)
    size = max_sorted_pairs(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=ids.device)
    tile_experts = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1).to(torch.int32)
    _align_kernel[(1,)](flat, sorted_ids, tile_experts, num_pairs, size, size // block_m,
                        num_experts, BLOCK_M=block_m, E_PAD=next_power_of_2(num_experts),
                        BLOCK=_ALIGN_BLOCK, num_warps=4)
    return sorted_ids, tile_experts


__all__ = ["ALIGN_ONE_PROGRAM_MAX", "align_pairs", "align_pairs_reference", "max_sorted_pairs",
           "route", "route_reference"]
