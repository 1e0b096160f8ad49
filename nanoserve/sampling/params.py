"""Sampling parameters (vLLM's names) and the per-row sampler.

Invariant: a row's sampled tokens depend only on its own `SamplingParams` (its seed)
and its own logits, never on which rows share its batch: a draw is a pure function of
the row's key, its token number and its logits (counter-based Gumbel noise), and
temperature 0 is an exact argmax that draws nothing. Sampling runs on the logits'
device for the whole batch at once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where tensors are made: a job's driver needs SamplingParams only
    import torch

from nanoserve.options import MAX_LOGPROBS, MAX_N, SAMPLING, SEED_RANGE, STRUCTURED
from nanoserve.sampling.structured import StructuredOutputs, allowed_tokens, masked_argmax

__all__ = ["MAX_LOGPROBS", "MAX_N", "SEED_RANGE", "SamplingParams", "check_room", "row_seed",
           "sample_next", "token_budget"]


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling values. The defaults and the checks of the fields that
    `nanoserve.options.SAMPLING` declares are its (written once there); `problems` adds the
    checks between fields (a choice list for `choice_scores`, ...)."""

    # cap on generated tokens (finish_reason 'length' when hit), and the context's room
    # (`token_budget`)
    max_tokens: int = SAMPLING["max_tokens"].default
    temperature: float = SAMPLING["temperature"].default  # 0 means greedy (argmax), exactly
    top_k: int = SAMPLING["top_k"].default  # 0 or -1: no top-k cut
    top_p: float = SAMPLING["top_p"].default  # nucleus mass kept, in (0, 1]
    seed: int | None = SAMPLING["seed"].default  # per-row seed; None draws a fresh one
    # stop strings: the text is cut before the first one
    stop: tuple[str, ...] = SAMPLING["stop"].default
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end the row (kept in output)
    ignore_eos: bool = SAMPLING["ignore_eos"].default  # keep going past the model's EOS tokens
    # samples of the prompt (prefilled once); sample i draws with seed + i
    n: int = SAMPLING["n"].default
    # per generated token: its logprob, rank and this many top
    logprobs: int | None = SAMPLING["logprobs"].default
    # the same for each prompt token after the first
    prompt_logprobs: int | None = SAMPLING["prompt_logprobs"].default
    structured_outputs: StructuredOutputs | None = None  # JSON schema, regex, choice, grammar
    # with a choice list: score every label (nanoserve.sampling.choice_scores) instead of sampling;
    # the batch job's worker runs it (the engine's generate does not read it)
    choice_scores: bool = STRUCTURED["choice_scores"].default
    # under a reasoning parser: the think block holds at most this many tokens, then the
    # engine closes it and the answer follows (nanoserve.sampling.reasoning.ThinkSteer)
    max_thinking_tokens: int | None = SAMPLING["max_thinking_tokens"].default
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
        out = [p for name, option in SAMPLING.items()
               if (p := option.problem(getattr(self, name))) is not None]
        so = self.structured_outputs
        if self.choice_scores is not False:
            if self.choice_scores is not True:
                out.append(f"choice_scores must be true or false, got {self.choice_scores!r}")
            elif not isinstance(so, StructuredOutputs) or so.choice is None:
                out.append("choice_scores needs a choice list (guided_choice / --choice)")
            else:
                from nanoserve.sampling.structured import check_labels

                try:
                    check_labels(so.choice)
                except ValueError as e:
                    out.append(str(e))
                if self.n != 1:
                    out.append("choice_scores gives one row per prompt: n must be 1")
        if so is not None:
            if not isinstance(so, StructuredOutputs):
                out.append("structured_outputs must be a nanoserve.sampling.structured.StructuredOutputs")
            else:
                out += so.problems()
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_room(num_prompt_tokens: int, max_context: int) -> None:
    """ValueError when a prompt of `num_prompt_tokens` leaves no position of the model's
    context (`max_context` tokens) to generate in. The one place this limit is said."""
    if num_prompt_tokens >= max_context:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens; the model's context is "
                         f"{max_context} tokens, which leaves no room to generate")


def token_budget(max_tokens: int, num_prompt_tokens: int, max_context: int) -> int:
    """The tokens a request may generate: its `max_tokens`, cut to the room the model's
    context leaves after its prompt; always >= 1. ValueError (`check_room`) when the
    prompt leaves no room. The engine (`Sequence`, `LLM`'s planning) and the job (its
    rows' parameters, its worker's KV check) settle a request's limit here, and only here."""
    check_room(num_prompt_tokens, max_context)
    return min(max_tokens, max_context - num_prompt_tokens)


def row_seed(params: SamplingParams, sample_index: int = 0) -> int | None:
    """The row's 63-bit sampling key: its seed (plus the sample's index, for sample i of n)
    folded into [0, 2**63), or a fresh random one when it has none; None for a greedy row
    (it draws nothing). So sample i of a row equals the row alone with seed + i."""
    if params.greedy:
        return None
    if params.seed is None:
        return random.getrandbits(63)
    return (params.seed + sample_index) % (1 << 63)


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
                counters: list[int], bitmask: torch.Tensor | None = None,
                masked: list[int] | None = None) -> torch.Tensor:
    """One next token per row, on the logits' device, with no host sync per row.
    logits: [B, V]; keys: each row's `row_seed` (None for greedy rows); counters: how many
    tokens each row has generated before this one; bitmask [len(masked), ceil(V/32)] int32
    (host or device): the allowed tokens of the rows at indexes `masked` (structured
    outputs), applied before temperature and the cut. Returns [B] int64 on that device; a
    masked row whose bitmask allows no token gets -1 (its row ends: `Sequence.append`).

    Greedy rows take the exact argmax. The others draw by the Gumbel-max trick from
    counter-based noise (`gumbel_noise`): the draw depends on the row's key, its token
    number and its own logits only. `logits` itself is never changed."""
    import torch

    masked = masked or []
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    dev = logits.device
    if masked and not sampled and len(masked) == len(params):  # every row greedy and steered
        return masked_argmax(logits, bitmask.to(dev, non_blocking=True))
    tokens = torch.argmax(logits, dim=-1)  # a half-precision row's argmax is its float32's
    rows = sorted(set(sampled) | set(masked))
    if not rows:
        return tokens
    if not sampled:  # greedy rows, some steered: their masked argmax replaces the argmax
        idx = torch.tensor(masked, dtype=torch.int64).to(dev, non_blocking=True)
        drawn = masked_argmax(logits.index_select(0, idx), bitmask.to(dev, non_blocking=True))
        return tokens.index_copy(0, idx, drawn)
    idx = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    x = logits.index_select(0, idx).float()  # [m, V], a copy
    stuck = None  # [m] bool: a masked row that allows no token at all
    if masked:
        at = {r: j for j, r in enumerate(rows)}
        where = torch.tensor([at[r] for r in masked], dtype=torch.int64).to(dev, non_blocking=True)
        allowed = allowed_tokens(bitmask.to(dev, non_blocking=True), x.shape[-1])
        x.index_copy_(0, where, x.index_select(0, where).masked_fill_(~allowed, float("-inf")))
        stuck = torch.zeros(len(rows), dtype=torch.bool, device=dev).index_copy_(
            0, where, ~allowed.any(dim=1))
    sp = [params[i] for i in rows]
    draws = [not p.greedy for p in sp]
    temperature = torch.tensor([p.temperature if d else 1.0 for p, d in zip(sp, draws)],
                               dtype=torch.float32).to(dev, non_blocking=True)
    top_k = torch.tensor([max(p.top_k, 0) if d else 0 for p, d in zip(sp, draws)],
                         dtype=torch.int64).to(dev, non_blocking=True)
    top_p = torch.tensor([p.top_p if d else 1.0 for p, d in zip(sp, draws)],
                         dtype=torch.float32).to(dev, non_blocking=True)
    cut = any(d and (p.top_k > 0 or p.top_p < 1) for p, d in zip(sp, draws))
    x = _filter_logits(x, temperature, top_k, top_p, cut)
    if any(draws):
        key_t = torch.tensor([keys[i] if d else 0 for i, d in zip(rows, draws)],
                             dtype=torch.int64).to(dev, non_blocking=True)
        ctr_t = torch.tensor([counters[i] for i in rows], dtype=torch.int64).to(dev, non_blocking=True)
        noise = gumbel_noise(key_t, ctr_t, x.shape[-1])
        on = torch.tensor(draws).to(dev, non_blocking=True)
        x = x + torch.where(on[:, None], noise, torch.zeros((), device=dev))
    drawn = torch.argmax(x, dim=-1)
    if stuck is not None:
        drawn.masked_fill_(stuck, -1)
    return tokens.index_copy(0, idx, drawn)
