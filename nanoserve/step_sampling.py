"""What one step samples, for the rows it holds: the one place both schedulers turn logits
into tokens (and logprobs).

`StepSampling.of(seqs, counters)` is built on the host before the step's sampling is
queued: each row's params, key and token number, the structured-output bitmask of its
constrained rows (filled from their matchers now: a constrained row's previous token must
have been read), and which rows want logprobs. `sample_step(logits, sampling)` then runs on
the logits' device: logprobs of the raw logits for the rows that ask, the mask, and the
draw (`nanoserve.sampling.sample_next`). A step of greedy, unconstrained rows that want no
logprobs is `trivial`: its argmax is all it needs (the captured step computes it itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.logprobs import logprob_rows
from nanoserve.sampling import SamplingParams, sample_next
from nanoserve.sequence import Sequence
from nanoserve.structured import allocate_bitmask, fill_bitmasks


@dataclass
class StepSampling:
    params: list[SamplingParams]
    keys: list[int | None]
    counters: list[int]
    bitmask: torch.Tensor | None = None  # [len(masked), words] int32, host
    masked: tuple[int, ...] = ()  # rows whose bitmask row applies
    logprob_rows: tuple[int, ...] = ()  # rows that want logprobs
    k: int = 0  # the most alternatives any of them asks for

    @classmethod
    def of(cls, seqs: list[Sequence], counters: list[int], words: int = 0,
           pin: bool = False) -> StepSampling:
        """Sampling for `seqs` (one per row, in the step's order; a row that finished may
        still be in a step: it takes no mask). counters: tokens each row drew before this
        one. words: int32 words per bitmask row (needed when a row is constrained); pin:
        the bitmask in pinned memory (for a CUDA device). A row whose grammar allows no
        token ends here (`Sequence.cannot_continue`) and samples unmasked (dropped)."""
        masked = tuple(i for i, s in enumerate(seqs) if s.constrained)
        bitmask = None
        if masked:
            bitmask = allocate_bitmask(len(masked), words, pin)
            ok = fill_bitmasks([seqs[i].matcher for i in masked], bitmask)
            for j, i in enumerate(masked):
                if not ok[j]:
                    bitmask[j].fill_(-1)
                    seqs[i].cannot_continue()
        lp = tuple(i for i, s in enumerate(seqs) if s.params.logprobs is not None)
        return cls([s.params for s in seqs], [s.key for s in seqs], list(counters), bitmask,
                   masked, lp, max((seqs[i].params.logprobs for i in lp), default=0))

    @property
    def trivial(self) -> bool:
        return (not self.masked and not self.logprob_rows
                and all(p.greedy for p in self.params))


def sample_step(logits: torch.Tensor, sampling: StepSampling,
                tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's tokens [B] int64 and, for `sampling.logprob_rows`, their logprob rows
    [m, 2 + 2k] float32 (`nanoserve.logprobs.logprob_rows`), both on the logits' device.
    logits [B, V] stay unchanged. `tokens`: the step's argmax if already computed (the
    captured step's), reused when nothing else is needed."""
    if tokens is None or sampling.masked or not all(p.greedy for p in sampling.params):
        tokens = sample_next(logits, sampling.params, sampling.keys, sampling.counters,
                             sampling.bitmask, list(sampling.masked))
    lp = None
    if sampling.logprob_rows:
        idx = torch.tensor(sampling.logprob_rows, dtype=torch.int64).to(logits.device,
                                                                        non_blocking=True)
        lp = logprob_rows(logits.index_select(0, idx), tokens.index_select(0, idx), sampling.k)
    return tokens, lp


__all__ = ["StepSampling", "sample_step"]
