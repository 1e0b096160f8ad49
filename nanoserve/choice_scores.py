"""Label scores: one probability per label of a choice list, from forward passes over the
labels, not from sampling.

For a prompt P and labels L_1..L_m (each encoded on its own, without special tokens), the
score of L_j is  s_j = sum_t log p(L_j[t] | P + L_j[:t])  (the model's log-probability of
the label's whole token sequence after the prompt), and the labels' probabilities are
softmax(s) over the m labels.

Invariants:
- exact for multi-token labels and for labels that share a prefix: each label is its own
  sequence P + L_j, scored token by token at its own positions (nothing is approximated
  from the first token);
- the sequences run through the engine's ordinary prefill with prompt logprobs
  (`SamplingParams.prompt_logprobs=0`), so the numbers are the engine's own forward; the
  one generated token per sequence is discarded;
- an empty label list, an empty label, or two labels with the same text are a ValueError
  with a one-line message, raised before any forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nanoserve.sampling import SamplingParams
from nanoserve.structured import check_labels


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


def score_requests(prompt: Sequence[int], label_ids: Sequence[Sequence[int]],
                   max_context: int) -> list[tuple[list[int], SamplingParams]]:
    """The engine requests that score one prompt: prompt + label, one generated token,
    prompt logprobs on. ValueError when a label does not fit the model's context."""
    out = []
    for ids in label_ids:
        seq = list(prompt) + list(ids)
        if len(seq) + 1 > max_context:
            raise ValueError(f"prompt and label take {len(seq)} tokens; the model's context "
                             f"is {max_context}")
        out.append((seq, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                        prompt_logprobs=0)))
    return out


def label_logprob(prompt_logprobs: Any, num_label_tokens: int) -> float:
    """The summed log-probability of the last `num_label_tokens` tokens of a scored
    sequence (its label), from the engine's prompt logprobs (one per token after the
    first)."""
    entries = prompt_logprobs[len(prompt_logprobs) - num_label_tokens:]
    return float(sum(e.logprob for e in entries))


def choice_scores(llm: Any, prompts: Sequence[Sequence[int]], labels: Sequence[str]
                  ) -> list[dict[str, float]]:
    """One {label: probability} per prompt (token ids), over `labels`, from `llm`'s engine
    (`nanoserve.llm.LLM`): every prompt x label sequence in one `generate` call."""
    label_ids = label_token_ids(llm.tokenizer, labels)
    requests = [r for p in prompts for r in score_requests(p, label_ids, llm.max_context)]
    if not requests:
        return []
    outs = llm.generate([r[0] for r in requests], [r[1] for r in requests])
    m = len(label_ids)
    result = []
    for i in range(len(prompts)):
        sums = [label_logprob(outs[i * m + j].prompt_logprobs, len(label_ids[j]))
                for j in range(m)]
        result.append(dict(zip(labels, normalise(sums))))
    return result


def expand_requests(tokenizer: Any, max_context: int, prompts: Sequence[Sequence[int]],
                    params: Sequence[SamplingParams]
                    ) -> tuple[list[list[int]], list[SamplingParams], list[list[list[int]] | None]]:
    """Requests as the engine runs them: a request whose params ask for `choice_scores`
    becomes one scoring sequence per label (`score_requests`), the others stay as they are.
    Returns the engine's prompts and params, and per request its labels' token ids (None
    for a request that generates). ValueError when a label does not fit the context."""
    out_prompts: list[list[int]] = []
    out_params: list[SamplingParams] = []
    spans: list[list[list[int]] | None] = []
    for prompt, p in zip(prompts, params, strict=True):
        if not p.choice_scores:
            out_prompts.append(list(prompt))
            out_params.append(p)
            spans.append(None)
            continue
        label_ids = label_token_ids(tokenizer, p.structured_outputs.choice)
        for seq, sp in score_requests(prompt, label_ids, max_context):
            out_prompts.append(seq)
            out_params.append(sp)
        spans.append(label_ids)
    return out_prompts, out_params, spans


def scored_result(labels: Sequence[str], label_ids: Sequence[Sequence[int]],
                  outs: Sequence[Any]) -> tuple[list[float], int]:
    """The labels' probabilities from their scoring sequences' completions (in label
    order), and the index of the most likely label (the first of equals)."""
    probs = normalise([label_logprob(o.prompt_logprobs, len(ids))
                       for o, ids in zip(outs, label_ids, strict=True)])
    return probs, max(range(len(probs)), key=lambda j: probs[j])
