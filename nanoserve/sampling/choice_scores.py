"""Label scores: one probability per label of a choice list, from forward passes over the
labels, not from sampling.

For a prompt P and labels L_1..L_m (each encoded on its own, without special tokens), the
score of L_j is  s_j = sum_t log p(L_j[t] | P + L_j[:t])  (the model's log-probability of
the label's whole token sequence after the prompt), and the labels' probabilities are
softmax(s) over the m labels.

How (`label_logprobs`, what `LLM.choice_scores` runs): the prompts are prefilled once each,
packed; the prompt's last logits give every label's first token; a label of m > 1 tokens
then runs its first m - 1 tokens as a packed paged prefill over a fork of its prompt's
blocks (full blocks shared, the partly filled last one copied), whose logits give its
tokens 2..m. So a row of single-token labels costs one prefill of its prompt, and a
multi-token label adds only its own tokens. The blocks are freed at the end of each group.

Invariants:
- exact for multi-token labels and for labels that share a prefix: each label's tokens are
  scored at their own positions after the prompt and the label's earlier tokens (nothing is
  approximated from the first token);
- the numbers are the engine's own forward (the same model, pool and attention kernels);
- an empty label list, an empty label, or two labels with the same text are a ValueError
  with a one-line message, raised before any forward pass.

"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nanoserve.sampling.structured import check_labels


def label_token_ids(tokenizer: Any, labels: Sequence[str]) -> list[list[int]]:
    """Each label's token ids, encoded alone without special tokens (checked labels)."""
    return [list(tokenizer.encode(label, add_special_tokens=False))
            for label in check_labels(labels)]


def normalise(scores: Sequence[float]) -> list[float]:
    """softmax over summed log-probabilities (max-shifted, so no underflow)."""
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [w / total for w in weights]


def choice_scores(llm: Any, prompts: Sequence[Sequence[int]], labels: Sequence[str]
                  ) -> list[dict[str, float]]:
    """One {label: probability} per prompt (token ids), over `labels`, from `llm`'s engine
    (`nanoserve.llm.LLM`) through `label_logprobs`."""
    label_ids = label_token_ids(llm.tokenizer, labels)
    for p in prompts:
        check_fits(p, label_ids, llm.max_context)
    sums = label_logprobs(llm.model, llm.pool, prompts, [label_ids] * len(prompts))
    return [dict(zip(labels, normalise(s))) for s in sums]


def check_fits(prompt: Sequence[int], label_ids: Sequence[Sequence[int]],
               max_context: int) -> None:
    """ValueError when prompt + its longest label does not fit the model's context."""
    longest = len(prompt) + max((len(ids) for ids in label_ids), default=0)
    if longest + 1 > max_context:
        raise ValueError(f"prompt and label take {longest} tokens; the model's context "
                         f"is {max_context}")


def _blocks(n: int, bs: int) -> int:
    return -(-n // bs)


def label_logprobs(model: Any, pool: Any, prompts: Sequence[Sequence[int]],
                   labels: Sequence[Sequence[Sequence[int]]],
                   max_batch_tokens: int = 8192) -> list[list[float]]:
    """Per prompt, each of its labels' summed log-probability (labels[i]: prompt i's labels'
    token ids, each non-empty) after the prompt: prompts grouped while their tokens (prompt
    and labels' forwarded tokens) stay within `max_batch_tokens` and their blocks fit the
    pool's free blocks. CacheFullError when one prompt's group does not fit alone."""
    import torch

    from nanoserve.errors import CacheFullError

    bs, alloc = pool.block_size, pool.allocator
    out: list[list[float]] = []
    i = 0
    with torch.inference_mode():
        while i < len(prompts):
            j, tokens, blocks = i, 0, 0
            while j < len(prompts):
                n = len(prompts[j])
                more = [len(ids) - 1 for ids in labels[j] if len(ids) > 1]
                need = _blocks(n, bs) + sum(_blocks(n + m, bs) - n // bs for m in more)
                if j > i and (tokens + n + sum(more) > max_batch_tokens
                              or blocks + need > alloc.num_free):
                    break
                tokens, blocks, j = tokens + n + sum(more), blocks + need, j + 1
            if blocks > alloc.num_free:
                raise CacheFullError(f"scoring prompt {i} ({len(prompts[i])} tokens) and its "
                                     f"labels needs {blocks} KV blocks; the pool has "
                                     f"{alloc.num_free} free")
            out += _score_group(model, pool, prompts[i:j], labels[i:j])
            i = j
    return out


def _packed_prefill(model: Any, pool: Any, tables: list, cached: list[int],
                    new: list[list[int]]) -> Any:
    """Prefill `new[b]` after the `cached[b]` tokens table b already holds, packed, over
    each row's whole context; the hidden states [N, d] of the new tokens, back to back."""
    import torch

    from nanoserve.cache.block_manager import reserve_all_or_nothing
    from nanoserve.cache.pool import BatchedPagedKVCache
    from nanoserve.cache.step_cache import StepCache
    from nanoserve.model.attention import AttentionMetadata

    device = model.device
    writes = reserve_all_or_nothing(tables, [len(t) for t in new], pool.allocator)
    view = BatchedPagedKVCache.over(pool, tables)
    cu = [0]
    for t in new:
        cu.append(cu[-1] + len(t))
    ids = torch.tensor([[t for row in new for t in row]], device=device)
    pos = torch.tensor([[c + k for c, row in zip(cached, new) for k in range(len(row))]],
                       device=device)
    step = StepCache(pool, torch.tensor([s for w in writes for s in w], device=device),
                     view.block_table_tensor(),
                     torch.tensor([c + len(row) for c, row in zip(cached, new)],
                                  dtype=torch.int32, device=device))
    meta = AttentionMetadata.packed(torch.tensor(cu, dtype=torch.int32, device=device),
                                    max(len(row) for row in new))
    return model.hidden_states(ids, pos, step, meta)[0], cu


def _score_group(model: Any, pool: Any, prompts: Sequence[Sequence[int]],
                 labels: Sequence[Sequence[Sequence[int]]]) -> list[list[float]]:
    import torch

    from nanoserve.cache.block_manager import BlockTable
    from nanoserve.sampling.logprobs import logprob_rows

    device, alloc = model.device, pool.allocator
    tables = [BlockTable(pool.block_size) for _ in prompts]
    forks: list = []
    try:
        hidden, cu = _packed_prefill(model, pool, tables, [0] * len(prompts),
                                     [list(p) for p in prompts])
        last = hidden[torch.tensor(cu[1:], device=device) - 1]  # [P, d]
        owner = [i for i, labs in enumerate(labels) for _ in labs]
        first = [ids[0] for labs in labels for ids in labs]
        logits = model.compute_logits(last).float()  # [P, V]: once per prompt
        own = torch.tensor(owner, device=device)
        sums = (logits[own, torch.tensor(first, device=device)]
                - torch.logsumexp(logits, dim=-1).index_select(0, own))  # [L]
        at, pairs, cached, new, rest_of = 0, [], [], [], []
        for i, labs in enumerate(labels):
            for ids in labs:
                if len(ids) > 1:
                    child, pair = tables[i].fork(alloc)
                    forks.append(child)
                    pairs += [pair] if pair is not None else []
                    cached.append(len(prompts[i]))
                    new.append(list(ids[:-1]))
                    rest_of += [at] * (len(ids) - 1)
                at += 1
        if forks:
            pool.copy_blocks(pairs)
            hidden, _ = _packed_prefill(model, pool, forks, cached, new)
            targets = [t for labs in labels for ids in labs if len(ids) > 1 for t in ids[1:]]
            lp = logprob_rows(model.compute_logits(hidden),
                              torch.tensor(targets, device=device), 0)[:, 0]
            sums = sums.index_add(0, torch.tensor(rest_of, device=device), lp)
        flat = sums.double().cpu().tolist()
    finally:
        for t in tables + forks:
            t.free(alloc)
    out, at = [], 0
    for labs in labels:
        out.append(flat[at:at + len(labs)])
        at += len(labs)
    return out
