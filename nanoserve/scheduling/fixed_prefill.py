"""The continuous runner's packed prefills: the lengths they are padded to, and the fixed
tensors a prefill of up to `prefill_tokens` runs from (`FixedPrefills`, a part of
`nanoserve.scheduling.model_runner.ContinuousRunner`).

Packed prefill of N tokens (several rows' new tokens in one row [1, N]): on a CUDA device a
row of padding follows them up to `prefill_length(N)` tokens (token 0, write slot -1, the
padding row slot's table), so its GEMMs meet 56 shapes up to 8,192: cuBLAS picks each new
shape's kernel on the host, 5-15x the cost of a shape it has met. No real row attends to the
padding and every other op is per token, so real rows' results are those of the unpadded
prefill (up to the GEMMs' rounding at another row count).

Fixed-tensor prefills ("graph" and "static" modes): a packed prefill of a padded length T
<= `prefill_tokens` reads its inputs from fixed views of one device buffer (token ids,
positions, K/V slots [T]; row starts, row slots, context lengths [B + 1]; and the prefill
kernel's work table, whose grid depends on T alone) and writes its final hidden states into
one shared [T_max, d] buffer; in "graph" mode that forward is one CUDA graph per
`prefill_length` value and kind (rows within their own tokens, or after cached blocks
through their block tables), captured the first time that length and kind run, so a
prefill costs the host one input copy and one replay instead of ~10 launches a layer. The
LM head, sampling and prompt logprobs run after it, uncaptured (they depend on the rows).
Longer prefills run eagerly.

Invariants: a fixed prefill's inputs are views of one device buffer laid out by T alone
(`_prefill_views`), refilled by one copy (`_stage_prefill`), so a graph captured at T reads
the next prefill of T; the padding row stores nothing (write slot -1) and no real row
attends to it.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from nanoserve.cache.step_cache import StepCache
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.lora import LoraStep
from nanoserve_kernels.paged_prefill import default_block_m
from nanoserve_kernels.prefill_attention import PREFILL_BLOCK_M, prefill_work, prefill_work_size

# The longest packed prefill (padded) run from fixed tensors: one CUDA graph per
# `prefill_length` up to it and kind (2 x 56 graphs at 8,192, the scheduler's default
# admission).
PREFILL_GRAPH_TOKENS = 8192


def prefill_length(n: int) -> int:
    """The tokens a packed prefill of n runs at when padded: n rounded up to a multiple of 64
    (n <= 1,024), 128 (<= 4,096) or 256 (about 2% more tokens at the usual 4,000-8,000): 56
    lengths up to 8,192, each a prefill graph of each kind once met (mode "graph").
    Uncaptured, few shapes matter too: cuBLAS picks a GEMM's kernel on the host for
    each new shape, 0.34 ms a call at a new row count against 0.03 ms at one it has met (an
    H200, the 1B shape's q/k/v projection), and a prefill of the 1B shape makes 64 such
    calls."""
    step = 64 if n <= 1024 else 128 if n <= 4096 else 256
    return -(-n // step) * step


def prefill_lengths(max_tokens: int) -> list[int]:
    """Every `prefill_length` value up to max_tokens, ascending."""
    return sorted(t for t in {prefill_length(n) for n in range(1, max_tokens + 1)}
                  if t <= max_tokens)


class FixedPrefills:
    """The fixed-tensor prefills of a `ContinuousRunner` (mixed into it: the runner's
    `__init__` sets the fields these read, `prefill_tokens`, `_pf_rows`, `_pf_buf`,
    `_pf_hidden`, `_pf_graphs`, `_pf_failed`, and the adapters' `adapters`, `lora_slot`;
    its graphs are captured by `nanoserve.scheduling.step_graphs.StepGraphs`)."""

    def _lora_step(self, index: torch.Tensor) -> LoraStep | None:
        """A step's `LoraStep` from its tokens' adapter slots (None: no adapters)."""
        if self.adapters is None:
            return None
        return LoraStep(index, self.adapters.weights.num_slots)

    def _token_lora(self, cu: torch.Tensor, rows: torch.Tensor, n: int) -> LoraStep | None:
        """The `LoraStep` of a packed prefill's n tokens: token i of row j (cu[j] <= i <
        cu[j + 1]; cu [R + 1], rows [R] its row slots) takes `lora_slot[rows[j]]`. Fixed
        shapes, no host sync: a prefill graph holds it."""
        if self.adapters is None:
            return None
        tokens = torch.arange(n, device=cu.device, dtype=cu.dtype)
        row = torch.searchsorted(cu[1:].contiguous(), tokens, right=True)
        return self._lora_step(self.lora_slot[rows[row.clamp_max(rows.shape[0] - 1)]])

    def _prefill_buffers(self) -> None:
        """The fixed prefills' input buffer (every layout up to prefill_tokens, then the
        samplers') and their hidden states' output [T_max, d]."""
        T, B = self.prefill_tokens, self.max_batch_size
        size = 3 * T + 3 * self._pf_rows + 1 + 2 * max(self._work_size(T, p)[0] for p in (0, 1))
        self._pf_buf = torch.zeros(size + 2 * B if T else 0, dtype=torch.long, device=self.device)
        self._pf_hidden = torch.empty(T, self.model.config.hidden_size, dtype=self.model.dtype,
                                      device=self.device)  # [T_max, d]

    def _prefill_fixed(self, T, tokens, lens, writes, slots, cached, sample_from, sample_slots):
        """A packed prefill from the fixed tensors at padded length T (captured in "graph"
        mode): what `_prefill_eager` returns, as views of the fixed buffers."""
        n = sum(lens)
        if T > n:  # a row of padding: it stores nothing and no row attends to it
            tokens, lens, writes = tokens + [[0] * (T - n)], lens + [T - n], writes + [-1] * (T - n)
            slots, cached = slots + [self.pad], cached + [0]
        cu = [0]
        for m in lens:
            cu.append(cu[-1] + m)
        paged = any(cached)
        start = self._stage_prefill(T, paged, tokens, writes, cached, slots,
                                    [cu[i + 1] - 1 for i in sample_from], sample_slots)
        graph = self._pf_graphs.get((T, paged))
        if graph is not None:
            graph.replay()
            self.prefill_replays += 1
        else:
            self._prefill_forward(T, paged)
            if self.mode == "graph" and (T, paged) not in self._pf_failed:
                self._capture_prefill(T, paged)
        S = len(sample_from)
        last, idx = self._pf_buf[start:start + 2 * S].split([S, S])
        return self._pf_hidden[:T][None], self._prefill_views(T, paged)[0], cu, last, idx

    def _work_size(self, T: int, paged: bool) -> tuple[int, int]:
        """(the work table's entries, the kernel's block of queries) for a fixed prefill of
        T tokens: the ragged kernel's, or the paged one's after cached blocks."""
        cfg = self.model.config
        bm = (default_block_m(cfg.num_attention_heads // cfg.num_key_value_heads) if paged
              else PREFILL_BLOCK_M)
        return prefill_work_size(T, self._pf_rows, bm), bm

    def _prefill_views(self, T: int, paged: bool) -> tuple[torch.Tensor, ...]:
        """Padded length T's inputs, fixed views of one buffer: token ids [1, T], positions
        [1, T], K/V slots [T], row starts [rows + 1], row slots [rows], context lengths
        [rows] and the prefill kernel's work table [2 * P] (int64 here; the forward narrows
        what the kernels take as int32)."""
        R, P = self._pf_rows, self._work_size(T, paged)[0]
        ids, pos, writes, cu, rows, ctx, work = self._pf_buf[:3 * T + 3 * R + 1 + 2 * P].split(
            [T, T, T, R + 1, R, R, 2 * P])
        return ids[None], pos[None], writes, cu, rows, ctx, work

    def _prefill_forward(self, T: int, paged: bool) -> None:
        """A fixed prefill's forward (what its graph holds): the final hidden states of its T
        tokens into the shared buffer. paged: its rows attend to cached blocks through their
        block tables (the paged prefill kernel), else within their own tokens."""
        ids, pos, writes, cu, rows, ctx, work = self._prefill_views(T, paged)
        meta = AttentionMetadata.packed(cu.to(torch.int32), T, work.to(torch.int32).view(2, -1))
        if paged:
            cache = StepCache(self.pool, writes, self.block_tables.index_select(0, rows),
                              ctx.to(torch.int32))
        else:
            cache = StepCache(self.pool, writes)
        lora = self._token_lora(cu, rows, T)
        hidden = self.model.hidden_states(ids, pos, cache, meta, lora=lora)
        self._pf_hidden[:T].copy_(hidden[0])

    def _stage_prefill(self, T: int, paged: bool, tokens: list[list[int]], writes: list[int],
                       cached: list[int], slots: list[int], sample_last: list[int],
                       sample_slots: list[int]) -> int:
        """Copy a fixed prefill's inputs into its views (rows `tokens` of T tokens in all,
        padding included, each after its `cached` tokens; their K/V slots and row slots),
        and after them its samplers' last positions and row slots: returns where those
        start. Rows past the last are empty (row slot: the padding's)."""
        lens = [len(t) for t in tokens]
        R = self._pf_rows
        P, bm = self._work_size(T, paged)
        cu = np.full(R + 1, T, dtype=np.int64)
        cu[0] = 0
        cu[1:len(lens) + 1] = np.cumsum(lens)
        rows = np.full(R, self.pad, dtype=np.int64)
        rows[:len(slots)] = slots
        ctx = np.zeros(R, dtype=np.int64)
        ctx[:len(lens)] = np.add(cached, lens)
        host = np.concatenate([
            np.fromiter(chain(chain.from_iterable(tokens),
                              chain.from_iterable(map(range, cached, np.add(cached, lens))),
                              writes), dtype=np.int64, count=3 * T),
            cu, rows, ctx, prefill_work(lens, P, bm).ravel(),
            np.asarray(sample_last + sample_slots, np.int64)])
        src = torch.from_numpy(host)
        if self.device.type == "cuda":
            src = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
        self._pf_buf[:src.numel()].copy_(src, non_blocking=True)
        return 3 * T + 3 * R + 1 + 2 * P
