"""The one place that chooses between the Triton kernels and their PyTorch references.

The engine calls only `decode_attention`, `prefill_attention`, `paged_prefill_attention`,
`store_kv`, `rms_norm`, `add_rms_norm`, `rotary`, `rotary_store`, `silu_and_mul` (and the
last three's `_fp8` forms, their output quantized per row for an FP8 projection),
`argmax_scatter`, `masked_argmax`, `logprob_rows`, `scale_rows`, `fused_moe` and `lora_add`
from here. The residual
adds and silu-and-mul's `_fp8` form also take `x_scales`: x is then an FP8 projection's
output before its scales (`nanoserve_kernels.scaled_rows`), applied as x is read.
`use_triton(device)` is the rule (`NANOSERVE_KERNELS=reference` forces the references
everywhere, for side-by-side checks of the two paths):
- CUDA: the Triton kernels whenever Triton is installed;
- CPU: the references, unless the environment asks for Triton's interpreter
  (`NANOSERVE_TRITON_INTERPRET=1` or `TRITON_INTERPRET=1`) *and* the kernels were defined
  under it, which needs `TRITON_INTERPRET=1` before `nanoserve_kernels` is first imported (importing
  `nanoserve_kernels` sets it when `NANOSERVE_TRITON_INTERPRET=1` is set);
- anything else: the references.
The attention dispatchers on the CPU (no interpreter, references not forced) run
`nanoserve_kernels.cpu_attention`: the references' results in one fused attention call per layer.

Every function that reads or writes the paged pool takes the layer's `k_scale` and
`v_scale` (keyword, default 1.0): an FP8 pool (float8 e4m3) stores x / scale and is read as
entry * scale, in the kernels and in the references alike (`nanoserve_kernels.kv_quant`).
"""

from __future__ import annotations

import os

import torch

from nanoserve_kernels import paged_attention
from nanoserve_kernels._triton import HAS_TRITON, interpret_requested
from nanoserve_kernels.activation import silu_and_mul as _silu_and_mul_triton
from nanoserve_kernels.activation import silu_and_mul_fp8 as _silu_and_mul_fp8_triton
from nanoserve_kernels.activation import silu_and_mul_fp8_reference, silu_and_mul_reference
from nanoserve_kernels.argmax import argmax_scatter as _argmax_scatter_triton
from nanoserve_kernels.argmax import argmax_scatter_reference, masked_argmax_reference
from nanoserve_kernels.argmax import masked_argmax as _masked_argmax_triton
from nanoserve_kernels.cpu_attention import (
    decode_attention_cpu,
    paged_prefill_attention_cpu,
    prefill_attention_cpu,
)
from nanoserve_kernels.fused_moe import fused_moe as _fused_moe_triton
from nanoserve_kernels.fused_moe import fused_moe_reference
from nanoserve_kernels.kv_store import store_kv as _store_kv_triton
from nanoserve_kernels.kv_store import store_kv_reference
from nanoserve_kernels.logprobs import logprob_rows as _logprob_rows_triton
from nanoserve_kernels.logprobs import logprob_rows_reference
from nanoserve_kernels.lora import lora_add as _lora_add_triton
from nanoserve_kernels.lora import lora_add_reference
from nanoserve_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from nanoserve_kernels.paged_prefill import paged_prefill_attention as _paged_prefill_triton
from nanoserve_kernels.paged_prefill import paged_prefill_attention_reference
from nanoserve_kernels.prefill_attention import prefill_attention as _prefill_attention_triton
from nanoserve_kernels.prefill_attention import prefill_attention_reference
from nanoserve_kernels.rmsnorm import add_rms_norm as _add_rms_norm_triton
from nanoserve_kernels.rmsnorm import add_rms_norm_fp8 as _add_rms_norm_fp8_triton
from nanoserve_kernels.rmsnorm import (
    add_rms_norm_fp8_reference,
    add_rms_norm_reference,
    rms_norm_fp8_reference,
    rms_norm_reference,
)
from nanoserve_kernels.rmsnorm import rms_norm as _rms_norm_triton
from nanoserve_kernels.rmsnorm import rms_norm_fp8 as _rms_norm_fp8_triton
from nanoserve_kernels.rotary import rotary as _rotary_triton
from nanoserve_kernels.rotary import rotary_reference
from nanoserve_kernels.rotary_store import rotary_store as _rotary_store_triton
from nanoserve_kernels.rotary_store import rotary_store_reference
from nanoserve_kernels.scaled_rows import scale_rows as _scale_rows_triton
from nanoserve_kernels.scaled_rows import scale_rows_reference

_TRUE = ("1", "true", "yes", "on")


def interpreter_requested() -> bool:
    """True when the environment asks for Triton's CPU interpreter."""
    nanoserve_flag = os.environ.get("NANOSERVE_TRITON_INTERPRET", "0").strip().lower() in _TRUE
    return nanoserve_flag or interpret_requested()


def references_forced() -> bool:
    """`NANOSERVE_KERNELS=reference`: the PyTorch references serve every call."""
    return os.environ.get("NANOSERVE_KERNELS", "").strip().lower() == "reference"


def use_triton(device: torch.device | str) -> bool:
    """Whether the Triton kernels (rather than the references) serve tensors on `device`."""
    device = torch.device(device)
    if not HAS_TRITON or references_forced():
        return False
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return interpreter_requested() and paged_attention.INTERPRETED
    return False


def fp8_decode_form() -> str:
    """How the decode kernel reads an FP8 cache: `NANOSERVE_FP8_DECODE_FORM` ("f16" or
    "e4m3", for side-by-side runs of the two), else `paged_attention.DEFAULT_FP8_FORM`."""
    form = os.environ.get("NANOSERVE_FP8_DECODE_FORM", "").strip().lower()
    if not form:
        return paged_attention.DEFAULT_FP8_FORM
    if form not in paged_attention.FP8_FORMS:
        raise ValueError(f"NANOSERVE_FP8_DECODE_FORM must be one of {paged_attention.FP8_FORMS}, "
                         f"got {form!r}")
    return form


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padding entries 0
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    max_context_len: int | None = None,
    *,
    window: int | None = None,  # sliding window: the last `window` tokens; None: all
    even_splits: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [B, Hq, D]
    """Paged decode attention: one query token per row over that row's cached context.
    max_context_len: a host-side bound on context_lens, used by the kernel only to choose
    its split count (None: the block tables' capacity); even_splits: each row's context cut
    into equal partitions (see `paged_decode_attention`). On the CPU without Triton's
    interpreter: `decode_attention_cpu` (the reference when references are forced)."""
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    if use_triton(q.device):
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      max_context_len=max_context_len, window=window,
                                      even_splits=even_splits, fp8_form=fp8_decode_form(),
                                      **scales)
    if q.device.type == "cpu" and not references_forced():
        return decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, scale,
                                    window=window, **scales)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale,
                                            window=window, **scales)


def prefill_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    cu_seqlens: torch.Tensor,  # [B + 1] int32
    max_seqlen: int,
    scale: float,
    *,
    window: int | None = None,  # sliding window: keys i-window+1..i; None: all
    work: torch.Tensor | None = None,  # [2, P] int32 (nanoserve_kernels.prefill_attention.prefill_work)
) -> torch.Tensor:  # [N, Hq, D]
    """Causal attention within each packed prompt. `work`: the Triton kernel's work table
    (a grid that does not depend on the prompts' lengths); the other forms need none."""
    if use_triton(q.device):
        return _prefill_attention_triton(q, k, v, cu_seqlens, max_seqlen, scale, window=window,
                                         work=work)
    if q.device.type == "cpu" and not references_forced():
        return prefill_attention_cpu(q, k, v, cu_seqlens, max_seqlen, scale, window=window)
    return prefill_attention_reference(q, k, v, cu_seqlens, max_seqlen, scale, window=window)


def paged_prefill_attention(
    q: torch.Tensor,  # [N, Hq, D] the new tokens of every row, packed
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], new tokens already stored
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padding entries 0
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32: cached + new tokens
    max_seqlen_q: int,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    work: torch.Tensor | None = None,  # [2, P] int32, for the kernel's default block_m
    window: int | None = None,  # sliding window: keys p - window + 1 .. p only
) -> torch.Tensor:  # [N, Hq, D]
    """Causal attention of each row's new tokens over its whole paged context (within
    `window` tokens, when given). `work`: the Triton kernel's work table (its grid then
    independent of the rows' lengths)."""
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale)
    scales = dict(k_scale=k_scale, v_scale=v_scale, window=window)
    if use_triton(q.device):
        return _paged_prefill_triton(*args, work=work, **scales)
    if q.device.type == "cpu" and not references_forced():
        return paged_prefill_attention_cpu(*args, **scales)
    return paged_prefill_attention_reference(*args, **scales)


def store_kv(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], written in place
    slot_mapping: torch.Tensor,  # [N] int64; < 0 skips the token
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's keys/values into its cache slot (quantized, to an FP8 cache)."""
    if use_triton(k.device):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., d] by weight [d], in transformers' order of roundings."""
    if use_triton(x.device):
        return _rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


Scales = tuple[torch.Tensor, torch.Tensor] | None  # (row_scale [M, 1], col_scale [1, N])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, x_scales: Scales = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual, and the RMSNorm of h by weight: (h, normed)."""
    if use_triton(x.device):
        return _add_rms_norm_triton(x, residual, weight, eps, x_scales)
    return add_rms_norm_reference(x, residual, weight, eps, x_scales)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x [N, H, D], cos/sin [N, D] -> [N, H, D] contiguous."""
    if use_triton(x.device):
        return _rotary_triton(x, cos, sin)
    return rotary_reference(x, cos, sin)


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_q_heads: int, *, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """qkv [N, Hq + 2 Hkv, D]: rotary on q and k, k and v stored at `slot_mapping` (< 0:
    not stored); returns q rotated [N, Hq, D]."""
    args = (qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)
    if use_triton(qkv.device):
        return _rotary_store_triton(*args, k_scale=k_scale, v_scale=v_scale)
    return rotary_store_reference(*args, k_scale=k_scale, v_scale=v_scale)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., d], quantized per row: (e4m3 [M, d], float32 scales [M, 1])."""
    if use_triton(x.device):
        return _rms_norm_fp8_triton(x, weight, eps, ub)
    return rms_norm_fp8_reference(x, weight, eps, ub)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     ub: float | None = None, x_scales: Scales = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h = x + residual, the RMSNorm of h quantized per row: e4m3 [M, d], scales [M, 1])."""
    if use_triton(x.device):
        return _add_rms_norm_fp8_triton(x, residual, weight, eps, ub, x_scales)
    return add_rms_norm_fp8_reference(x, residual, weight, eps, ub, x_scales)


def silu_and_mul_fp8(x: torch.Tensor, ub: float | None = None, x_scales: Scales = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of x [..., 2I], quantized per row: (e4m3 [M, I], scales [M, 1])."""
    if use_triton(x.device):
        return _silu_and_mul_fp8_triton(x, ub, x_scales)
    return silu_and_mul_fp8_reference(x, ub, x_scales)


def scale_rows(raw: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """An FP8 GEMM's raw output [M, N] scaled per row and column, in dtype."""
    if use_triton(raw.device):
        return _scale_rows_triton(raw, row_scale, col_scale, dtype)
    return scale_rows_reference(raw, row_scale, col_scale, dtype)


def argmax_scatter(logits: torch.Tensor, slots: torch.Tensor,
                   last_tok: torch.Tensor) -> torch.Tensor:
    """tokens = argmax of each row of logits [b, V]; last_tok[slots] = tokens; -> tokens."""
    if use_triton(logits.device):
        return _argmax_scatter_triton(logits, slots, last_tok)
    return argmax_scatter_reference(logits, slots, last_tok)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Each row's argmax among the tokens its bitmask [b, ceil(V/32)] int32 allows, -1 where
    it allows none; logits [b, V] -> [b] int64 (`nanoserve_kernels.argmax`)."""
    if use_triton(logits.device):
        return _masked_argmax_triton(logits, bitmask)
    return masked_argmax_reference(logits, bitmask)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [m, V], tokens [m] int64 -> [m, 2 + 2k] float32: each token's logprob, its
    rank, the k top ids and their logprobs (`nanoserve_kernels.logprobs`)."""
    if use_triton(logits.device):
        return _logprob_rows_triton(logits, tokens, k)
    return logprob_rows_reference(logits, tokens, k)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              top_k: int, renormalize: bool, **scales) -> torch.Tensor:
    """A mixture of experts: x [M, d], router logits [M, E], w13 [E, 2I, d], w2 [E, d, I]
    (FP8 with `w13_scale`, `w2_scale`, `block`) -> [M, d] (`nanoserve_kernels.fused_moe`)."""
    if use_triton(x.device):
        return _fused_moe_triton(x, logits, w13, w2, top_k, renormalize, **scales)
    return fused_moe_reference(x, logits, w13, w2, top_k, renormalize, **scales)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             slices: tuple[tuple[int, int, int], ...], index: torch.Tensor,
             groups: tuple[torch.Tensor, torch.Tensor] | None = None,
             slices_dev: torch.Tensor | None = None) -> None:
    """y [N, N_out] += each token's LoRA update from x [N, K], in place: a [S, P*R, K],
    b [S, W, R] (scale folded in), a slot per token in index [N] (-1: none); `groups` and
    `slices_dev` are the kernels' (`nanoserve_kernels.lora`)."""
    if use_triton(x.device):
        _lora_add_triton(y, x, a, b, slices, index, groups, slices_dev)
    else:
        lora_add_reference(y, x, a, b, slices, index)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if use_triton(x.device):
        return _silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


__all__ = [
    "add_rms_norm",
    "add_rms_norm_fp8",
    "argmax_scatter",
    "logprob_rows",
    "lora_add",
    "silu_and_mul_fp8",
    "masked_argmax",
    "scale_rows",
    "rms_norm_fp8",
    "rotary",
    "rotary_store",
    "decode_attention",
    "fused_moe",
    "rms_norm",
    "silu_and_mul",
    "interpreter_requested",
    "paged_prefill_attention",
    "prefill_attention",
    "store_kv",
    "references_forced",
    "use_triton",
]
