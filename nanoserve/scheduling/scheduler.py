"""Continuous batching: rows join the running batch as others finish.

`ContinuousScheduler` keeps a queue of waiting rows and a running batch over one KV pool,
and drives a `ContinuousRunner` (nanoserve/scheduling/model_runner.py). Each iteration of `step`:

1. while fewer than two operations are unread on the device:
   a. admit: when nothing runs, or when at least min(waiting rows, max_batch_size /
      ADMIT_FULL_SHARE) row slots are free, or min(waiting rows, max_batch_size /
      ADMIT_SHARE) and the batch ran ADMIT_WAIT_STEPS decode steps since its last
      admission, waiting rows join (first come, first served)
      while the running batch has fewer than `max_batch_size` rows, the admitted prompts
      hold at most `max_prefill_tokens` tokens together (the first always goes), and the
      pool keeps one free block per running row after their prompts (what the next step
      can need); the admitted rows are prefilled together, packed (on a GPU followed by
      a padding row: `nanoserve.scheduling.fixed_prefill.prefill_length`), and new rows sample their
      first token on the device;
   b. one decode step for every running row that may still need a token, the rows ordered
      longest context first (so the attention kernel's programs for the longest rows
      start first and the GPU's multiprocessors end together; `ORDER_LONGEST_FIRST`):
      each row's next slot is reserved first (all rows or none); when the pool cannot
      give every row its slot, queued work is read, and the most recently admitted rows
      are preempted (blocks freed, back to the front of the queue, recomputed later:
      prompt and tokens so far prefilled again, nothing sampled again);
2. read the oldest unread operation's tokens, run the stop rules, and let rows that
   finished leave (their blocks and row slot go back).

The device runs step t+1 while the host reads step t and does its bookkeeping: a step's
input tokens never travel through the host (see the runner's row slots). The price: a row
that stops on EOS or a stop string is known to have finished one step late, so at most
one step per such row computes a token that is dropped (`BatchStats.finished_row_steps`).
A row that stops on length is never stepped past its last token.

Output controls (`nanoserve.sampling.step_sampling`, shared with the static batches): a decode step
holding a row with a structured output queues its forward, then reads the older operations
(the rows' previous tokens: their matchers advance) while that forward runs, and begins its
sampling: the rows' bitmasks are filled from their matchers, on the runner's fill thread
when the step is greedy (xgrammar lets go of the GIL, so the host admits rows and prepares
the next step beside it). The sampling is queued (`_complete`) before anything else goes to
the device or a result is read: before the next prefill (so a row slot freed since is not
written after its new row's prefill) and the next forward. The step is read at the next
iteration, once the next forward is queued. The graph boundary is at the logits: in a step
whose rows all take their argmax and want no logprobs, every row takes the masked argmax (an
unconstrained row's mask allows every token: the same token as the captured argmax), itself
one CUDA graph per bucket (`ContinuousRunner._masked_step`); otherwise rows without a
constraint keep the captured step's argmax. A row's `n` samples are admitted
together: the prompt is prefilled once, samples 1..n-1 fork its block table (full blocks
shared, the partly filled last block copied) and draw their first tokens from the same
logits with their own keys. Samples that did not fit that admission run later as rows of
their own (the prefix cache may still serve their prompt). Logprobs ride back with the
tokens; prompt logprobs are computed at the prefill of a row that asks, which never
starts from cached blocks.

Invariants: a row's tokens are the ones it gets alone (greedy exactly; sampled rows draw
from counter-based noise keyed by their seed and token number, which preemption does not
disturb); every block is free again when `run` returns or raises; a row is in at most one
prefill, and only its own steps write its blocks.

LoRA adapters (`runner.adapters`): admission takes a device slot for a row's adapter
(`AdapterSlots.acquire`: shared with its running rows, else loaded, the least recently used
idle one evicted); a row whose adapter finds no slot waits, as one short of blocks does. Its
prefix-cache names start from its adapter's root (`prefix_root`).

`add` may be called between steps (the batch worker keeps one scheduler running across
the driver's batches): a group's `on_done` callback gets its outputs when its last row
finishes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from itertools import chain
from time import perf_counter

import numpy as np
import torch

from nanoserve.cache.block_manager import (
    BlockTable,
    decode_demand,
    reserve_all_or_nothing,
    reserve_one_each,
)
from nanoserve.cache.pool import KVPool
from nanoserve.cache.prefix_cache import (
    blocks_to_admit,
    hash_blocks,
    max_cached_blocks,
    prefix_root,
)
from nanoserve.errors import CacheFullError
from nanoserve.model.model import LlamaForCausalLM
from nanoserve.multimodal.prompt import MultimodalPrompt, RowImages, check_image_model
from nanoserve.sampling.logprobs import entries
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sequence import Sequence, SequenceOutput, samples_of
from nanoserve.sampling.step_sampling import StepSampling
from nanoserve.sampling.structured import accept_tokens
from nanoserve.scheduling.lora_slots import AdapterSlots
from nanoserve.scheduling.model_runner import ContinuousRunner, Launched, PrefillImages
from nanoserve.static.generate import BatchStats, pool_for

DEFAULT_MAX_PREFILL_TOKENS = 8192  # prompt tokens of one admission's packed prefill
MAX_UNREAD = 2  # operations queued on the device ahead of the host
# Decode steps list their rows longest context first: the decode attention launches one
# program per (row, KV head) in row order, so the longest rows start first and the short
# ones fill in behind them. A row's result does not depend on its place in the step.
ORDER_LONGEST_FIRST = True
# A running batch takes new rows in groups, not row by row: each admission is one packed
# prefill, whose host and device time (a graph replay up to 8,192 tokens on a GPU, else
# ~10 launches a layer) each row would otherwise pay alone. (These values were measured
# with prefills launched op by op, before the prefill graphs.) It admits once 1/ADMIT_SHARE
# of its row slots are free (8 of 256) and it ran ADMIT_WAIT_STEPS decode steps since its
# last admission, or at once when 1/ADMIT_FULL_SHARE are free (64 of 256). Rows that end
# slowly (long outputs: about one every other step) join 8 at a time, as soon as 8 slots
# are free; rows that end by the dozen each step (short outputs) join in groups of ~50
# every few steps instead of a dozen after every step: a third of the prefills (3,000
# rows of 8-32 tokens over shared system prompts: 69 prefills against 210, 2x the rate).
ADMIT_SHARE = 32
ADMIT_FULL_SHARE = 4
ADMIT_WAIT_STEPS = 4


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Group:
    """Rows added together; `on_done(outputs)` runs when the last of them finishes."""

    def __init__(self, size: int, on_done: Callable[[list[SequenceOutput]], None] | None) -> None:
        self.outputs: list[SequenceOutput | None] = [None] * size
        self.left = size
        self.on_done = on_done


class _Row:
    """A row's generation state and, while it runs, its block table and row slot."""

    def __init__(self, seq: Sequence, group: _Group, index: int,
                 fork_of: _Row | None = None) -> None:
        self.seq = seq
        self.group, self.index = group, index
        self.fork_of = fork_of  # sample 0 of its prompt, for samples 1..n-1
        self.forks: list[_Row] = []  # samples admitted with it, forked at its prefill
        self.table: BlockTable | None = None
        self.slot: int | None = None
        self.launched = 0  # tokens whose computation was queued (prefill sample included)
        self.sent_blocks = 0  # block-table entries the runner has for this row
        self.hit: list[int] = []  # cached blocks found for its prefill, at admission
        self._names: tuple[int, list[bytes]] = (-1, [])  # (prefill length, block names)
        self.images: RowImages | None = None  # its prompt's images (a vision-language model)
        self.lora: str | None = None  # its LoRA adapter (None: the base model)
        self.lora_slot: int | None = None  # the adapter's device slot while it runs (-1: none)

    @property
    def rope_delta(self) -> int:
        """How far its rotary positions run ahead of its cache positions (<= 0; nonzero
        only for a prompt with images: nanoserve/multimodal/mrope.py)."""
        return self.images.delta if self.images is not None else 0

    def name_tokens(self) -> list[int]:
        """`prefill_tokens()` as its prefix-cache names see them: an image's placeholders
        stand as keys of the image's bytes (nanoserve/multimodal/prompt.py)."""
        if self.images is None:
            return self.prefill_tokens()
        return self.images.keyed + self.seq.output_ids[:-1]

    def block_names(self, block_size: int) -> list[bytes]:
        """The prefix-cache names of its prefill's full blocks (`hash_blocks` of
        `prefill_tokens()`; computed once per prefill length: a preempted row's prefill is
        longer). Its prefill may take the first `max_cached_blocks` of them from the cache
        and names them all once written."""
        tokens = self.name_tokens()
        if self._names[0] != len(tokens):
            self._names = (len(tokens), hash_blocks(tokens, block_size, prefix_root(self.lora)))
        return self._names[1]

    def peak_tokens(self) -> int:
        """The most tokens the row ever holds in the cache: its prompt and every new token
        but the last (which is sampled, never written)."""
        return len(self.seq.prompt_ids) + self.seq.max_new - 1

    def prefill_tokens(self) -> list[int]:
        """What a prefill writes: the prompt, plus, for a preempted row, its tokens so far
        but the last (the last is the next decode step's input)."""
        return self.seq.prompt_ids + self.seq.output_ids[:-1]

    def wants_step(self) -> bool:
        return not self.seq.finished and self.launched < self.seq.max_new


class _Op:
    """An operation queued on the device and what reading it needs: the rows its tokens go
    to (in order), the sampling it was queued with, and the rows whose prompt logprobs it
    computes (each with the samples forked from it)."""

    def __init__(self, launched: Launched, rows: list[_Row], sampling: StepSampling | None,
                 prompt: list[_Row] = ()) -> None:
        self.launched, self.rows, self.sampling, self.prompt = launched, rows, sampling, prompt


class ContinuousScheduler:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, runner: ContinuousRunner,
                 eos_token_ids: tuple[int, ...] = (), tokenizer=None,
                 max_batch_size: int | None = None,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 prefix_caching: bool = True, grammars=None) -> None:
        """prefix_caching: a new row starts from the longest run of its prompt's full blocks
        that the pool already holds (nanoserve/cache/prefix_cache.py) and prefills only the rest;
        its own full prompt blocks are named for later rows once written. grammars: the
        engine's `GrammarCache` (rows with structured outputs need it)."""
        if max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        self.model, self.pool, self.runner = model, pool, runner
        self.eos_token_ids, self.tokenizer = eos_token_ids, tokenizer
        self.max_batch_size = min(max_batch_size or runner.max_batch_size, runner.max_batch_size)
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_caching = prefix_caching
        self.grammars = grammars
        self.adapters = runner.adapters or AdapterSlots.empty()  # LoRA adapters' slots
        self.words = grammars.words if grammars is not None else 0
        self.waiting: deque[_Row] = deque()
        self.running: list[_Row] = []
        self.unread: deque[_Op] = deque()
        self.free_slots = list(range(runner.max_batch_size - 1, -1, -1))
        self.stats = BatchStats()
        self.steps_since_admit = 0  # decode steps launched since the last admission
        # A steered decode step whose sampling has begun (its masks filling on the runner's
        # fill thread while this host admits and prepares the next step) but is not queued:
        # `_complete` queues it before anything else reaches the device or reads a result.
        self._pending: _Op | None = None

    # --- the public surface -----------------------------------------------------------------

    def add(self, prompts: list[list[int]], params: list[SamplingParams],
            on_done: Callable[[list[SequenceOutput]], None] | None = None,
            lora: list[str | None] | None = None) -> _Group:
        """Queue rows; a row asking for n samples is n rows, and `on_done` gets one output per
        sample (a prompt's samples consecutively). Raises ValueError (a bad prompt or
        constraint, an unknown adapter) or CacheFullError (a row that cannot fit the pool even
        alone) having queued none of them. A prompt may be a `MultimodalPrompt` (token ids and
        images); `lora`: each prompt's LoRA adapter (None: the base model)."""
        lora = self.adapters.check_names(lora, len(prompts))
        max_context = self.model.config.max_position_embeddings
        images = [self._row_images(p) for p in prompts]
        samples = [samples_of(p.token_ids if isinstance(p, MultimodalPrompt) else p, sp,
                              self.eos_token_ids, max_context, self.tokenizer, self.grammars)
                   for p, sp in zip(prompts, params, strict=True)]
        group = _Group(sum(len(g) for g in samples), on_done)
        rows: list[_Row] = []
        for g, imgs, adapter in zip(samples, images, lora):
            first = _Row(g[0], group, len(rows))
            rows.append(first)
            rows += [_Row(seq, group, len(rows) + j, fork_of=first) for j, seq in enumerate(g[1:])]
            for r in rows[len(rows) - len(g):]:
                r.images, r.lora = imgs, adapter
        for r in rows:
            need = _blocks(r.peak_tokens(), self.pool.block_size)
            if need > min(self.pool.num_blocks, self.runner.width):
                raise CacheFullError(
                    f"prompt {r.index} ({len(r.seq.prompt_ids)} tokens + {r.seq.max_new} new) "
                    f"needs {need} KV blocks; the pool has {self.pool.num_blocks}")
        self.waiting.extend(rows)
        self.stats.num_rows += len(rows)
        if not rows and on_done is not None:
            on_done([])
        return group

    def _row_images(self, prompt) -> RowImages | None:
        if not isinstance(prompt, MultimodalPrompt) or not prompt.images:
            return None
        config = self.model.config
        check_image_model(config)
        return RowImages(prompt, config.image_token_id, config.vision.spatial_merge_size)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.unread)

    def run(self) -> None:
        """Step until every queued row has finished. On any exception every row is dropped
        and every block freed before it propagates."""
        try:
            while self.has_work:
                self.step()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop every row, waiting or running, and free their blocks (after the device has
        finished what was queued, so nothing still writes into them)."""
        try:
            if self._pending is not None:
                self.runner.drop_sampling(self._pending.launched)
                self._pending = None
            self.runner.sync()
        finally:
            for r in self.running:
                self._release(r)
            self.running.clear()
            self.waiting.clear()
            self.unread.clear()

    def _complete(self) -> None:
        """Queue the pending steered step's sampling (waiting for its masks), if any."""
        if self._pending is not None:
            t = perf_counter()
            op, self._pending = self._pending, None
            self.runner.finish_decode(op.launched, op.sampling)
            self._tick("sample_finish", t)

    def _tick(self, key: str, t0: float) -> float:
        """Add the host seconds since t0 to the runner's profile under `key` (profile on)."""
        t = perf_counter()
        if self.runner.profile:
            self.runner.host_s[key] = self.runner.host_s.get(key, 0.0) + t - t0
        return t

    def step(self) -> None:
        steered = False  # a step with a structured output was queued, its older ops read
        t = perf_counter()
        alone = False  # nothing ran when the admission was tried: it had to take a row
        if len(self.unread) < MAX_UNREAD:
            alone = not self.running
            admitted = self._admit()
            if admitted:
                self._prefill(admitted)
            t = self._tick("admit", t)
            rows = [r for r in self.running if r.wants_step()]
            if rows:
                rows = self._reserve_or_preempt(rows)
                t = self._tick("reserve", t)
                if rows:
                    steered = self._decode(rows)
                    self.steps_since_admit += 1
                    t = perf_counter()
        if self.unread:
            # After a steered step the host leaves it unread: the next step's forward is
            # queued first, and this one is read while that forward runs.
            if not (steered and len(self.unread) < MAX_UNREAD):
                self._read(self.unread.popleft())
        elif alone and self.waiting and not self.running:
            # (rows that ended later in this step, read by a preemption, freed their blocks:
            # the next step admits)
            raise CacheFullError(
                f"prompt {self.waiting[0].index} cannot start: the pool has "
                f"{self.pool.allocator.num_free} of {self.pool.num_blocks} blocks free")

    # --- admission and prefill --------------------------------------------------------------

    def _admit(self) -> list[_Row]:
        """Take rows from the front of the queue while they fit (see the module docstring).
        With nothing running the first waiting row always fits: it fits the pool alone."""
        admitted: list[_Row] = []
        if self.running and self.waiting:
            free_slots = self.max_batch_size - len(self.running)
            group = min(len(self.waiting), max(1, self.max_batch_size // ADMIT_SHARE))
            full = min(len(self.waiting), max(1, self.max_batch_size // ADMIT_FULL_SHARE))
            if free_slots < group or (free_slots < full
                                      and self.steps_since_admit < ADMIT_WAIT_STEPS):
                return admitted
        alloc, bs = self.pool.allocator, self.pool.block_size
        free = alloc.num_free
        tokens = 0
        computing: set[bytes] = set()  # blocks this admission's rows will compute and name
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            row = self.waiting[0]
            prefill = row.prefill_tokens()
            hit: list[int] = []
            if self.prefix_caching and not row.seq.wants_prompt_logprobs:
                names = row.block_names(bs)[:max_cached_blocks(len(prefill), bs)]
                for name in names:
                    block = alloc.cached_block(name)
                    if block is None:
                        break
                    hit.append(block)
                rest = names[len(hit):]
                if admitted and rest and rest[0] in computing:
                    break  # an earlier row of this admission computes it: wait, then share
                computing.update(rest)
            n = len(prefill) - len(hit) * bs  # tokens to compute
            # Its prompt and the token its next decode step writes (none if it never decodes).
            held = min(len(prefill) + 1, row.peak_tokens())
            need = blocks_to_admit(alloc, hit, held, bs)
            headroom = len(self.running) + len(admitted)  # one block per row already in
            if need + headroom > free:
                break
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            if (slot := self.adapters.acquire(row.lora)) is None:
                break  # its adapter finds no device slot: it waits for rows to leave
            row.hit, row.lora_slot = hit, slot
            admitted.append(self.waiting.popleft())
            free -= need
            tokens += n
            row.forks = []
            while (self.waiting and self.waiting[0].fork_of is row and not row.seq.output_ids
                   and not self.waiting[0].seq.output_ids
                   and len(self.running) + len(admitted) < self.max_batch_size):
                # Another sample of this prompt: it shares the full prompt blocks and needs its
                # own for the rest of its prompt and its next token.
                fork_need = _blocks(len(prefill) + 1, bs) - len(prefill) // bs
                if fork_need + len(self.running) + len(admitted) > free:
                    break
                child = self.waiting.popleft()
                child.hit, child.lora_slot = [], self.adapters.acquire(child.lora)  # resident
                row.forks.append(child)
                admitted.append(child)
                free -= fork_need
        if admitted:
            self.steps_since_admit = 0
        return admitted

    def _prefill(self, admitted: list[_Row]) -> None:
        """Prefill the admitted rows packed; the samples forked from one of them take its
        table (`BlockTable.fork`) and sample their first tokens from its last logits."""
        self._complete()  # (and the row slots freed since are free on the device too)
        alloc = self.pool.allocator
        forked = {id(c) for r in admitted for c in r.forks}
        rows = [r for r in admitted if id(r) not in forked]
        full = [r.prefill_tokens() for r in rows]
        tables = [BlockTable(self.pool.block_size) for _ in rows]
        for r, table in zip(rows, tables):
            table.take_cached(r.hit, alloc)  # nothing when caching is off or it missed
            r.seq.num_cached_tokens = max(r.seq.num_cached_tokens, table.num_tokens)
        cached = [t.num_tokens for t in tables]
        tokens = [f[c:] for f, c in zip(full, cached)]
        writes = reserve_all_or_nothing(tables, [len(t) for t in tokens], alloc)
        for r, table in zip(rows, tables):
            r.table, r.slot, r.hit = table, self.free_slots.pop(), []
            r.sent_blocks = len(table.blocks)
        pairs = []
        samplers: list[_Row] = []
        sample_from: list[int] = []
        for i, r in enumerate(rows):
            if not r.seq.output_ids:  # new: it samples its first token here
                samplers.append(r)
                sample_from.append(i)
            for c in r.forks:
                c.table, pair = r.table.fork(alloc)
                c.slot, c.hit = self.free_slots.pop(), []
                c.sent_blocks = len(c.table.blocks)
                c.seq.num_cached_tokens = r.seq.num_cached_tokens
                pairs += [pair] if pair is not None else []
                samplers.append(c)
                sample_from.append(i)
        self.running += rows + [c for r in rows for c in r.forks]
        placed = rows + [c for r in rows for c in r.forks]
        self.runner.set_block_tables([r.slot for r in placed], [r.table.blocks for r in placed])
        self.runner.set_lora_slots([r.slot for r in placed], [r.lora_slot for r in placed])
        recomputed = [r for r in rows if r.seq.output_ids]
        if recomputed:
            self.runner.set_last_tokens([r.slot for r in recomputed],
                                        [r.seq.output_ids[-1] for r in recomputed])
        prompt = [i for i, r in enumerate(rows) if r.seq.wants_prompt_logprobs]
        images = self._prefill_images(rows, full, cached)
        sampling = (StepSampling.of([r.seq for r in samplers], [0] * len(samplers), self.words,
                                    fill=False)
                    if samplers else None)
        op = self.runner.prefill(
            tokens, list(chain.from_iterable(writes)), [r.slot for r in rows], sample_from,
            [r.slot for r in samplers], sampling, cached,
            [(i, rows[i].seq.params.prompt_logprobs) for i in prompt], images)
        self.pool.copy_blocks(pairs)  # queued after the prefill that wrote the sources
        if self.prefix_caching:  # queued after the prefill that writes them: safe to share
            for r in rows:
                r.table.register_full_blocks(r.name_tokens(), alloc,
                                             r.block_names(self.pool.block_size))
        for r in placed:
            r.launched = max(len(r.seq.output_ids), 1)
        n = sum(len(t) for t in tokens)
        self.stats.prefill_slots += n
        self.stats.prefill_real_tokens += n
        self.stats.cached_tokens += sum(cached)
        self.unread.append(_Op(op, samplers, sampling, [rows[i] for i in prompt]))

    def _prefill_images(self, rows: list[_Row], full: list[list[int]], cached: list[int]
                        ) -> PrefillImages | None:
        """A packed prefill's image inputs when one of `rows` has images, else None: every
        token's rotary positions, and the features of the image tokens past each row's
        cached blocks. The vision tower runs on the images of rows met for the first time,
        all in one call."""
        if all(r.images is None for r in rows):
            return None
        fresh = [r.images for r in rows if r.images is not None and r.images.embeds is None]
        fresh = list({id(x): x for x in fresh}.values())  # a prompt's samples share one
        if fresh:
            imgs = [img for x in fresh for img in x.images]
            dev = self.runner.device
            pixels = torch.from_numpy(np.concatenate([img.pixel_values for img in imgs]))
            feats = self.model.visual(pixels.to(dev, self.model.dtype),
                                      [img.grid_thw for img in imgs])  # [sum M, d]
            start = 0
            for x in fresh:
                x.embeds = feats[start:start + len(x.image_at)]
                start += len(x.image_at)
        positions: list[list[int]] = [[], [], []]
        index: list[int] = []
        parts = []
        offset = 0
        for r, f, c in zip(rows, full, cached):
            n = len(f) - c
            if r.images is None:
                for p in positions:
                    p.extend(range(c, c + n))
            else:
                for p, q in zip(positions, r.images.positions_of(c, len(f))):
                    p.extend(q)
                first = bisect_left(r.images.image_at, c)
                index += [offset + j - c for j in r.images.image_at[first:]]
                parts.append(r.images.embeds[first:])
            offset += n
        embeds = torch.cat(parts) if parts else None
        return PrefillImages(positions, index, embeds)

    # --- decode ------------------------------------------------------------------------------

    def _reserve_or_preempt(self, rows: list[_Row]) -> list[_Row]:
        """Reserve one slot for each of `rows` (all or none). When the pool is short, read
        everything queued (rows may finish and free blocks), then preempt the most recently
        admitted rows until the rest fit. Returns the rows that step."""
        alloc = self.pool.allocator
        if decode_demand([r.table for r in rows]) > alloc.num_free:
            while self.unread:
                self._read(self.unread.popleft())
            rows = [r for r in self.running if r.wants_step()]
            preempted: list[_Row] = []
            while rows and decode_demand([r.table for r in rows]) > alloc.num_free:
                victim = self.running.pop()  # the most recently admitted
                self._release(victim)
                victim.launched = 0
                preempted.append(victim)
                self.stats.preemptions += 1
                rows = [r for r in self.running if r.wants_step()]
            self.waiting.extendleft(preempted)  # popped newest first: order restored
        return rows

    def _decode(self, rows: list[_Row]) -> bool:
        """Queue one decode step of `rows`; True when a structured output steered it."""
        t0 = perf_counter()
        if ORDER_LONGEST_FIRST:
            rows = sorted(rows, key=lambda r: -r.table.num_tokens)
        positions = [r.table.num_tokens for r in rows]
        writes = reserve_one_each([r.table for r in rows], self.pool.allocator)
        new_blocks = []
        for r in rows:
            if len(r.table.blocks) > r.sent_blocks:
                new_blocks += [(r.slot, j, r.table.blocks[j])
                               for j in range(r.sent_blocks, len(r.table.blocks))]
                r.sent_blocks = len(r.table.blocks)
        counters = [r.launched for r in rows]
        constrained = any(r.seq.constrained for r in rows)
        sampling = None
        if not constrained and not all(r.seq.params.greedy and r.seq.logprobs is None
                                       for r in rows):
            sampling = StepSampling.of([r.seq for r in rows], counters)
        if self.runner.profile:
            self.runner.host_s["steps"] = self.runner.host_s.get("steps", 0) + 1
        t = self._tick("decode_prep", t0)
        deltas = None
        if any(r.images is not None for r in rows):
            deltas = [r.rope_delta for r in rows]
        op = self.runner.decode([r.slot for r in rows], positions, writes, new_blocks,
                                sampling, defer=constrained, before=self._complete,
                                rope_deltas=deltas)
        t = self._tick("decode_launch", t)
        if constrained:  # the masks need every earlier token: read while the forward runs
            while len(self.unread) > 1:
                self._read(self.unread.popleft())
            # The last one's matchers advance first; its stop rules run while the masks fill
            # (a row they end is masked for nothing: its token is dropped).
            last = self.unread.popleft() if self.unread else None
            taken = self._take(last) if last is not None else None
            t = perf_counter()
            sampling = StepSampling.of([r.seq for r in rows], counters, self.words, fill=False)
            t = self._tick("sampling_of", t)
            self.runner.begin_sampling(op, sampling)  # queued by `_complete`
            self._tick("sample_launch", t)
        for r in rows:
            r.launched += 1
        self.stats.decode_row_steps += len(rows)
        self.stats.decode_steps += 1
        self.unread.append(_Op(op, rows, sampling))
        if constrained:
            self._pending = self.unread[-1]  # (before anything can raise: `abort` waits for it)
            if last is not None:
                self._apply(last, taken)
        return constrained

    # --- results -----------------------------------------------------------------------------

    def _read(self, op: _Op) -> None:
        self._apply(op, self._take(op))

    def _take(self, op: _Op) -> tuple:
        """The first half of reading an operation: its tokens (waiting for it), logprobs and
        prompt logprobs, and its steered rows' matchers advanced by their tokens. Returns
        what `_apply` needs: (tokens, logprob rows by row, live rows (index, sequence),
        accepted by row). Every older operation must have been applied."""
        self._complete()
        t = perf_counter()
        tokens = self.runner.read(op.launched)
        t = self._tick("read", t)
        lps = {}
        if op.sampling is not None and op.launched.logprobs is not None:
            values = op.launched.logprobs.numpy().copy()  # the ring's buffer is reused
            lps = dict(zip(op.sampling.logprob_rows, values))
        self._set_prompt_logprobs(op)  # a prefill's rows that asked for them
        live = [(j, r.seq) for j, r in enumerate(op.rows)
                if r.seq.finish_reason is None and r.table is not None]
        self.stats.finished_row_steps += len(op.rows) - len(live)
        accepted = {}
        if op.sampling is not None and op.sampling.masked:  # (else no row is steered)
            steered = [j for j, seq in live if seq.constrained and tokens[j] >= 0]
            accepted = dict(zip(steered, accept_tokens([op.rows[j].seq.matcher for j in steered],
                                                       [tokens[j] for j in steered])))
        self._tick("accept", t)
        return tokens, lps, live, accepted

    def _apply(self, op: _Op, taken: tuple) -> None:
        """The second half: the stop rules on each live row's token, and rows that finished
        leave (their blocks and row slot go back)."""
        t = perf_counter()
        tokens, lps, live, accepted = taken
        for j, seq in live:
            seq.append(tokens[j], lps.get(j), accepted.get(j))
        t = self._tick("append", t)
        finished = [r for r in self.running if r.seq.finished]
        if finished:
            self.running = [r for r in self.running if not r.seq.finished]
            for r in finished:
                self._release(r)
                self._finish(r)
        self._tick("finish", t)

    def _set_prompt_logprobs(self, op: _Op) -> None:
        for r, (_, host) in zip(op.prompt, op.launched.prompt):
            values = entries(host.numpy(), r.seq.prompt_ids[1:], r.seq.params.prompt_logprobs)
            for s in [r] + [c for c in r.forks]:
                if s.seq.prompt_logprobs is None:
                    s.seq.prompt_logprobs = values

    def _release(self, r: _Row) -> None:
        if r.lora_slot is not None:
            self.adapters.release(r.lora)
            r.lora_slot = None
        if r.table is not None:
            r.table.free(self.pool.allocator)
            r.table = None
        if r.slot is not None:
            self.free_slots.append(r.slot)
            r.slot = None

    def _finish(self, r: _Row) -> None:
        g = r.group
        g.outputs[r.index] = r.seq.output()
        g.left -= 1
        if g.left == 0 and g.on_done is not None:
            g.on_done(g.outputs)


@torch.inference_mode()
def generate_continuous(model: LlamaForCausalLM, prompts: list[list[int]],
                        params: list[SamplingParams], eos_token_ids: tuple[int, ...] = (),
                        pool: KVPool | None = None, tokenizer=None, max_batch_size: int = 256,
                        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                        runner: ContinuousRunner | None = None, step_mode: str = "eager",
                        prefix_caching: bool = True, grammars=None,
                        lora: list[str | None] | None = None,
                        ) -> tuple[list[SequenceOutput], BatchStats]:
    """Generate every prompt with continuous batching; see the module docstring. `runner`:
    an engine's own (graphs captured once), else one made for this call in `step_mode`;
    lora: each prompt's adapter (the runner's `adapters`; None: the base model).
    Raises CacheFullError, having changed nothing, when a row could not fit the pool even
    alone (its prompt and its new tokens but the last, which is never written), or when
    the next row cannot start because blocks it needs are held outside this call."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    if not prompts:
        return [], BatchStats()
    if pool is None:
        pool = pool_for(model, [p for p, sp in zip(prompts, params) for _ in range(sp.n)],
                        max(p.max_tokens for p in params))
    if runner is None:
        runner = ContinuousRunner(model, pool, min(max_batch_size, sum(p.n for p in params)),
                                  step_mode)
    sched = ContinuousScheduler(model, pool, runner, eos_token_ids, tokenizer, max_batch_size,
                                max_prefill_tokens, prefix_caching, grammars)
    group = sched.add(prompts, params, lora=lora)
    sched.run()
    return list(group.outputs), sched.stats


__all__ = ["DEFAULT_MAX_PREFILL_TOKENS", "ContinuousScheduler", "generate_continuous"]
