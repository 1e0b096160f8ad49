"""Generation loops: dense, paged, and static batched.

Static batching (`generate_batch`): one padded prefill over the rectangle of prompts
(right-padded: row i's real tokens are columns 0..len_i-1), then one token per row
per step, each row at its own absolute position, until every row has finished.
A finished row keeps its query, its slot and its blocks until the slowest row is
done: that is the waste `BatchStats` counts and continuous batching removes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.attention import AttentionMetadata
from nanoserve.block_manager import reserve_all_or_nothing
from nanoserve.cache import BatchedPagedKVCache, CacheShape, DenseKVCache, KVPool
from nanoserve.cuda_graph import DecodeStep, graphs_wanted, make_decode_step
from nanoserve.errors import CacheFullError
from nanoserve.model import LlamaForCausalLM
from nanoserve.prefix_cache import lookup
from nanoserve.sampling import SamplingParams, sample_next
from nanoserve.sequence import Sequence, SequenceOutput


@dataclass
class BatchStats:
    """Where a static batch spent slots and steps on nothing."""

    num_rows: int = 0
    prefill_slots: int = 0  # rows x longest prompt: the padded rectangle
    prefill_real_tokens: int = 0  # what the rows actually hold
    decode_row_steps: int = 0  # rows x decode steps
    finished_row_steps: int = 0  # of those, steps run for rows that had already finished
    preemptions: int = 0  # rows sent back to the queue for room (continuous batching only)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not prefilled

    @property
    def padding_waste(self) -> float:
        return 1 - self.prefill_real_tokens / self.prefill_slots if self.prefill_slots else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens."""
        total = self.cached_tokens + self.prefill_real_tokens
        return self.cached_tokens / total if total else 0.0

    @property
    def early_finish_waste(self) -> float:
        return self.finished_row_steps / self.decode_row_steps if self.decode_row_steps else 0.0

    def add(self, other: BatchStats) -> None:
        for f in ("num_rows", "prefill_slots", "prefill_real_tokens", "decode_row_steps",
                  "finished_row_steps", "preemptions", "cached_tokens"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


DECODE_STEP_MODES = ("auto", "eager", "static", "graph")


def _greedy_params(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_new_tokens, temperature=0.0)


@torch.inference_mode()
def greedy_generate(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """One sequence through a dense cache: the oracle for the paged paths."""
    seq = Sequence(prompt_ids, _greedy_params(max_new_tokens), eos_token_ids,
                   model.config.max_position_embeddings)
    cache = DenseKVCache(CacheShape.of(model.config), len(prompt_ids) + max_new_tokens,
                         dtype=model.dtype, device=model.device)
    ids = torch.tensor([prompt_ids], device=model.device)
    positions = torch.arange(len(prompt_ids), device=model.device)[None]
    while True:
        logits = model(ids, positions, cache, AttentionMetadata.prefill())[:, -1]
        seq.append(int(torch.argmax(logits, dim=-1)))
        if seq.finished:
            return seq.output_ids
        ids = torch.tensor([[seq.output_ids[-1]]], device=model.device)
        positions = torch.tensor([[seq.num_tokens - 1]], device=model.device)


@torch.inference_mode()
def greedy_generate_paged(model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int,
                          eos_token_ids: tuple[int, ...] = (), pool: KVPool | None = None) -> list[int]:
    """One sequence through the paged cache (a batch of one)."""
    return greedy_generate_batch(model, [prompt_ids], max_new_tokens, eos_token_ids, pool)[0]


@torch.inference_mode()
def greedy_generate_batch(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                          eos_token_ids: tuple[int, ...] = (), pool: KVPool | None = None) -> list[list[int]]:
    params = [_greedy_params(max_new_tokens)] * len(prompts)
    outs, _ = generate_batch(model, prompts, params, eos_token_ids, pool)
    return [o.token_ids for o in outs]


def pool_for(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
             block_size: int = 16) -> KVPool:
    """A pool just big enough for this static batch (tests and one-off calls)."""
    need = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts)
    return KVPool(CacheShape.of(model.config), need, block_size, model.dtype, model.device)


def blocks_for_batch(prompt_lens: list[int], max_steps: int, block_size: int) -> int:
    """Blocks a static batch holds at its peak: every row writes its prompt and then one
    token per decode step (max_steps - 1 of them), finished or not."""
    return sum(-(-(n + max_steps - 1) // block_size) for n in prompt_lens)


def right_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """A padded prefill's inputs, on the CPU: ids [B, T] int64 (row i's tokens in columns
    0..len_i-1, zeros after), positions [B, T], valid [B, T] bool (the real columns) and
    lens [B]; T is the longest prompt."""
    lens = torch.tensor([len(p) for p in prompts])
    B, T = len(prompts), int(lens.max())
    ids = torch.zeros(B, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    valid = torch.arange(T)[None] < lens[:, None]
    positions = torch.arange(T).expand(B, T)
    return ids, positions, valid, lens


@torch.inference_mode()
def generate_batch(model: LlamaForCausalLM, prompts: list[list[int]], params: list[SamplingParams],
                   eos_token_ids: tuple[int, ...] = (), pool: KVPool | None = None,
                   tokenizer=None, decode_step: str = "auto", prefix_caching: bool = False,
                   ) -> tuple[list[SequenceOutput], BatchStats]:
    """Static batched generation with per-row sampling. Raises CacheFullError, having
    changed nothing, when the batch cannot fit the pool at its peak.

    prefix_caching: rows start from the longest cached run of their prompt's full blocks
    (blocks an earlier batch on this pool named and freed, or still holds); when any row
    hits, the batch's prefill is packed and attends to the cached context through the
    paged prefill kernel, else it is the padded rectangle. Either way the batch names its
    full prompt blocks for later batches.

    decode_step: how decode steps run (the tokens are the same): "eager" launches each
    kernel from Python with per-step tensors; "graph" replays a CUDA graph captured once
    per batch (nanoserve/cuda_graph.py); "static" is the graph's bookkeeping without the
    capture (any device; for tests); "auto" is "graph" where `graphs_wanted` says so,
    else "eager"."""
    if decode_step not in DECODE_STEP_MODES:
        raise ValueError(f"decode_step must be one of {DECODE_STEP_MODES}, got {decode_step!r}")
    config, device = model.config, model.device
    seqs = [Sequence(p, sp, eos_token_ids, config.max_position_embeddings, tokenizer)
            for p, sp in zip(prompts, params)]
    max_steps = max(s.max_new for s in seqs)
    if pool is None:
        pool = pool_for(model, prompts, max_steps)
    lens = [len(p) for p in prompts]
    need = blocks_for_batch(lens, max_steps, pool.block_size)
    if need > pool.allocator.num_free:
        raise CacheFullError(f"batch needs {need} KV blocks at its peak, pool has {pool.allocator.num_free} free")
    ids, positions, valid, lens_t = right_padded(prompts)
    B, T = ids.shape
    stats = BatchStats(num_rows=B, prefill_slots=B * T, prefill_real_tokens=sum(lens))
    cache = BatchedPagedKVCache(pool, B)
    alloc = pool.allocator
    hits = [lookup(alloc, p, pool.block_size) for p in prompts] if prefix_caching else []
    step = None
    try:
        if any(hits):
            last = _prefill_after_cached(model, cache, prompts, hits, seqs, stats)
        else:
            hidden = model.hidden_states(ids.to(device), positions.to(device), cache,
                                         AttentionMetadata.prefill(valid.to(device)))
            last = hidden[torch.arange(B, device=device), (lens_t - 1).to(device)]  # [B, d]
        if prefix_caching:  # queued after the prefill that writes them: safe to share
            for table, prompt in zip(cache.tables, prompts):
                table.register_full_blocks(prompt, alloc)
        _append(seqs, model.compute_logits(last))
        if decode_step == "auto":
            decode_step = "graph" if graphs_wanted(device, max_steps - 1) else "eager"
        if not all(s.finished for s in seqs):
            peak_blocks = max(-(-(n + max_steps - 1) // pool.block_size) for n in lens)
            feedback = all(s.params.greedy for s in seqs)
            step = make_decode_step(model, cache, peak_blocks, decode_step, feedback)
        if step is not None and step.feedback:
            _decode_pipelined(step, seqs, stats, max_steps - 1)
        while not all(s.finished for s in seqs):
            stats.decode_row_steps += B
            stats.finished_row_steps += sum(s.finished for s in seqs)
            if step is not None:
                _append(seqs, step([s.output_ids[-1] for s in seqs]))
                continue
            step_ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=device)
            step_pos = torch.tensor([[n] for n in cache.seq_lens], device=device)
            hidden = model.hidden_states(step_ids, step_pos, cache, AttentionMetadata.decode())
            _append(seqs, model.compute_logits(hidden[:, 0]))
    finally:
        if step is not None:
            step.close()  # nothing queued may still write into blocks freed below
        del step  # a captured graph's memory goes back to the allocator with it
        cache.free_all()
    return [s.output() for s in seqs], stats


def _prefill_after_cached(model: LlamaForCausalLM, cache: BatchedPagedKVCache,
                          prompts: list[list[int]], hits: list[list[int]],
                          seqs: list[Sequence], stats: BatchStats) -> torch.Tensor:
    """The static batch's prefill when some rows start from cached blocks: every row takes
    its hit, the rest of each prompt is prefilled packed (no padding) over the row's whole
    context. Returns each row's last hidden state [B, d]."""
    from nanoserve.step_cache import StepCache

    device, alloc = model.device, cache.pool.allocator
    for table, hit in zip(cache.tables, hits):
        table.take_cached(hit, alloc)
    cached = [t.num_tokens for t in cache.tables]
    new = [p[c:] for p, c in zip(prompts, cached)]  # never empty: a hit leaves the last token
    writes = reserve_all_or_nothing(cache.tables, [len(n) for n in new], alloc)
    cache.mirror_block_tables()
    cu = [0]
    for n in new:
        cu.append(cu[-1] + len(n))
    ids = torch.tensor([[t for n in new for t in n]], device=device)  # [1, N]
    pos = torch.tensor([[c + j for c, n in zip(cached, new) for j in range(len(n))]],
                       device=device)
    step_cache = StepCache(
        cache.pool, torch.tensor([s for w in writes for s in w], device=device),
        cache.block_table_tensor(),
        torch.tensor([c + len(n) for c, n in zip(cached, new)], dtype=torch.int32,
                     device=device))
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    hidden = model.hidden_states(ids, pos, step_cache,
                                 AttentionMetadata.packed(cu_t, max(len(n) for n in new)))
    for seq, c in zip(seqs, cached):
        seq.num_cached_tokens = c
    stats.prefill_slots = stats.prefill_real_tokens = cu[-1]
    stats.cached_tokens = sum(cached)
    return hidden[0, cu_t[1:].long() - 1]  # [B, d]


def _decode_pipelined(step: DecodeStep, seqs: list[Sequence], stats: BatchStats,
                      max_decode_steps: int) -> None:
    """Decode an all-greedy batch with step t+1 queued before step t's tokens are read
    (DecodeStep feedback). The tokens, finish reasons and stats equal the plain loop's; at
    most one step more runs on the device after the last row finishes (never more than
    `max_decode_steps` in all, so the batch's peak blocks still bound it)."""
    B = len(seqs)
    step.start([s.output_ids[-1] for s in seqs])
    step.launch()
    launched = 1
    while True:
        if launched < max_decode_steps and not all(s.finished for s in seqs):
            step.launch()
            launched += 1
        if step.unread == 0:
            return  # every step read: the rows have finished (max_decode_steps bounds them)
        tokens = step.read_tokens()
        stats.decode_row_steps += B
        stats.finished_row_steps += sum(s.finished for s in seqs)
        for s, t in zip(seqs, tokens):
            if not s.finished:
                s.append(t)
        if all(s.finished for s in seqs):
            return


def _append(seqs: list[Sequence], logits: torch.Tensor) -> None:
    """Sample one token for every unfinished row. logits: [B, V]."""
    live = [i for i, s in enumerate(seqs) if not s.finished]
    tokens = sample_next(logits[live], [seqs[i].params for i in live],
                         [seqs[i].key for i in live],
                         [len(seqs[i].output_ids) for i in live]).tolist()
    for i, t in zip(live, tokens):
        seqs[i].append(t)
