"""LoRA's low-rank update for rows of many adapters in one step, after the base GEMM:

    y[n, cols of part j] += (x[n] @ A_j[s]^T) @ B_j[s]^T      s = index[n]; index[n] = -1: none

One projection's adapters sit in a fixed pool of S slots (nanoserve/model/lora.py), its
parts (q, k, v of a fused q/k/v projection; gate, up; or a single one) side by side:

    a      [S, P * R, K]   part j's A (rank R, zero-padded past an adapter's own rank) in
                           rows j*R .. j*R + R - 1
    b      [S, W, R]       every part's B, the adapter's scale folded in, one part after
                           another (W = the parts' widths summed)
    slices ((y_off, b_off, width), ...) per part: its columns of y and its rows of b
    x      [N, K], y [N, N_out] (y's rows may be strided, its columns contiguous)

The Triton form (`lora_add`) runs in two launches over the step's tokens grouped by slot
(`lora_groups`: the tokens sorted by slot, each slot's start; fixed shapes, so a CUDA graph
holds them): shrink, t = x A^T per (slot, tile of its tokens, part) into a float32 buffer
[N, P * R], then expand, y += t B^T per (slot, tile of tokens, part and tile of its columns).
A program whose tile starts past its slot's tokens returns at once, so the grid depends on N
and S alone. Tokens of slot -1 are in no group: their y is never touched.

Numerics, the same in both forms: the shrink sums in float32; t is rounded to b's dtype
before the expand (vLLM's order), whose products sum in float32; y is read, the update added
in float32, and rounded once to y's dtype. `lora_add_reference` is the PyTorch oracle: per
slot, the rows of that slot gathered by a mask (no grouping), the same roundings.
"""

from __future__ import annotations

import torch

from nanoserve_kernels._triton import HAS_TRITON, interpret_requested, tl, triton

INTERPRETED = interpret_requested()  # the kernels below were defined under the interpreter
BLOCK_M = 16  # tokens per program
BLOCK_K = 64  # the shrink's step along the input
BLOCK_N = 64  # the expand's output columns per program

Slices = tuple[tuple[int, int, int], ...]  # (y column offset, b row offset, width) per part


def lora_groups(index: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """index [N] int (slot per token, -1: none) -> (order [N] int64: the tokens sorted by
    slot, stably; starts [S + 1] int64: slot s's tokens are order[starts[s]:starts[s + 1]],
    starts[S] = N). Slot -1's tokens come first, before starts[0]. No host sync."""
    ordered, order = torch.sort(index.to(torch.int64), stable=True)
    wanted = torch.arange(num_slots + 1, device=index.device, dtype=torch.int64)
    return order, torch.searchsorted(ordered, wanted)


def check_lora_args(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    slices: Slices, index: torch.Tensor) -> None:
    """The shapes both forms take (see the module docstring); ValueError otherwise."""
    n, k = x.shape
    s, pr, ka = a.shape
    parts = len(slices)
    if (ka != k or not parts or pr % parts or y.shape[0] != n or index.shape != (n,)
            or a.stride(-1) != 1):
        raise ValueError(f"lora: x {list(x.shape)}, y {list(y.shape)}, a {list(a.shape)}, "
                         f"index {list(index.shape)} do not agree")
    r = pr // parts
    if b.shape[0] != s or b.shape[2] != r or y.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"lora: b {list(b.shape)} for a {list(a.shape)} (and y's, a's and "
                         f"b's last sides contiguous)")
    for y_off, b_off, w in slices:
        if y_off + w > y.shape[1] or b_off + w > b.shape[1]:
            raise ValueError(f"lora: slice {(y_off, b_off, w)} outside y {list(y.shape)} or "
                             f"b {list(b.shape)}")


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slices: Slices, index: torch.Tensor) -> None:
    """y += each token's adapter update, in place (see the module docstring)."""
    check_lora_args(y, x, a, b, slices, index)
    r = a.shape[1] // len(slices)
    for s in torch.unique(index).tolist():
        if s < 0:
            continue
        rows = (index == s).nonzero()[:, 0]
        t = (x[rows].float() @ a[s].float().t()).to(b.dtype)  # [m, P * R]
        for j, (y_off, b_off, w) in enumerate(slices):
            u = t[:, j * r:(j + 1) * r].float() @ b[s, b_off:b_off + w].float().t()  # [m, w]
            cols = slice(y_off, y_off + w)
            y[rows, cols] = (y[rows, cols].float() + u).to(y.dtype)


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:  # float32 operands (and the interpreter): exact products, no TF32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _group_tile(order_ptr, starts_ptr, slot, tile, BLOCK_M: tl.constexpr):
    """The tokens of tile `tile` of slot `slot`'s group: (their rows, their mask, whether
    the tile holds any)."""
    start = tl.load(starts_ptr + slot)
    end = tl.load(starts_ptr + slot + 1)
    first = start + tile * BLOCK_M
    offs = first + tl.arange(0, BLOCK_M)
    mask = offs < end
    rows = tl.load(order_ptr + offs, mask=mask, other=0).to(tl.int64)
    return rows, mask, first < end


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, t_ptr, order_ptr, starts_ptr, K, R,
                   stride_x, stride_as, stride_ar, stride_t,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """Program (slot, tile, part): t[rows, part's R columns] = x[rows] @ A_part[slot]^T."""
    slot = tl.program_id(0)
    part = tl.program_id(2)
    rows, mask_m, any_rows = _group_tile(order_ptr, starts_ptr, slot, tl.program_id(1),
                                         BLOCK_M)
    if any_rows:
        rk = tl.arange(0, BLOCK_R)
        mask_r = rk < R
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + (part * R + rk) * stride_ar  # [BR]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            mask_k = kk < K
            xt = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            at = tl.load(a_rows[None, :] + kk[:, None],
                         mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BK, BR]
            acc += _dot(xt, at, DOT_F32)
        tl.store(t_ptr + rows[:, None] * stride_t + part * R + rk[None, :], acc,
                 mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(t_ptr, b_ptr, y_ptr, order_ptr, starts_ptr, slices_ptr, R, tiles_n,
                   stride_t, stride_bs, stride_bw, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """Program (slot, tile, part * tiles_n + column tile): y[rows, part's columns] +=
    t[rows, part's R columns] @ B_part[slot]^T."""
    slot = tl.program_id(0)
    part = tl.program_id(2) // tiles_n
    col_tile = tl.program_id(2) % tiles_n
    rows, mask_m, any_rows = _group_tile(order_ptr, starts_ptr, slot, tl.program_id(1),
                                         BLOCK_M)
    y_off = tl.load(slices_ptr + part * 3)
    b_off = tl.load(slices_ptr + part * 3 + 1)
    width = tl.load(slices_ptr + part * 3 + 2)
    if any_rows and col_tile * BLOCK_N < width:
        rk = tl.arange(0, BLOCK_R)
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_r = rk < R
        mask_n = cols < width
        b_dtype = b_ptr.dtype.element_ty
        tt = tl.load(t_ptr + rows[:, None] * stride_t + part * R + rk[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(b_dtype)  # [BM, BR]
        bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + (b_off + cols)[None, :] * stride_bw
                     + rk[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BR, BN]
        u = _dot(tt, bt, DOT_F32)  # [BM, BN] float32
        where = y_ptr + rows[:, None] * stride_y + (y_off + cols)[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(where, mask=mask, other=0.0).to(tl.float32)
        tl.store(where, (y + u).to(y_ptr.dtype.element_ty), mask=mask)


def slices_tensor(slices: Slices, device: torch.device | str) -> torch.Tensor:
    """`slices` as the expand kernel reads them: [P, 3] int32 (made once per projection)."""
    return torch.tensor(slices, dtype=torch.int32, device=device).reshape(-1, 3)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slices: Slices, index: torch.Tensor,
             groups: tuple[torch.Tensor, torch.Tensor] | None = None,
             slices_dev: torch.Tensor | None = None) -> None:
    """Triton form of `lora_add_reference`: y += the update, in place, in two launches.
    groups: `lora_groups(index, S)` (computed here when None; a step computes it once for
    all its layers); slices_dev: `slices_tensor(slices)` (likewise)."""
    if not HAS_TRITON:
        raise RuntimeError("lora_add needs Triton; use the reference instead")
    check_lora_args(y, x, a, b, slices, index)
    n, k = x.shape
    s, pr, _ = a.shape
    parts = len(slices)
    r = pr // parts
    if n == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    order, starts = groups if groups is not None else lora_groups(index, s)
    if slices_dev is None:
        slices_dev = slices_tensor(slices, x.device)
    block_r = max(16, triton.next_power_of_2(r))
    tiles_m = triton.cdiv(n, BLOCK_M)
    t = torch.empty((n, pr), dtype=torch.float32, device=x.device)
    _shrink_kernel[(s, tiles_m, parts)](
        x, a, t, order, starts, k, r, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
        DOT_F32=INTERPRETED or a.dtype == torch.float32)
    tiles_n = triton.cdiv(max(w for _, _, w in slices), BLOCK_N)
    _expand_kernel[(s, tiles_m, parts * tiles_n)](
        t, b, y, order, starts, slices_dev, r, tiles_n, t.stride(0), b.stride(0), b.stride(1),
        y.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N,
        DOT_F32=INTERPRETED or b.dtype == torch.float32)


__all__ = ["INTERPRETED", "lora_add", "lora_add_reference", "lora_groups", "slices_tensor"]
