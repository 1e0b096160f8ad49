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

from nanoserve.cache.block_manager import BlockTable, reserve_all_or_nothing
from nanoserve.cache.pool import BatchedPagedKVCache, CacheShape, DenseKVCache, KVPool
from nanoserve.cache.prefix_cache import lookup
from nanoserve.errors import CacheFullError
from nanoserve.model.attention import AttentionMetadata
from nanoserve.model.model import LlamaForCausalLM
from nanoserve.sampling.logprobs import entries, prompt_logprob_rows
from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.sequence import Sequence, SequenceOutput, samples_of
from nanoserve.sampling.step_sampling import StepSampling, sample_step
from nanoserve.sampling.structured import accept_tokens
from nanoserve.static.cuda_graph import DecodeStep, graphs_wanted, make_decode_step


@dataclass
class BatchStats:
    """Where a static batch spent slots and steps on nothing."""

    num_rows: int = 0
    prefill_slots: int = 0  # rows x longest prompt: the padded rectangle
    prefill_real_tokens: int = 0  # what the rows actually hold
    decode_row_steps: int = 0  # rows x decode steps
    decode_steps: int = 0  # decode steps: decode_row_steps / decode_steps = rows a step
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
                  "decode_steps", "finished_row_steps", "preemptions", "cached_tokens"):
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
                   grammars=None) -> tuple[list[SequenceOutput], BatchStats]:
    """Static batched generation with per-row sampling. Raises CacheFullError, having
    changed nothing, when the batch cannot fit the pool at its peak. Returns one output per
    sample: a prompt's `n` samples consecutively, in prompt order.

    prefix_caching: rows start from the longest cached run of their prompt's full blocks
    (blocks an earlier batch on this pool named and freed, or still holds); when any row
    hits, the batch's prefill is packed and attends to the cached context through the
    paged prefill kernel, else it is the padded rectangle. Either way the batch names its
    full prompt blocks for later batches. A row that asks for prompt logprobs prefills its
    whole prompt (its logits are needed at every position).

    n samples: the prompt is prefilled once; samples 1..n-1 then share its full blocks and
    copy its last, partly filled one (`BlockTable.fork`), and every sample draws its first
    token from the prompt's last logits with its own key.

    grammars: the engine's `GrammarCache`, needed by rows with structured outputs.

    decode_step: how decode steps run (the tokens are the same): "eager" launches each
    kernel from Python with per-step tensors; "graph" replays a CUDA graph captured once
    per batch (nanoserve/static/cuda_graph.py); "static" is the graph's bookkeeping without the
    capture (any device; for tests); "auto" is "graph" where `graphs_wanted` says so,
    else "eager"."""
    if decode_step not in DECODE_STEP_MODES:
        raise ValueError(f"decode_step must be one of {DECODE_STEP_MODES}, got {decode_step!r}")
    config, device = model.config, model.device
    groups = [samples_of(p, sp, eos_token_ids, config.max_position_embeddings, tokenizer,
                         grammars) for p, sp in zip(prompts, params)]
    seqs = [s for g in groups for s in g]
    parent_of = [i for i, g in enumerate(groups) for _ in g]  # the prompt each sample shares
    max_steps = max(s.max_new for s in seqs)
    if pool is None:
        pool = pool_for(model, [p for p, g in zip(prompts, groups) for _ in g], max_steps)
    lens = [len(p) for p in prompts]
    need = blocks_for_batch([n for n, g in zip(lens, groups) for _ in g], max_steps,
                            pool.block_size)
    if need > pool.allocator.num_free:
        raise CacheFullError(f"batch needs {need} KV blocks at its peak, pool has {pool.allocator.num_free} free")
    ids, positions, valid, lens_t = right_padded(prompts)
    P, T = ids.shape
    B = len(seqs)
    stats = BatchStats(num_rows=B, prefill_slots=P * T, prefill_real_tokens=sum(lens))
    cache = BatchedPagedKVCache(pool, P)  # the prompts' tables; the forks join after
    tables = list(cache.tables)  # every table this batch holds, freed at the end
    alloc = pool.allocator
    hits = [[] if g[0].wants_prompt_logprobs else lookup(alloc, p, pool.block_size)
            for p, g in zip(prompts, groups)] if prefix_caching else []
    step = None
    try:
        if any(hits):
            last = _prefill_after_cached(model, cache, prompts, hits, groups, stats)
        else:
            hidden = model.hidden_states(ids.to(device), positions.to(device), cache,
                                         AttentionMetadata.prefill(valid.to(device)))
            last = hidden[torch.arange(P, device=device), (lens_t - 1).to(device)]  # [P, d]
            _prompt_logprobs(model, groups, [hidden[i, :n - 1] for i, n in enumerate(lens)],
                             prompts)
        if prefix_caching:  # queued after the prefill that writes them: safe to share
            for table, prompt in zip(cache.tables, prompts):
                table.register_full_blocks(prompt, alloc)
        if B > P:
            cache = _fork_samples(pool, cache, groups, tables)
        _append(seqs, model.compute_logits(last.index_select(
            0, torch.tensor(parent_of, device=device))), _words(grammars))
        if decode_step == "auto":
            decode_step = "graph" if graphs_wanted(device, max_steps - 1) else "eager"
        if not all(s.finished for s in seqs):
            peak_blocks = max(-(-(n + max_steps - 1) // pool.block_size) for n in lens)
            feedback = all(s.params.greedy and s.matcher is None and s.logprobs is None
                           for s in seqs)
            step = make_decode_step(model, cache, peak_blocks, decode_step, feedback)
        if step is not None and step.feedback:
            _decode_pipelined(step, seqs, stats, max_steps - 1)
        while not all(s.finished for s in seqs):
            stats.decode_row_steps += B
            stats.decode_steps += 1
            stats.finished_row_steps += sum(s.finished for s in seqs)
            if step is not None:
                _append(seqs, step([_last(s) for s in seqs]), _words(grammars))
                continue
            step_ids = torch.tensor([[_last(s)] for s in seqs], device=device)
            step_pos = torch.tensor([[n] for n in cache.seq_lens], device=device)
            hidden = model.hidden_states(step_ids, step_pos, cache, AttentionMetadata.decode())
            _append(seqs, model.compute_logits(hidden[:, 0]), _words(grammars))
    finally:
        if step is not None:
            step.close()  # nothing queued may still write into blocks freed below
        del step  # a captured graph's memory goes back to the allocator with it
        cache.free_all()
        for t in tables:  # tables the batch's cache did not hold yet (a failure mid-fork)
            if t.blocks:
                t.free(alloc)
    return [s.output() for s in seqs], stats


def _words(grammars) -> int:
    return grammars.words if grammars is not None else 0


def _fork_samples(pool: KVPool, cache: BatchedPagedKVCache, groups: list[list[Sequence]],
                  tables: list[BlockTable]) -> BatchedPagedKVCache:
    """After the prompts' prefill: a table per sample, samples 1..n-1 forked from their
    prompt's table; returns the batch's cache over every sample's table, in order."""
    pairs = []
    rows = []
    for table, group in zip(cache.tables, groups):
        rows.append(table)
        for _ in group[1:]:
            child, pair = table.fork(pool.allocator)
            tables.append(child)
            rows.append(child)
            if pair is not None:
                pairs.append(pair)
    pool.copy_blocks(pairs)  # queued after the prefill that wrote the source blocks
    return BatchedPagedKVCache.over(pool, rows)


def _prompt_logprobs(model: LlamaForCausalLM, groups: list[list[Sequence]],
                     hidden: list[torch.Tensor], prompts: list[list[int]]) -> None:
    """Set the prompt logprobs of the rows that ask (every sample of the row gets them).
    hidden[i]: row i's hidden states at its prompt positions 0..len-2."""
    asking = [i for i, g in enumerate(groups) if g[0].wants_prompt_logprobs]
    if not asking:
        return
    device = model.device
    computed = []
    for i in asking:
        k = groups[i][0].params.prompt_logprobs
        targets = torch.tensor(prompts[i][1:], device=device)
        computed.append(prompt_logprob_rows(model.compute_logits, hidden[i], targets, k))
    for i, rows in zip(asking, computed):
        values = entries(rows.cpu().numpy(), prompts[i][1:], groups[i][0].params.prompt_logprobs)
        for s in groups[i]:
            s.prompt_logprobs = values


def _prefill_after_cached(model: LlamaForCausalLM, cache: BatchedPagedKVCache,
                          prompts: list[list[int]], hits: list[list[int]],
                          groups: list[list[Sequence]], stats: BatchStats) -> torch.Tensor:
    """The static batch's prefill when some rows start from cached blocks: every row takes
    its hit, the rest of each prompt is prefilled packed (no padding) over the row's whole
    context. Returns each row's last hidden state [B, d]."""
    from nanoserve.cache.step_cache import StepCache

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
    for group, c in zip(groups, cached):
        for seq in group:
            seq.num_cached_tokens = c
    stats.prefill_slots = stats.prefill_real_tokens = cu[-1]
    stats.cached_tokens = sum(cached)
    # A row asking for prompt logprobs took no hit: its new tokens are its whole prompt.
    _prompt_logprobs(model, groups, [hidden[0, a:b - 1] for a, b in zip(cu, cu[1:])], prompts)
    return hidden[0, cu_t[1:].long() - 1]  # [P, d]


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
        stats.decode_steps += 1
        stats.finished_row_steps += sum(s.finished for s in seqs)
        for s, t in zip(seqs, tokens):
            if not s.finished:
                s.append(t)
        if all(s.finished for s in seqs):
            return


def _last(seq: Sequence) -> int:
    """A row's input to the next static step (a row that ended before its first token, its
    grammar allowing none, still steps with the rest: its prompt's last token)."""
    return seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]


def _append(seqs: list[Sequence], logits: torch.Tensor, words: int = 0) -> None:
    """Sample one token for every unfinished row (`nanoserve.sampling.step_sampling`). logits: [B, V]."""
    live = [i for i, s in enumerate(seqs) if not s.finished]
    rows = [seqs[i] for i in live]
    sampling = StepSampling.of(rows, [len(s.output_ids) for s in rows], words)
    tokens, lp = sample_step(logits[live], sampling)
    tokens = tokens.tolist()
    lps = dict(zip(sampling.logprob_rows, lp.cpu().numpy())) if lp is not None else {}
    steered = [j for j, s in enumerate(rows) if s.constrained and tokens[j] >= 0]
    accepted = dict(zip(steered, accept_tokens([rows[j].matcher for j in steered],
                                               [tokens[j] for j in steered]))) if steered else {}
    for j, (s, t) in enumerate(zip(rows, tokens)):
        if not s.finished:  # a grammar that allowed nothing ended it while masking
            s.append(t, lps.get(j), accepted.get(j))
