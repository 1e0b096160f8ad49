"""A mixture-of-experts layer's experts, fused: routed, sorted, two grouped GEMMs, summed.

    x [M, d], router logits [M, E], w13 [E, 2I, d] (gate rows, then up rows), w2 [E, d, I]
    -> out [M, d] = sum over the token's k experts e of  weight_e * w2_e (silu(g_e) * u_e),
       [g_e | u_e] = w13_e x

Steps (each a fixed-size device op: a step that runs them can be captured in a CUDA graph):
1. `route`: softmax, top-k, renormalise, one launch (nanoserve_kernels/moe_routing.py);
2. `align_pairs`: the M * k token-expert pairs sorted by expert, each expert's run padded
   to the row tile BLOCK_M, in a buffer sized for the worst case;
3. gate-up GEMM: program (row tile, column block) multiplies its tile's rows of x (token =
   pair // k) by its expert's gate and up blocks and writes silu(gate) * up to the pair's
   row of `inter` [P, I] (P = M * k);
4. down GEMM: the same over `inter` (row = pair) and w2, each row times its routing
   weight, to the pair's row of `out_pairs` [P, d];
5. out = out_pairs viewed [M, k, d] summed over k: a fixed order, so a token's row never
   depends on the rows beside it (no atomics).
Tile sizes come per shape from `fused_moe_configs.json` (`nanoserve_kernels/fused_moe_configs.py`).

FP8 experts (w13, w2 in e4m3): scales per channel (w13_scale [E, 2I], w2_scale [E, d],
float32; the activations quantized per token, both scales applied after the K loop) or per
block (`block` = (bn, bk), w13_scale [E, ceil(2I/bn), ceil(d/bk)]; the activations
quantized per token and group of bk columns, both scales applied to each K block's product;
BLOCK_K = bk). Each activation rounded to e4m3 once, as the reference does.

Rounding, in the kernel as in the reference: each GEMM's float32 sum is rounded to x's
dtype; silu(gate) is rounded to it before the product with up, the product again; a pair's
row is (down rounded) * weight (float32), rounded; the k rows are summed by `torch.sum`.

- `fused_moe_reference` / `fused_experts_reference`: PyTorch, the oracle. On the CPU it
  visits the experts that hold pairs; on a GPU every expert over every token (fixed work,
  no host sync: capturable, E times the FLOPs).
- `fused_moe` / `fused_experts`: Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve_kernels._triton import HAS_TRITON, interpret_requested, tl, triton
from nanoserve_kernels.fp8_quant import (
    FP8,
    exact_div,
    quantize_rows_reference,
    quantize_to_fp8,
    row_scale,
)
from nanoserve_kernels.fp8_quant import quantize_rows as _quantize_rows_triton
from nanoserve_kernels.fused_moe_configs import get_config
from nanoserve_kernels.moe_routing import align_pairs, route, route_reference

# the kernels below were defined for the interpreter, whose casts to bfloat16 and e4m3 do not
# round to nearest: there the activations are quantized by the references
INTERPRETED = interpret_requested()
FP8_MAX = 448.0
Block = tuple[int, int] | None  # block-wise scales' (rows, columns) per block


# --- activation quantization (FP8 experts) -------------------------------------------------


def quantize_groups_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K / group]): one scale per token and
    group of `group` columns (K a multiple of it)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"K ({k}) is not a multiple of the group ({group})")
    xg = x.float().view(m, k // group, group)
    scale = exact_div(xg.abs().amax(dim=-1).clamp(min=1e-12), FP8_MAX)  # [M, K / group]
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, k), scale


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, GROUP: tl.constexpr):
    """Program (row, group): the group's scale and e4m3 values (as the reference, bit for bit)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(x), axis=0), 0.0, False)
    tl.store(s_ptr + row * (K // GROUP) + group, scale)
    tl.store(q_ptr + row * K + cols, quantize_to_fp8(x, scale).to(q_ptr.dtype.element_ty))


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton form of `quantize_groups_reference`: one launch, a program per (row, group)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"K ({k}) is not a multiple of the group ({group})")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, k // group)](x, q, scale, k, x.stride(0), GROUP=group)
    return q, scale


def _quantize(x: torch.Tensor, block: Block, use_triton: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 GEMM's activations: per group of block[1] columns, or per token [M, 1]."""
    if block is not None:
        return quantize_groups(x, block[1]) if use_triton else quantize_groups_reference(x, block[1])
    return _quantize_rows_triton(x) if use_triton else quantize_rows_reference(x)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: Block) -> torch.Tensor:
    """e4m3 q [N, K] with per-row scale [N] / [N, 1], or block scales -> float32 [N, K]."""
    n, k = q.shape
    if block is None:
        return q.float() * scale.float().reshape(n, 1)
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * s


# --- the reference --------------------------------------------------------------------------


def _expert_reference(a: torch.Tensor, e: int, w13, w2, w13_scale, w2_scale, block: Block
                      ) -> torch.Tensor:
    """Expert e on rows a [n, d] -> [n, d] in a's dtype (before the routing weight)."""
    dtype = a.dtype
    if w13.dtype == FP8:
        aq, a_s = _quantize(a, block, False)
        g_u = (_dequantize(aq, a_s, (1, block[1]) if block else None)
               @ _dequantize(w13[e], w13_scale[e], block).T).to(dtype)
        gate, up = g_u.chunk(2, dim=-1)
        act = F.silu(gate) * up
        hq, h_s = _quantize(act, block, False)
        return (_dequantize(hq, h_s, (1, block[1]) if block else None)
                @ _dequantize(w2[e], w2_scale[e], block).T).to(dtype)
    gate, up = F.linear(a, w13[e]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2[e])


def fused_experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                            w13: torch.Tensor, w2: torch.Tensor, *,
                            w13_scale: torch.Tensor | None = None,
                            w2_scale: torch.Tensor | None = None,
                            block: Block = None) -> torch.Tensor:
    """x [M, d], weights [M, k] float32, ids [M, k] -> [M, d] (the module docstring)."""
    m, k = ids.shape
    flat = ids.reshape(-1).long()  # [P]: pair p = token * k + slot
    tokens = torch.arange(m * k, device=x.device) // k
    out_pairs = x.new_zeros(m * k, x.shape[1])
    w = weights.reshape(-1, 1).float()
    args = (w13, w2, w13_scale, w2_scale, block)
    if x.device.type == "cpu":
        for e in flat.unique().tolist():
            pairs = (flat == e).nonzero()[:, 0]
            y = _expert_reference(x[tokens[pairs]], e, *args)
            out_pairs[pairs] = (y.float() * w[pairs]).to(x.dtype)
    else:  # fixed work: capturable
        for e in range(w13.shape[0]):
            y = _expert_reference(x, e, *args)[tokens]  # [P, d]
            out_pairs = torch.where((flat == e)[:, None], (y.float() * w).to(x.dtype), out_pairs)
    return out_pairs.view(m, k, -1).sum(dim=1)


def fused_moe_reference(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, top_k: int, renormalize: bool, **scales
                        ) -> torch.Tensor:
    """x [M, d], router logits [M, E] -> [M, d]; `scales`: w13_scale, w2_scale, block."""
    weights, ids = route_reference(logits, top_k, renormalize)
    return fused_experts_reference(x, weights, ids, w13, w2, **scales)


# --- the Triton kernel ----------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:  # float32 operands (and the interpreter): exact products, no TF32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, out_ptr, a_s_ptr, b_s_ptr, route_w_ptr, sorted_ptr,
                     tile_exp_ptr, N, K, num_pairs, stride_am, stride_be, stride_bn, stride_om,
                     stride_asm, stride_bse, stride_bsn,
                     A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, ROUTE_W: tl.constexpr,
                     SCALES: tl.constexpr, GROUP_N: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row tile, column block): out[pair, n] for its tile's pairs and its columns
    n of the expert's N (GATED: gate rows n and up rows N + n of b, silu(gate) * up).
    a's row of a pair: pair // A_ROW_DIV. SCALES: 0 none, 1 per row of a and of b (after
    the K loop), 2 per block (a per row and K block, b per GROUP_N rows and K block)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    tile = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(tile_exp_ptr + tile)
    if expert < 0:  # past the last expert's tiles
        return
    expert = expert.to(tl.int64)
    pairs = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    up_ptrs = b_ptrs + N * stride_bn  # GATED only
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if SCALES == 2:
            kb = k0 // BLOCK_K
            a_s = tl.load(a_s_ptr + rows * stride_asm + kb, mask=valid, other=0.0)
            b_s = tl.load(b_s_ptr + expert * stride_bse + (offs_n // GROUP_N) * stride_bsn + kb,
                          mask=n_mask, other=0.0)
            acc += _dot(a, b, DOT_F32) * a_s[:, None] * b_s[None, :]
        else:
            acc += _dot(a, b, DOT_F32)
        if GATED:
            bu = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if SCALES == 2:
                bu_s = tl.load(b_s_ptr + expert * stride_bse + ((N + offs_n) // GROUP_N)
                               * stride_bsn + kb, mask=n_mask, other=0.0)
                acc_up += _dot(a, bu, DOT_F32) * a_s[:, None] * bu_s[None, :]
            else:
                acc_up += _dot(a, bu, DOT_F32)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SCALES == 1:
        a_s = tl.load(a_s_ptr + rows * stride_asm, mask=valid, other=0.0)
        b_s = tl.load(b_s_ptr + expert * stride_bse + offs_n, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
        if GATED:
            bu_s = tl.load(b_s_ptr + expert * stride_bse + N + offs_n, mask=n_mask, other=0.0)
            acc_up = acc_up * a_s[:, None] * bu_s[None, :]
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype).to(tl.float32)
    if GATED:
        act = (y / (1.0 + tl.exp(-y))).to(dtype).to(tl.float32)
        y = (act * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    if ROUTE_W:
        y = y * tl.load(route_w_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(dtype), mask=valid[:, None] & n_mask[None, :])


def _gemm(a, a_s, b, b_s, out, route_w, sorted_ids, tile_experts, num_pairs, *, a_row_div,
          gated, block: Block, config) -> None:
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    scales = 0 if b.dtype != FP8 else (2 if block is not None else 1)
    block_n = config["BLOCK_N"] if block is None else min(config["BLOCK_N"], block[0])
    if block is not None and (block[0] % block_n or config["BLOCK_K"] != block[1]):
        raise ValueError(f"tile {block_n}x{config['BLOCK_K']} does not fit scale blocks {block}")
    dummy = out  # stands for the pointers a launch does not read
    a_s = dummy if a_s is None else a_s
    b_s = dummy if b_s is None else b_s
    grid = (tile_experts.numel() * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, b, out, a_s, b_s, dummy if route_w is None else route_w, sorted_ids, tile_experts,
        n, k, num_pairs, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        a_s.stride(0), b_s.stride(0), b_s.stride(1) if b_s.dim() > 1 else 0,
        A_ROW_DIV=a_row_div, GATED=gated, ROUTE_W=route_w is not None, SCALES=scales,
        GROUP_N=block[0] if block is not None else 1,
        DOT_F32=INTERPRETED or a.dtype == torch.float32,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"], num_stages=config["num_stages"])


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, *,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: Block = None, config: dict[str, int] | None = None) -> torch.Tensor:
    """Triton form of `fused_experts_reference`; `config`: tile sizes (else looked up)."""
    if not HAS_TRITON:
        raise RuntimeError("fused_experts needs Triton; use the reference instead")
    m, d = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = ids.shape[1]
    fp8 = w13.dtype == FP8
    if config is None:
        config = get_config(m, num_experts, two_i // 2, d, "fp8" if fp8 else str(x.dtype)[6:],
                            block[1] if block is not None else None)
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, tile_experts = align_pairs(ids, num_experts, config["BLOCK_M"])
    num_pairs = m * top_k
    a, a_s = (x, None)
    if fp8:
        a, a_s = _quantize(x, block, not INTERPRETED)
    inter = torch.empty((num_pairs, two_i // 2), dtype=x.dtype, device=x.device)
    common = dict(block=block, config=config)
    _gemm(a, a_s, w13, w13_scale, inter, None, sorted_ids, tile_experts, num_pairs,
          a_row_div=top_k, gated=True, **common)
    h, h_s = (inter, None)
    if fp8:
        h, h_s = _quantize(inter, block, not INTERPRETED)
    out_pairs = torch.empty((num_pairs, d), dtype=x.dtype, device=x.device)
    route_w = weights.reshape(-1).float().contiguous()
    _gemm(h, h_s, w2, w2_scale, out_pairs, route_w, sorted_ids, tile_experts, num_pairs,
          a_row_div=1, gated=False, **common)
    return out_pairs.view(m, top_k, d).sum(dim=1)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool, **kwargs) -> torch.Tensor:
    """Triton form of `fused_moe_reference`."""
    weights, ids = route(logits, top_k, renormalize)
    return fused_experts(x, weights, ids, w13, w2, **kwargs)


__all__ = ["fused_experts", "fused_experts_reference", "fused_moe", "fused_moe_reference",
           "quantize_groups", "quantize_groups_reference"]
