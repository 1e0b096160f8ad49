"""Grouped-query attention over the three kinds of cache, and the step metadata.

Shapes: q [B, T, Hq, D]; k, v [B, T, Hkv, D]; query head h reads KV head h // (Hq/Hkv).

The branches of `gqa_attention`:
- no cache: dense causal attention over this step's tokens (a pure forward);
- `DenseKVCache`: append, then attend over everything held, causally by position;
- paged cache with a mask (prefill): store each row's real K/V in its blocks, then
  attend densely over this step's own tokens, which on a prefill are the whole history;
- paged cache without a mask (decode, T == 1): store, then the batched paged read.
Every branch takes an optional sliding `window` W (None: none): the query at position p
sees only the keys at positions p-W+1 .. p (transformers' `sliding_window` semantics).
With an FP8 pool, a prefill's own tokens attend to each other as computed (the
quantized copies in the pool serve the later reads: decode steps, and the paged prefill
after a prefix-cache hit), as vLLM's FP8 KV cache does.

A padded prefill may arrive packed (`AttentionMetadata.packed_from`: the model ran its
projections on the real tokens only, one row [1, N]); its q/k/v are put back in their
rectangle, the branch above runs on it as for an unpacked step, and its output is packed
again, so packing changes how much work the projections do, not the attention's result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoserve_kernels import backend as kernel_backend


@dataclass(frozen=True)
class AttentionMetadata:
    """What a forward step needs beyond token ids and positions, computed once per step
    (not once per layer).

    valid: [B, T] bool, True on real (non-pad) columns: present on a prefill, None on
    a decode step (every row contributes exactly its one real token).
    cu_seqlens: [B + 1] int32 offsets of each row's real tokens once packed, and
    max_seqlen the longest row: set when `valid` is right-padded (real tokens first),
    which is what lets the ragged prefill kernel skip the padded rectangle.
    """

    valid: torch.Tensor | None = None
    is_prefill: bool = True
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    # The step's tokens are the real columns of this [B, T] mask (`valid`), packed into one
    # row [1, N] in row-major order (`as_packed`); None: the step's input has its own shape.
    packed_from: torch.Tensor | None = None
    # A packed prefill's work table for the prefill kernel that runs (the ragged one, or the
    # paged one after cached blocks: [2, P] int32, `nanoserve_kernels.prefill_attention.prefill_work`
    # for that kernel's block_m): its grid then depends on P alone, which is what lets a
    # CUDA graph serve every packing of one token count. None: the usual grid.
    work: torch.Tensor | None = None

    def as_packed(self) -> AttentionMetadata:
        """This padded prefill's metadata for its real tokens packed into one row."""
        if self.valid is None or not self.is_prefill:
            raise ValueError("only a padded prefill (with its valid mask) can be packed")
        return dataclasses.replace(self, packed_from=self.valid)

    @classmethod
    def prefill(cls, valid: torch.Tensor | None = None) -> AttentionMetadata:
        if valid is None:
            return cls(valid=None, is_prefill=True)
        B, T = valid.shape
        lens = valid.sum(dim=1)  # [B]
        right_padded = torch.arange(T, device=valid.device)[None] < lens[:, None]
        if not bool((valid == right_padded).all()):
            return cls(valid=valid, is_prefill=True)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=valid.device)
        cu[1:] = torch.cumsum(lens, 0)
        return cls(valid=valid, is_prefill=True, cu_seqlens=cu, max_seqlen=int(lens.max()))

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, max_seqlen: int,
               work: torch.Tensor | None = None) -> AttentionMetadata:
        """A packed prefill: the step's input is one row [1, N] holding several prompts
        back to back, prompt b owning tokens cu_seqlens[b]:cu_seqlens[b + 1]."""
        return cls(valid=None, is_prefill=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                   work=work)

    @classmethod
    def decode(cls) -> AttentionMetadata:
        return cls(valid=None, is_prefill=False)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * n_rep, D]; KV head j serves query heads j*n_rep.."""
    if n_rep == 1:
        return x
    return x.repeat_interleave(n_rep, dim=2)


def dense_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D], allowed [B, T, S] bool -> [B, T, Hq, D]."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None]
    )
    return out.transpose(1, 2)


def _causal_allowed(valid: torch.Tensor | None, B: int, T: int, offset: int, device,
                    window: int | None = None) -> torch.Tensor:
    """[B, T, offset + T] bool: query t sees keys j <= offset + t that are real (and, with
    a window, j > offset + t - window). A query always sees itself, so pad queries never
    meet an all-masked row."""
    S = offset + T
    qpos = torch.arange(T, device=device)[:, None] + offset
    kpos = torch.arange(S, device=device)[None, :]
    causal = kpos <= qpos
    if window is not None:
        causal = causal & (kpos > qpos - window)
    allowed = causal.expand(B, T, S)
    if valid is not None:
        allowed = allowed & valid[:, None, :]
        allowed = allowed | (kpos == qpos)
    return allowed


def _prefill_packed(q, k, v, meta: AttentionMetadata, window: int | None = None) -> torch.Tensor:
    """Ragged causal attention through the prefill kernel: pack the real tokens of a
    right-padded rectangle, attend per sequence (cu_seqlens), scatter back."""
    valid = meta.valid
    out_packed = kernel_backend.prefill_attention(
        q[valid], k[valid], v[valid], meta.cu_seqlens, meta.max_seqlen, q.shape[-1] ** -0.5,
        window=window,
    )  # [N, Hq, D]
    out = torch.zeros_like(q)
    out[valid] = out_packed
    return out


def _unpack(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[1, N, H, D] packed real tokens -> [B, T, H, D] with zeros in the padding."""
    out = x.new_zeros(*valid.shape, *x.shape[2:])
    out[valid] = x[0]
    return out


def gqa_attention(q, k, v, layer: int, cache, meta: AttentionMetadata,
                  window: int | None = None) -> torch.Tensor:
    if meta.packed_from is not None:  # back to the rectangle, attend, pack the output again
        valid = meta.packed_from
        out = gqa_attention(_unpack(q, valid), _unpack(k, valid), _unpack(v, valid), layer,
                            cache, dataclasses.replace(meta, packed_from=None), window)
        return out[valid][None]
    from nanoserve.cache.pool import BatchedPagedKVCache, DenseKVCache
    from nanoserve.cache.step_cache import StepCache

    B, T = q.shape[:2]
    if isinstance(cache, StepCache):
        cache.write(layer, k, v)
        if not meta.is_prefill:
            return cache.paged_attention(layer, q[:, 0], window=window)[:, None]  # [B, 1, Hq, D]
        if B != 1 or meta.cu_seqlens is None:
            raise ValueError("a step cache's prefill is packed: input [1, N] with cu_seqlens")
        if cache.block_tables is not None:  # after cached context: attend through the pool
            out = kernel_backend.paged_prefill_attention(
                q[0], cache.pool.k[layer], cache.pool.v[layer], cache.block_tables,
                meta.cu_seqlens, cache.context_lens, meta.max_seqlen, q.shape[-1] ** -0.5,
                work=meta.work, window=window, **cache.pool.scales(layer))
        else:
            out = kernel_backend.prefill_attention(q[0], k[0], v[0], meta.cu_seqlens,
                                                   meta.max_seqlen, q.shape[-1] ** -0.5,
                                                   window=window, work=meta.work)
        return out[None]  # [1, N, Hq, D]
    if cache is None and meta.valid is None and meta.cu_seqlens is not None:
        # a packed prefill that keeps no KV (an embedding's rows): the ragged kernel alone
        out = kernel_backend.prefill_attention(q[0], k[0], v[0], meta.cu_seqlens,
                                               meta.max_seqlen, q.shape[-1] ** -0.5,
                                               window=window)
        return out[None]  # [1, N, Hq, D]
    if cache is None:
        return dense_attention(q, k, v, _causal_allowed(meta.valid, B, T, 0, q.device, window))
    if isinstance(cache, DenseKVCache):
        keys, values = cache.write(layer, k, v)
        allowed = _causal_allowed(None, B, T, cache.step_start, q.device, window)
        return dense_attention(q, keys, values, allowed)
    if not isinstance(cache, BatchedPagedKVCache):
        raise TypeError(f"unknown cache type {type(cache).__name__}")
    if meta.is_prefill:
        if meta.valid is None:
            raise ValueError("a paged prefill needs the step's valid mask (AttentionMetadata.prefill(valid))")
        cache.write(layer, k, v, meta.valid)
        if meta.cu_seqlens is not None and kernel_backend.use_triton(q.device):
            return _prefill_packed(q, k, v, meta, window)
        return dense_attention(q, k, v, _causal_allowed(meta.valid, B, T, 0, q.device, window))
    if T != 1:
        raise ValueError(f"a decode step carries one token per row, got {T}")
    cache.write(layer, k, v, None)
    return cache.paged_attention(layer, q[:, 0], window=window)[:, None]  # [B, 1, Hq, D]
