"""Sampling parameters (vLLM's names) and the per-row sampler.

Invariant: a row's sampled tokens depend only on its own `SamplingParams` (its seed)
and its own logits, never on which rows share its batch: a draw is a pure function of
the row's key, its token number and its logits (counter-based Gumbel noise), and
temperature 0 is an exact argmax that draws nothing. Sampling runs on the logits'
device for the whole batch at once.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where tensors are made: a job's driver needs SamplingParams only
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


def row_seed(params: SamplingParams) -> int | None:
    """The row's 63-bit sampling key: its seed folded into [0, 2**63), or a fresh random one
    when it has none; None for a greedy row (it draws nothing)."""
    if params.greedy:
        return None
    if params.seed is None:
        return random.getrandbits(63)
    return params.seed % (1 << 63)


# Counter-based noise: a draw is a pure function of (row key, token index, vocabulary id),
# so it needs no generator state, runs on any device for a whole batch at once, and a row
# draws the same numbers whichever batch it sits in. The mixer is a 32-bit integer hash
# (xorshift-multiply rounds); multipliers stay below 2**31 and values below 2**32, so no
# int64 product overflows.
_M32 = 0xFFFFFFFF
_MULS = (0x7FEB352D, 0x68E31DA5, 0x1B873593)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> hashed int64 values in [0, 2**32)."""
    for m in _MULS:
        x = x ^ (x >> 16)
        x = (x * m) & _M32
    return x ^ (x >> 15)


def gumbel_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [n, vocab] float32 for rows with 63-bit `keys` [n] int64 drawing
    their token number `counters` [n] int64. argmax(logits / T + noise) is a draw from
    softmax(logits / T) (the Gumbel-max trick)."""
    import torch

    lo, hi = keys & _M32, (keys >> 32) & _M32
    row = _mix32(lo ^ _mix32(hi ^ _mix32(counters & _M32)))  # [n]
    vid = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = _mix32(row[:, None] ^ ((vid * 0x2545F491) & _M32)[None, :])  # [n, V]
    u = ((h >> 8).double() + 0.5) / float(1 << 24)  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()


def _filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, cut: bool) -> torch.Tensor:
    """Temperature, then top-k, then top-p (on the top-k-renormalised distribution), for n
    rows at once. logits [n, V] float32; temperature, top_p [n] float32; top_k [n] int64
    (0: no cut); cut: whether any row has a top-k or top-p cut (known on the host, so no
    device sync). Dropped tokens become -inf; the most likely token is always kept."""
    import torch

    x = logits / temperature[:, None]
    if not cut:
        return x
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [n, V]
    ranks = torch.arange(x.shape[-1], device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k, x.shape[-1])
    keep = ranks < k[:, None]
    probs = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    keep &= (before < top_p[:, None]) | (ranks == 0)
    sorted_x = sorted_x.masked_fill(~keep, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def sample_next(logits: torch.Tensor, params: list[SamplingParams], keys: list[int | None],
                counters: list[int]) -> torch.Tensor:
    """One next token per row, on the logits' device, with no host sync per row.
    logits: [B, V]; keys: each row's `row_seed` (None for greedy rows); counters: how many
    tokens each row has generated before this one. Returns [B] int64 on that device.

    Greedy rows take the exact argmax. The others draw by the Gumbel-max trick from
    counter-based noise (`gumbel_noise`): the draw depends on the row's key, its token
    number and its own logits only."""
    import torch

    tokens = torch.argmax(logits, dim=-1)  # a half-precision row's argmax is its float32's
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    dev = logits.device
    idx = torch.tensor(sampled, dtype=torch.int64).to(dev, non_blocking=True)
    sp = [params[i] for i in sampled]
    temperature = torch.tensor([p.temperature for p in sp], dtype=torch.float32).to(dev)
    top_k = torch.tensor([max(p.top_k, 0) for p in sp], dtype=torch.int64).to(dev)
    top_p = torch.tensor([p.top_p for p in sp], dtype=torch.float32).to(dev)
    key_t = torch.tensor([keys[i] for i in sampled], dtype=torch.int64).to(dev)
    ctr_t = torch.tensor([counters[i] for i in sampled], dtype=torch.int64).to(dev)
    cut = any(p.top_k > 0 or p.top_p < 1 for p in sp)
    x = _filter_logits(logits.index_select(0, idx).float(), temperature, top_k, top_p, cut)
    drawn = torch.argmax(x + gumbel_noise(key_t, ctr_t, x.shape[-1]), dim=-1)
    return tokens.index_copy(0, idx, drawn)
