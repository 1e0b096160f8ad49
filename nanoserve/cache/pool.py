"""KV caches: a dense per-sequence cache, and the paged cache with one shared block
pool and one block table per sequence.

Pool layout, per layer: `k[layer], v[layer]: [num_blocks, block_size, Hkv, D]`; the
flat view `[num_slots, Hkv, D]` is indexed by slot = block * block_size + offset.
The pool's dtype is the model's, or float8 e4m3 (an FP8 KV cache: one byte per element, so
twice the tokens of a bfloat16 pool in the same memory), stored as x / scale with one K
scale and one V scale per layer (`KVPool.k_scales`, `v_scales`; `nanoserve_kernels.kv_quant`). Every
store and read of the pool passes its layer's scales (`KVPool.scales(layer)`).

Lessons kept as invariants (see the design notes):
1. The attention mask is a prefill-time object. A masked write stores only the real
   columns of the padded rectangle; after it, only a `[batch]` vector of context
   lengths survives, and the batched decode read refuses a mask.
2. Padding in the read's slot mapping and block tables is a real memory access in the
   reference, so it is slot/block 0 (always in range), never -1.
3. Reservation is all-or-nothing for the whole batch, checked before any row moves;
   bookkeeping (growing tables, "is this the first write?") happens on layer 0 only,
   because by layer 1 the rows already hold this step's tokens.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from nanoserve.cache.block_manager import (
    BlockAllocator,
    BlockTable,
    check_integrity,
    reserve_all_or_nothing,
    reserve_one_each,
)
from nanoserve_kernels import backend as kernel_backend
from nanoserve_kernels.kv_quant import check_kv_scales, is_fp8


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> CacheShape:
        """The shape for a model's `ModelConfig` (`nanoserve.model.config`), read by its
        attributes: the cache sits below the model and imports none of it."""
        return cls(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class DenseKVCache:
    """One contiguous buffer per layer for B rows of equal length (no padding).
    k[layer]: [B, max_len, Hkv, D]. The oracle the paged cache is held to."""

    def __init__(self, shape: CacheShape, max_len: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        size = (batch_size, max_len, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.max_len = max_len
        self.seq_len = 0  # tokens held per row, after layer 0's write of this step
        self._start = 0  # where this step's tokens begin

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's k, v [B, T, Hkv, D]; return all keys/values held [B, S, Hkv, D]."""
        T = k.shape[1]
        if layer == 0:
            if self.seq_len + T > self.max_len:
                raise ValueError(f"dense cache holds {self.max_len} tokens, asked for {self.seq_len + T}")
            self._start = self.seq_len
            self.seq_len += T
        self.k[layer][:, self._start:self.seq_len] = k
        self.v[layer][:, self._start:self.seq_len] = v
        return self.k[layer][:, :self.seq_len], self.v[layer][:, :self.seq_len]

    @property
    def step_start(self) -> int:
        return self._start


def _zeros(size: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU it lies in fresh anonymous memory, which the kernel
    hands out zeroed page by page on first touch: a CPU pool (1 GiB by default) costs
    nothing until its blocks are used, where `torch.zeros` would write every byte first."""
    count = math.prod(size)
    if torch.device(device).type != "cpu" or count == 0:
        return torch.zeros(size, dtype=dtype, device=device)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=dtype, count=count).view(size)


class KVPool:
    """The shared block pool: per-layer K/V tensors and the allocator over their blocks.

    k_scales, v_scales: one float per layer, for an FP8 pool (default all 1.0); any other
    dtype takes none."""

    def __init__(self, shape: CacheShape, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 k_scales: list[float] | None = None,
                 v_scales: list[float] | None = None) -> None:
        self.k_scales = _layer_scales(k_scales, shape.num_layers, dtype)
        self.v_scales = _layer_scales(v_scales, shape.num_layers, dtype)
        size = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        # Zeroed, not empty: pad reads of slot 0 must not meet NaN bit patterns.
        self.k = [_zeros(size, dtype, device) for _ in range(shape.num_layers)]
        self.v = [_zeros(size, dtype, device) for _ in range(shape.num_layers)]
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.allocator = BlockAllocator(num_blocks)
        self.device = torch.device(device)
        self.dtype = dtype

    @classmethod
    def for_memory(cls, shape: CacheShape, num_bytes: int, block_size: int = 16,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   k_scales: list[float] | None = None,
                   v_scales: list[float] | None = None) -> KVPool:
        per_block = shape.bytes_per_token(dtype) * block_size
        return cls(shape, max(1, num_bytes // per_block), block_size, dtype, device,
                   k_scales, v_scales)

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds, all blocks full."""
        return self.num_blocks * self.block_size

    def scales(self, layer: int) -> dict[str, float]:
        """`k_scale` and `v_scale` of one layer, as the kernels' keyword arguments."""
        return {"k_scale": self.k_scales[layer], "v_scale": self.v_scales[layer]}

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks' K/V, every layer: (source, destination) pairs (a forked
        sample's partly filled last block). Queued on the device like any kernel."""
        if not pairs:
            return
        src = torch.tensor([a for a, _ in pairs], dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.int64).to(self.device, non_blocking=True)
        for pool in (*self.k, *self.v):
            if is_fp8(pool.dtype):  # index_copy_ has no float8 kernel: copy the bytes
                pool = pool.view(torch.uint8)
            pool.index_copy_(0, dst, pool.index_select(0, src))

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_slots, Hkv, D] views of one layer."""
        s = self.shape
        return (self.k[layer].view(-1, s.num_kv_heads, s.head_dim),
                self.v[layer].view(-1, s.num_kv_heads, s.head_dim))


def _layer_scales(scales: list[float] | None, num_layers: int, dtype: torch.dtype) -> list[float]:
    if scales is None:
        return [1.0] * num_layers
    scales = [float(s) for s in scales]
    if len(scales) != num_layers:
        raise ValueError(f"{len(scales)} KV scales for {num_layers} layers")
    for s in scales:
        check_kv_scales(dtype, s, 1.0)
    return scales


class BatchedPagedKVCache:
    """N sequences, N block tables, one allocator and one pool underneath.

    Step protocol, driven by the model's forward: every layer calls `write` in order
    0..L-1 with this step's k/v; layer 0 reserves slots for the whole batch (or raises
    CacheFullError having changed nothing) and fixes the step's slot tensors, which
    layers 1..L-1 reuse.
    """

    def __init__(self, pool: KVPool, batch_size: int) -> None:
        self.pool = pool
        self.tables = [BlockTable(pool.block_size) for _ in range(batch_size)]
        self._write_slots: torch.Tensor | None = None  # [N] int64, this step's new slots
        self._block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, on the device
        self._context_lens: torch.Tensor | None = None  # [B] int32
        # Host mirror of the block tables, updated only where a row gained blocks, so a
        # decode step does not rebuild B x max_blocks Python lists. Padding stays 0.
        self._bt_host = torch.zeros(batch_size, 8, dtype=torch.int32)
        self._static: _StaticStepTensors | None = None  # set by use_static_step_tensors

    @classmethod
    def over(cls, pool: KVPool, tables: list[BlockTable]) -> BatchedPagedKVCache:
        """A batch over existing block tables, shared, not copied: a step's writes append
        to them, and freeing them stays with their owner (continuous batching's running
        rows, whose tables outlive any one batch)."""
        if not tables:
            raise ValueError("a batch needs at least one row")
        cache = cls(pool, len(tables))
        cache.tables = list(tables)
        cache._mirror_new_blocks([0] * len(tables))
        return cache

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    @property
    def seq_lens(self) -> list[int]:
        return [t.num_tokens for t in self.tables]

    @property
    def cached_tokens(self) -> int:
        return sum(self.seq_lens)

    def blocks_needed(self, num_new_tokens: list[int]) -> int:
        return sum(t.blocks_needed(n) for t, n in zip(self.tables, num_new_tokens))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None = None) -> None:
        """Store this step's real K/V. k, v: [B, T, Hkv, D]; valid: [B, T] bool key mask
        (a prefill) or None (every column is real: a decode step, T == 1 usually)."""
        B, T = k.shape[:2]
        if B != self.batch_size:
            raise ValueError(f"cache holds {self.batch_size} rows, write has {B}")
        if self._static is not None:
            if valid is not None or T != 1:
                raise ValueError("static step tensors serve decode steps only (T == 1, no mask)")
            # The step was begun by begin_decode_step() before this forward (or replay).
        elif layer == 0:
            self._begin_step(valid, B, T, k.device)
        elif self._write_slots is None:
            raise RuntimeError("layer 0 must write first in each step")
        if valid is not None:
            k, v = k[valid], v[valid]  # [N, Hkv, D], row-major over the real columns
        else:
            k, v = k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:])
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        kernel_backend.store_kv(k, v, k_pool, v_pool, self._write_slots, **self.pool.scales(layer))

    def _begin_step(self, valid: torch.Tensor | None, B: int, T: int, device) -> None:
        if valid is not None:
            if self.cached_tokens != 0:
                raise ValueError("a masked prefill lands only on an empty cache")
            counts = valid.sum(dim=1).tolist()
        else:
            counts = [T] * B
        held = [len(t.blocks) for t in self.tables]
        slots = reserve_all_or_nothing(self.tables, counts, self.pool.allocator)
        flat = [s for row in slots for s in row]
        self._write_slots = torch.tensor(flat, dtype=torch.int64, device=device)
        self._mirror_new_blocks(held)
        width = max(1, max(len(t.blocks) for t in self.tables))
        self._block_tables = self._bt_host[:, :width].to(device, non_blocking=True)
        self._context_lens = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)

    def _mirror_new_blocks(self, held: list[int]) -> None:
        width = max(len(t.blocks) for t in self.tables)
        if width > self._bt_host.shape[1] and self._static is not None:
            raise RuntimeError(
                f"a row needs {width} blocks; the static block tables hold {self._bt_host.shape[1]}"
            )
        if width > self._bt_host.shape[1]:
            grown = torch.zeros(self.batch_size, max(width, 2 * self._bt_host.shape[1]),
                                dtype=torch.int32)
            grown[:, : self._bt_host.shape[1]] = self._bt_host
            self._bt_host = grown
        for i, (t, n) in enumerate(zip(self.tables, held)):
            if len(t.blocks) > n:
                self._bt_host[i, n:len(t.blocks)] = torch.tensor(t.blocks[n:], dtype=torch.int32)

    def mirror_block_tables(self) -> None:
        """Refresh the host mirror of every row's block table (after the tables were grown
        outside a step: a prefill through another cache view)."""
        self._mirror_new_blocks([0] * self.batch_size)

    def block_table_tensor(self) -> torch.Tensor:
        """[B, max_blocks] int32, padded with block 0 (in range: see invariant 2)."""
        width = max(1, max(len(t.blocks) for t in self.tables))
        rows = [t.blocks + [0] * (width - len(t.blocks)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.pool.device)

    def slot_mapping(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The read's addressing: slots [B, max_ctx] int64 padded with slot 0, and
        context_lens [B] int32."""
        width = max(1, max(self.seq_lens))
        rows = [t.slots() + [0] * (width - t.num_tokens) for t in self.tables]
        slots = torch.tensor(rows, dtype=torch.int64, device=self.pool.device)
        lens = torch.tensor(self.seq_lens, dtype=torch.int32, device=self.pool.device)
        return slots, lens

    def paged_attention(self, layer: int, q: torch.Tensor, mask: torch.Tensor | None = None,
                        *, window: int | None = None) -> torch.Tensor:
        """Batched decode read: q [B, Hq, D] -> [B, Hq, D], each row over its own
        context (its last `window` tokens with a sliding window). Refuses a mask: after
        the ragged write, context lengths say it all."""
        if mask is not None:
            raise ValueError("the batched decode read takes no mask: context_lens replace it")
        if self._block_tables is None:
            self._block_tables = self.block_table_tensor()
            self._context_lens = torch.tensor(self.seq_lens, dtype=torch.int32, device=q.device)
        scale = q.shape[-1] ** -0.5
        return kernel_backend.decode_attention(
            q, self.pool.k[layer], self.pool.v[layer], self._block_tables, self._context_lens, scale,
            window=window, **self.pool.scales(layer),
        )

    def free_row(self, i: int) -> None:
        self.tables[i].free(self.pool.allocator)
        self._bt_host[i] = 0

    def free_all(self) -> None:
        for i in range(self.batch_size):
            self.free_row(i)
        self._write_slots = self._block_tables = self._context_lens = None
        self._static = None

    # --- static step tensors (what a captured decode graph reads) -------------------------

    def use_static_step_tensors(self, max_blocks: int) -> None:
        """From now on, decode steps only: this step's slots, the block tables and the
        context lengths live in fixed device tensors refilled in place by
        `begin_decode_step`, so a CUDA graph captured over a forward keeps reading the
        current step. `max_blocks` fixes the block tables' width (the batch's peak), and
        with it the decode kernel's split count. Layer 0's write no longer begins a step:
        call `begin_decode_step()` before each forward or replay."""
        held = max(len(t.blocks) for t in self.tables)
        if max_blocks < max(1, held):
            raise ValueError(f"max_blocks={max_blocks} is below the {held} blocks a row holds")
        B, device = self.batch_size, self.pool.device
        pin = device.type == "cuda"
        mirror = torch.zeros(B, max_blocks, dtype=torch.int32, pin_memory=pin)
        width = min(self._bt_host.shape[1], max_blocks)
        mirror[:, :width] = self._bt_host[:, :width]
        self._bt_host = mirror
        self._static = _StaticStepTensors(B, max_blocks, device)
        self._write_slots = self._static.slots
        self._block_tables = self._static.block_tables
        self._context_lens = self._static.context_lens

    def fill_idle_step(self) -> None:
        """A step that stores nothing (slots -1) and reads one token of block 0 per row,
        for warming up and capturing a graph without touching any row's cache."""
        st = self._require_static()
        st.slots.fill_(-1)
        st.context_lens.fill_(1)
        st.block_tables.zero_()

    def begin_decode_step(self) -> None:
        """Reserve one slot per row (all or nothing: CacheFullError changes nothing) and
        refill the static tensors with this step's slots, tables and context lengths."""
        st = self._require_static()
        st.wait_for_copies()  # the last step's copies still read the pinned mirror
        held = [len(t.blocks) for t in self.tables]
        slots = reserve_one_each(self.tables, self.pool.allocator)
        self._mirror_new_blocks(held)
        st.refill(slots, self.seq_lens, self._bt_host)

    def _require_static(self) -> _StaticStepTensors:
        if self._static is None:
            raise RuntimeError("call use_static_step_tensors(max_blocks) first")
        return self._static

    def check_integrity(self) -> None:
        """Assumes this cache is the pool's only user."""
        check_integrity(self.pool.allocator, self.tables)


class PagedKVCache(BatchedPagedKVCache):
    """One sequence over a pool: the batched cache with a single table."""

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool, 1)

    @property
    def table(self) -> BlockTable:
        return self.tables[0]

    @property
    def seq_len(self) -> int:
        return self.tables[0].num_tokens


class _StaticStepTensors:
    """Fixed device tensors of a decode step, refilled in place from pinned host staging.

    Invariant: host staging (and the cache's pinned block-table mirror) is rewritten only
    after `wait_for_copies()`, which waits for the previous refill's non-blocking copies,
    so a copy never reads half-rewritten host memory."""

    def __init__(self, batch: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.slots = torch.full((batch,), -1, dtype=torch.int64, device=device)  # [B]
        self.context_lens = torch.ones(batch, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self._slots_host = torch.zeros(batch, dtype=torch.int64, pin_memory=pin)
        self._lens_host = torch.zeros(batch, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def refill(self, slots: list[int], context_lens: list[int], block_tables_host: torch.Tensor) -> None:
        """Call after wait_for_copies(). block_tables_host: [B, max_blocks] int32, pinned."""
        self._slots_host.copy_(torch.tensor(slots, dtype=torch.int64))
        self._lens_host.copy_(torch.tensor(context_lens, dtype=torch.int32))
        self.slots.copy_(self._slots_host, non_blocking=True)
        self.context_lens.copy_(self._lens_host, non_blocking=True)
        self.block_tables.copy_(block_tables_host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
