"""Continuous batching: rows join the running batch as others finish.

`generate_continuous` keeps a queue of waiting rows and a running batch. Each iteration:

1. admit: waiting rows join (first come, first served) while the running batch has fewer
   than `max_batch_size` rows, the new rows' prefill rectangle stays within
   `max_prefill_tokens`, and the pool keeps one free block per running row after their
   prompts (the headroom the next decode step can need: at most one block per row);
2. prefill the admitted rows together, in a cache of their own over the shared pool, then
   move their block tables into the running batch;
3. one decode step for every running row; before it, while the pool cannot give every row
   its next slot, the most recently admitted row is preempted: its blocks are freed and it
   goes back to the front of the queue, to be recomputed (prompt and tokens so far
   prefilled again, nothing sampled) when there is room;
4. a row that finishes (EOS, stop, length) leaves at once and its blocks go back to the pool.

Invariants: a row's tokens are the ones it gets alone (greedy exactly; sampled rows draw
from their own generator, which preemption never rewinds or re-seeds); every block is
free again when the call returns, however it ends; no decode step computes a finished
row (`BatchStats.finished_row_steps` stays 0).

The decode step runs eagerly (no CUDA graph: the batch changes shape as rows come and go).
"""

from __future__ import annotations

from collections import deque

import torch

from nanoserve.attention import AttentionMetadata
from nanoserve.block_manager import BlockTable
from nanoserve.cache import BatchedPagedKVCache, KVPool
from nanoserve.errors import CacheFullError
from nanoserve.generate import BatchStats, pool_for, right_padded
from nanoserve.model import LlamaForCausalLM
from nanoserve.sampling import SamplingParams, sample_next
from nanoserve.sequence import Sequence, SequenceOutput

DEFAULT_MAX_PREFILL_TOKENS = 16384  # rows x longest prompt of one admission's prefill


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Row:
    """A row's generation state and, while it holds KV blocks, its block table."""

    def __init__(self, index: int, seq: Sequence) -> None:
        self.index = index
        self.seq = seq
        self.table: BlockTable | None = None

    def peak_tokens(self) -> int:
        """The most tokens the row ever holds in the cache: its prompt and every new token
        but the last (which is sampled, never written)."""
        return len(self.seq.prompt_ids) + self.seq.max_new - 1

    def prefill_tokens(self) -> list[int]:
        """What a prefill writes: the prompt, plus, for a preempted row, its tokens so far
        but the last (the last is the next decode step's input)."""
        return self.seq.prompt_ids + self.seq.output_ids[:-1]


@torch.inference_mode()
def generate_continuous(model: LlamaForCausalLM, prompts: list[list[int]],
                        params: list[SamplingParams], eos_token_ids: tuple[int, ...] = (),
                        pool: KVPool | None = None, tokenizer=None, max_batch_size: int = 256,
                        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                        ) -> tuple[list[SequenceOutput], BatchStats]:
    """Generate every prompt with continuous batching; see the module docstring. Raises
    CacheFullError, having changed nothing, when a row could not fit the pool even alone
    (its prompt and its new tokens but the last, which is never written), or when the
    next row cannot start because blocks it needs are held outside this call."""
    if max_batch_size < 1 or max_prefill_tokens < 1:
        raise ValueError("max_batch_size and max_prefill_tokens must be >= 1")
    max_context = model.config.max_position_embeddings
    rows = [_Row(i, Sequence(p, sp, eos_token_ids, max_context, tokenizer))
            for i, (p, sp) in enumerate(zip(prompts, params))]
    if not rows:
        return [], BatchStats()
    if pool is None:
        pool = pool_for(model, prompts, max((r.seq.max_new for r in rows), default=1))
    bs = pool.block_size
    for r in rows:
        need = _blocks(r.peak_tokens(), bs)
        if need > pool.num_blocks:
            raise CacheFullError(
                f"prompt {r.index} ({len(r.seq.prompt_ids)} tokens + {r.seq.max_new} new) needs "
                f"{need} KV blocks; the pool has {pool.num_blocks}")
    stats = BatchStats(num_rows=len(rows))
    waiting: deque[_Row] = deque(rows)
    running: list[_Row] = []
    try:
        view: BatchedPagedKVCache | None = None  # the running rows' cache, while they stay
        while waiting or running:
            admitted = _admit(waiting, running, pool, max_batch_size, max_prefill_tokens)
            if admitted:
                _prefill(model, pool, admitted, stats)
                running += admitted
                view = None
            if _retire(running, pool):
                view = None
            if not running:
                if waiting and not admitted:  # nothing here holds a block: others do
                    raise CacheFullError(
                        f"prompt {waiting[0].index} cannot start: the pool has "
                        f"{pool.allocator.num_free} of {pool.num_blocks} blocks free")
                continue
            if _preempt_for_next_step(running, waiting, pool, stats):
                view = None
            if view is None:
                view = BatchedPagedKVCache.over(pool, [r.table for r in running])
            _decode(model, view, running, stats)
            if _retire(running, pool):
                view = None
    finally:
        for r in rows:
            if r.table is not None:
                r.table.free(pool.allocator)
                r.table = None
    return [r.seq.output() for r in rows], stats


def _admit(waiting: deque[_Row], running: list[_Row], pool: KVPool, max_batch_size: int,
           max_prefill_tokens: int) -> list[_Row]:
    """Take rows from the front of the queue while they fit (see the module docstring).
    With nothing running the first waiting row always fits: it fits the pool alone."""
    admitted: list[_Row] = []
    free = pool.allocator.num_free
    longest = 0
    while waiting and len(running) + len(admitted) < max_batch_size:
        row = waiting[0]
        n = len(row.prefill_tokens())
        # Its prompt and the token its next decode step writes (none if it never decodes).
        need = _blocks(min(n + 1, row.peak_tokens()), pool.block_size)
        headroom = len(running) + len(admitted)  # one block per row already in
        if need + headroom > free:
            break
        if admitted and (len(admitted) + 1) * max(longest, n) > max_prefill_tokens:
            break
        admitted.append(waiting.popleft())
        free -= need
        longest = max(longest, n)
    return admitted


def _prefill(model: LlamaForCausalLM, pool: KVPool, admitted: list[_Row], stats: BatchStats) -> None:
    """One padded prefill over the admitted rows (right-padded, masked), in a cache of
    their own; a new row samples its first token, a recomputed one samples nothing."""
    device = model.device
    tokens = [r.prefill_tokens() for r in admitted]
    ids, positions, valid, lens_t = right_padded(tokens)  # [B, T] each, lens [B]
    B, T = ids.shape
    stats.prefill_slots += B * T
    stats.prefill_real_tokens += int(lens_t.sum())
    cache = BatchedPagedKVCache(pool, B)
    try:
        hidden = model.hidden_states(ids.to(device), positions.to(device), cache,
                                     AttentionMetadata.prefill(valid.to(device)))
    except BaseException:
        cache.free_all()
        raise
    for r, table in zip(admitted, cache.tables):
        r.table = table
    new = [i for i, r in enumerate(admitted) if not r.seq.output_ids]
    if new:
        last = hidden[torch.tensor(new, device=device), (lens_t[new] - 1).to(device)]  # [n, d]
        _sample(model, [admitted[i] for i in new], last)


def _decode(model: LlamaForCausalLM, view: BatchedPagedKVCache, running: list[_Row],
            stats: BatchStats) -> None:
    """One token for every running row, each at its own position."""
    device = model.device
    stats.decode_row_steps += len(running)
    step_ids = torch.tensor([[r.seq.output_ids[-1]] for r in running], device=device)
    step_pos = torch.tensor([[n] for n in view.seq_lens], device=device)
    hidden = model.hidden_states(step_ids, step_pos, view, AttentionMetadata.decode())
    _sample(model, running, hidden[:, 0])


def _sample(model: LlamaForCausalLM, rows: list[_Row], hidden: torch.Tensor) -> None:
    logits = model.compute_logits(hidden)  # [n, V]
    tokens = sample_next(logits, [r.seq.params for r in rows], [r.seq.generator for r in rows])
    for r, t in zip(rows, tokens):
        r.seq.append(t)


def _retire(running: list[_Row], pool: KVPool) -> bool:
    """Drop finished rows from the running batch (in place), their blocks back to the pool."""
    done = [r for r in running if r.seq.finished]
    for r in done:
        r.table.free(pool.allocator)
        r.table = None
    running[:] = [r for r in running if not r.seq.finished]
    return bool(done)


def _preempt_for_next_step(running: list[_Row], waiting: deque[_Row], pool: KVPool,
                           stats: BatchStats) -> bool:
    """Free the most recently admitted rows until every remaining row can take its next
    token; the preempted go back to the front of the queue, in admission order."""
    preempted: list[_Row] = []
    while sum(r.table.blocks_needed(1) for r in running) > pool.allocator.num_free:
        row = running.pop()
        row.table.free(pool.allocator)
        row.table = None
        preempted.append(row)
        stats.preemptions += 1
    waiting.extendleft(preempted)  # popped newest first: extendleft restores their order
    return bool(preempted)


__all__ = ["DEFAULT_MAX_PREFILL_TOKENS", "generate_continuous"]
