"""The cache view of one continuous-batching step: where this step's K/V go and what the
decode read sees, as tensors the caller prepared (possibly fixed tensors a CUDA graph
reads), over the shared `KVPool`.

Unlike `BatchedPagedKVCache`, a `StepCache` does no bookkeeping: the scheduler reserves
the slots (all or nothing, on the host) and fills the tensors before the step runs, so
the same object serves an eager step, a fixed-tensor step and a captured one.

- `write(layer, k, v)`: k, v [B, T, Hkv, D] -> slots `slot_mapping` [B * T] (row-major);
  a slot < 0 stores nothing (the padding rows of a bucketed step).
- `rotary_store(layer, qkv, cos, sin, num_q_heads)`: a decode step's rotary embedding of
  q and k fused with the store of k and v (one kernel); returns q rotated.
- `paged_attention(layer, q)`: q [B, Hq, D], each row over `context_lens[b]` tokens of its
  `block_tables[b]` (padding entries 0: in range, see the cache invariants).
"""

from __future__ import annotations

import torch

from nanoserve.cache.pool import KVPool
from nanoserve_kernels import backend as kernel_backend

# The decode read cuts each row's own context into the step's partitions (a captured step
# meets rows of every length; partitions sized for the longest possible row would leave
# the short rows' programs idle and the long rows' programs alone at the end).
EVEN_SPLITS = True


class StepCache:
    def __init__(self, pool: KVPool, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor | None = None,
                 context_lens: torch.Tensor | None = None,
                 max_context_len: int | None = None) -> None:
        """slot_mapping [N] int64; block_tables [B, W] int32 and context_lens [B] int32 for a
        decode step or a packed prefill after cached context (None for a packed prefill that
        attends within its own tokens);
        max_context_len: a host-side bound used only to pick the decode kernel's split count
        (fixed for a captured step)."""
        self.pool = pool
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.context_lens = context_lens
        self.max_context_len = max_context_len

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None = None) -> None:
        if valid is not None:
            raise ValueError("a step cache takes packed or decode steps, not a masked rectangle")
        B, T = k.shape[:2]
        k, v = k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:])
        kernel_backend.store_kv(k, v, self.pool.k[layer], self.pool.v[layer], self.slot_mapping,
                                **self.pool.scales(layer))

    def rotary_store(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, num_q_heads: int) -> torch.Tensor:
        """qkv [B, T, Hq + 2 Hkv, D], cos/sin [B, T, D] -> q rotated [B, T, Hq, D]; k rotated
        and v go to `slot_mapping`."""
        B, T, H, D = qkv.shape
        q = kernel_backend.rotary_store(
            qkv.reshape(B * T, H, D), cos.reshape(B * T, D), sin.reshape(B * T, D),
            self.pool.k[layer], self.pool.v[layer], self.slot_mapping, num_q_heads,
            **self.pool.scales(layer))
        return q.view(B, T, num_q_heads, D)

    def paged_attention(self, layer: int, q: torch.Tensor, mask: torch.Tensor | None = None, *,
                        window: int | None = None) -> torch.Tensor:
        """window: the layer's sliding window (None: the whole context)."""
        if mask is not None or self.block_tables is None:
            raise ValueError("the decode read needs block tables and context lengths, no mask")
        return kernel_backend.decode_attention(
            q, self.pool.k[layer], self.pool.v[layer], self.block_tables, self.context_lens,
            q.shape[-1] ** -0.5, max_context_len=self.max_context_len, window=window,
            even_splits=EVEN_SPLITS, **self.pool.scales(layer))
