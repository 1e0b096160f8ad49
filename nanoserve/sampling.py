"""Sampling parameters (vLLM's names) and the per-row sampler.

Invariant: a row's sampled tokens depend only on its own `SamplingParams` (its seed)
and its own logits, never on which rows share its batch: every row draws from its
own `torch.Generator`, one draw per generated token, and temperature 0 is an exact
argmax that draws nothing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256  # cap on generated tokens; finish_reason 'length' when hit
    temperature: float = 0.0  # 0 means greedy (argmax), exactly
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    seed: int | None = None  # per-row seed; None draws a fresh one
    stop: tuple[str, ...] = ()  # stop strings: the text is cut before the first one
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the row (kept in output)
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        # Normalise list inputs so params stay hashable and comparable.
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these values, as messages a user can act on."""
        out = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            out.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            out.append(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            out.append(f"top_k must be an integer >= 0 (or -1 for none), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0 < p <= 1):
            out.append(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            out.append(f"seed must be an integer, got {self.seed!r}")
        elif self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            out.append(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            out.append("stop strings must be non-empty strings")
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator seeded from the row's seed (None for greedy rows)."""
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    g.manual_seed(seed)
    return g


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p on one row. logits: [V] float32 -> [V]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p;
        # the most likely token is always kept.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One next token per row. logits: [B, V] (any device/dtype) -> B ints.

    Greedy rows take the argmax; the others sample on the CPU in float32 from their
    own generator, so the draw is the same whichever batch the row sits in.
    """
    out: list[int] = []
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            out.append(int(greedy_ids[i]))
            continue
        row = _filter_logits(logits[i].float().cpu(), p)
        probs = torch.softmax(row, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=g).item()))
    return out
