"""What one step samples, for the rows it holds: the one place both schedulers turn logits
into tokens (and logprobs).

`StepSampling.of(seqs, counters)` is built on the host before the step's sampling is
queued: each row's params, key and token number, which rows are constrained and which
want logprobs. The constrained rows' bitmask is filled from their matchers by `fill`
(a constrained row's previous token must have been read by then): at once by default, or,
with `fill=False`, later by the runner into its own pinned buffer, after the step's
forward is queued (so the host fills while the device computes). `sample_step(logits, sampling)` then runs on
the logits' device: logprobs of the raw logits for the rows that ask, the mask, and the
draw (`nanoserve.sampling.params.sample_next`). A step of greedy, unconstrained rows that want no
logprobs is `trivial`: its argmax is all it needs (the captured step computes it itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.sampling.logprobs import logprob_rows
from nanoserve.sampling.params import SamplingParams, sample_next
from nanoserve.sampling.sequence import Sequence
from nanoserve.sampling.structured import FillThread, allocate_bitmask, fill_bitmasks


@dataclass
class StepSampling:
    params: list[SamplingParams]
    keys: list[int | None]
    counters: list[int]
    bitmask: torch.Tensor | None = None  # [len(masked), words] int32, once filled
    masked: tuple[int, ...] = ()  # rows whose bitmask row applies
    logprob_rows: tuple[int, ...] = ()  # rows that want logprobs
    k: int = 0  # the most alternatives any of them asks for
    steered: tuple[Sequence, ...] = ()  # the masked rows' sequences, in `masked` order
    words: int = 0  # int32 words per bitmask row
    all_greedy: bool = False  # every row takes its argmax (before any mask)

    @classmethod
    def of(cls, seqs: list[Sequence], counters: list[int], words: int = 0,
           fill: bool = True) -> StepSampling:
        """Sampling for `seqs` (one per row, in the step's order; a row that finished may
        still be in a step: it takes no mask). counters: tokens each row drew before this
        one. words: int32 words per bitmask row (needed when a row is constrained); fill: fill
        the bitmask now, in host memory (else the caller, the runner, calls `fill` with its
        pinned buffer before the sampling is queued)."""
        params, keys, masked, lp, k, greedy = [], [], [], [], 0, True
        for i, s in enumerate(seqs):  # one pass: this runs every step, for every row
            p = s.params
            greedy = greedy and p.greedy
            params.append(p)
            keys.append(s.key)
            if s.constrained:
                masked.append(i)
            if p.logprobs is not None:
                lp.append(i)
                k = max(k, p.logprobs)
        out = cls(params, keys, list(counters), None, tuple(masked), tuple(lp), k,
                  tuple(seqs[i] for i in masked), words, greedy)
        if masked and fill:
            out.fill(allocate_bitmask(len(masked), words))
        return out

    def fill(self, out: torch.Tensor) -> torch.Tensor:
        """Fill the masked rows' bitmask into out[:len(masked)] (host, int32, [>= m, words])
        and keep that view as `bitmask`. A row whose grammar allows no token is found on the
        device: its token comes out -1 (`sample_step`) and ends it when appended."""
        bitmask = out[:len(self.masked)]
        fill_bitmasks([s.matcher for s in self.steered], bitmask)
        self.bitmask = bitmask
        return bitmask

    def fill_rows(self, out: torch.Tensor, thread: FillThread | None = None) -> torch.Tensor:
        """Fill one bitmask row per step row into out[:len(params)] (host int32, [>= rows,
        words]): the masked rows' at their own indexes, every other row all-allowed (its
        masked argmax is its argmax: the same kernel, the same first index among equals).
        Returns that view; `bitmask` stays unset. For a greedy step without logprobs that
        takes every row's masked argmax (the runner's fixed masked step). thread: the
        matchers' rows are filled there (the caller `wait`s for it before reading them)."""
        n = len(self.params)
        rows = out[:n]
        if len(self.masked) < n:
            free = np.ones(n, dtype=bool)
            free[list(self.masked)] = False
            rows.numpy()[free] = -1
        matchers = [s.matcher for s in self.steered]
        if thread is None:
            fill_bitmasks(matchers, rows, list(self.masked))
        else:
            thread.start(matchers, rows, list(self.masked))
        return rows

    @property
    def greedy_masked(self) -> bool:
        """Every row takes its argmax among its allowed tokens, and none wants logprobs."""
        return bool(self.masked) and self.all_greedy and not self.logprob_rows

    @property
    def trivial(self) -> bool:
        return not self.masked and not self.logprob_rows and self.all_greedy


def sample_step(logits: torch.Tensor, sampling: StepSampling,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's tokens [B] int64 (-1 for a masked row whose grammar allows no token: not
    an input for the model) and, for `sampling.logprob_rows`, their logprob rows
    [m, 2 + 2k] float32 (`nanoserve.sampling.logprobs.logprob_rows`), both on the logits' device.
    logits [B, V] stay unchanged. `tokens`: the step's argmax if already computed (the
    captured step's), reused when nothing else is needed."""
    if tokens is None or sampling.masked or not sampling.all_greedy:
        tokens = sample_next(logits, sampling.params, sampling.keys, sampling.counters,
                             sampling.bitmask, list(sampling.masked))
    if not sampling.logprob_rows:
        return tokens, None
    chosen = tokens.clamp_min(0) if sampling.masked else tokens  # -1 reads no logit
    if len(sampling.logprob_rows) == len(sampling.params):  # every row (in order) asks
        return tokens, logprob_rows(logits, chosen, sampling.k)
    idx = torch.tensor(sampling.logprob_rows, dtype=torch.int64).to(logits.device,
                                                                    non_blocking=True)
    return tokens, logprob_rows(logits.index_select(0, idx), chosen.index_select(0, idx),
                                sampling.k)


__all__ = ["StepSampling", "sample_step"]
