"""Log-probabilities of generated and prompt tokens, computed on the device.

Values are `log_softmax` of the model's raw logits in float32: before temperature, top-k,
top-p and a structured output's mask (vLLM's default, "raw" logprobs), so they describe the
model, not the sampler. A token's rank is 1 + the number of tokens with a strictly higher
logprob (the argmax has rank 1). Only the rows that ask are computed: their logits rows are
gathered, reduced to `[rows, 2 + 2k]` float32 (logprob, rank, k top ids, k top logprobs),
and that small tensor is what reaches the host: no `[rows, vocab]` tensor is kept, and the
host waits for it with the step's tokens, not per row.

Prompt logprobs (for each prompt token after the first, the logprob of that token given
the ones before) come from the prefill's hidden states, `PROMPT_CHUNK` positions at a time,
so a long prompt never holds `[prompt, vocab]` logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_CHUNK = 256  # prompt positions whose logits exist at once


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and rank, and the `k` most likely tokens at its place."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first

    def as_dict(self) -> dict:
        """The Arrow/JSON form (`ray_jobs.io.LOGPROBS_TYPE`)."""
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [m, V] (any float dtype), tokens [m] int64 -> [m, 2 + 2k] float32 on the same
    device: the token's logprob, its rank, then the k top ids and their logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    chosen = lp.gather(1, tokens.view(-1, 1))  # [m, 1]
    rank = (lp > chosen).sum(dim=-1, keepdim=True).float() + 1  # [m, 1]
    parts = [chosen, rank]
    if k:
        top_lp, top_id = lp.topk(k, dim=-1)  # [m, k]
        parts += [top_id.float(), top_lp]  # ids < 2**24 are exact in float32
    return torch.cat(parts, dim=1)


def unpack(row: list[float], k: int) -> TokenLogprob:
    """One row of `logprob_rows` (computed with some k' >= k), read on the host."""
    kk = (len(row) - 2) // 2
    top = tuple((int(row[2 + j]), float(row[2 + kk + j])) for j in range(k))
    return TokenLogprob(0, float(row[0]), int(row[1]), top)


def with_token(entry: TokenLogprob, token_id: int) -> TokenLogprob:
    return TokenLogprob(int(token_id), entry.logprob, entry.rank, entry.top)


def prompt_logprob_rows(lm_head, hidden: torch.Tensor, targets: torch.Tensor,
                        k: int) -> torch.Tensor:
    """hidden [N, d] at positions 0..N-1 of a prompt (the last position excluded by the
    caller), targets [N] the tokens at positions 1..N -> [N, 2 + 2k] float32, PROMPT_CHUNK
    positions at a time. `lm_head(h)` gives logits for hidden states."""
    out = []
    for s in range(0, hidden.shape[0], PROMPT_CHUNK):
        h = hidden[s:s + PROMPT_CHUNK]
        out.append(logprob_rows(lm_head(h), targets[s:s + PROMPT_CHUNK], k))
    if not out:
        return torch.empty(0, 2 + 2 * k, device=hidden.device)
    return torch.cat(out)


def entries(rows: list[list[float]], tokens: list[int], k: int) -> list[TokenLogprob]:
    return [with_token(unpack(r, k), t) for r, t in zip(rows, tokens)]


__all__ = ["PROMPT_CHUNK", "TokenLogprob", "entries", "logprob_rows", "prompt_logprob_rows",
           "unpack", "with_token"]
