"""Log-probabilities of generated and prompt tokens, computed on the device.

Values are `log_softmax` of the model's raw logits in float32: before temperature, top-k,
top-p and a structured output's mask (vLLM's default, "raw" logprobs), so they describe the
model, not the sampler. A token's rank is 1 + the number of tokens with a strictly higher
logit (so a higher logprob, counted before rounding: the argmax has rank 1). Only the rows
that ask are computed: their logits rows are reduced to `[rows, 2 + 2k]` float32 (logprob,
rank, k top ids, k top logprobs; on a GPU by `nanoserve_kernels.logprobs`, which reads the logits
once), and that small tensor is what reaches the host: no `[rows, vocab]` tensor is kept,
and the host waits for it with the step's tokens, not per row.

Prompt logprobs (for each prompt token after the first, the logprob of that token given
the ones before) come from the prefill's hidden states, `PROMPT_CHUNK` positions at a time,
so a long prompt never holds `[prompt, vocab]` logits at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve_kernels import backend as kernel_backend

PROMPT_CHUNK = 256  # prompt positions whose logits exist at once


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and rank, and the `k` most likely tokens at its place."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), most likely first

    def as_dict(self) -> dict:
        """The Arrow/JSON form (`ray_jobs.preparation.result_columns.LOGPROBS_TYPE`)."""
        return {"token_id": self.token_id, "logprob": self.logprob, "rank": self.rank,
                "top": [{"token_id": t, "logprob": lp} for t, lp in self.top]}


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [m, V] (any float dtype), tokens [m] int64 -> [m, 2 + 2k] float32 on the same
    device: the token's logprob, its rank, then the k top ids and their logprobs. On a GPU
    one Triton kernel reads the logits once (`nanoserve_kernels.logprobs`); elsewhere its reference."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return kernel_backend.logprob_rows(logits, tokens.contiguous(), k)


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


class Logprobs(Sequence):
    """A row's logprobs, one `TokenLogprob` per token, kept as arrays: token_ids [T] int64,
    values [T, 2 + 2k'] float32 (`logprob_rows` layout, k' >= k); entries are made when
    read. `as_dicts()` is the Arrow/JSON form."""

    def __init__(self, token_ids, values, k: int) -> None:
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.float32).reshape(len(self.token_ids), -1)
        self.k = k

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return with_token(unpack(self.values[i].tolist(), self.k), int(self.token_ids[i]))

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def as_dicts(self) -> list[dict]:
        v, k = self.values, self.k
        kk = (v.shape[1] - 2) // 2 if len(v) else 0
        lp, rank = v[:, 0].tolist(), v[:, 1].astype(np.int64).tolist()
        ids = v[:, 2:2 + k].astype(np.int64).tolist()
        tops = v[:, 2 + kk:2 + kk + k].tolist()
        return [{"token_id": t, "logprob": a, "rank": r,
                 "top": [{"token_id": i, "logprob": x} for i, x in zip(ti, tx)]}
                for t, a, r, ti, tx in zip(self.token_ids.tolist(), lp, rank, ids, tops)]

    def __repr__(self) -> str:
        return f"Logprobs({len(self)} tokens, k={self.k})"


def entries(rows, tokens: list[int], k: int) -> Logprobs:
    """rows: one `logprob_rows` row per token (lists or arrays), tokens: the tokens."""
    def own(r):  # rows of different steps carry different k' >= k: keep k of each
        r = np.asarray(r, dtype=np.float32)
        kk = (len(r) - 2) // 2
        return r if kk == k else np.concatenate((r[:2 + k], r[2 + kk:2 + kk + k]))

    if not len(rows):
        values = np.zeros((0, 2 + 2 * k), dtype=np.float32)
    elif all(len(r) == 2 + 2 * k for r in rows):  # every step asked for this row's k
        values = np.stack(rows).astype(np.float32, copy=False)
    else:
        values = np.stack([own(r) for r in rows])
    return Logprobs(tokens[:len(rows)], values, k)


__all__ = ["PROMPT_CHUNK", "Logprobs", "TokenLogprob", "entries", "logprob_rows",
           "prompt_logprob_rows", "unpack", "with_token"]
