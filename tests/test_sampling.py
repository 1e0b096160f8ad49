"""Sampling: greedy is exactly argmax; a row's draws depend on its own seed only;
top-k/top-p keep the right support; stop rules and finish reasons."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.sampling.params import SamplingParams, gumbel_noise, row_seed, sample_next
from nanoserve.static.generate import generate_batch, greedy_generate


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 5
    assert sample_next(logits, params, [None] * 5, [0] * 5).tolist() == logits.argmax(-1).tolist()


def _draws(logits, p, n):
    """The row's first n tokens' draws over fixed logits (token numbers 0..n-1)."""
    key = row_seed(p)
    return [int(sample_next(logits[None], [p], [key], [i])[0]) for i in range(n)]


def test_noise_is_a_function_of_key_and_token_number_only():
    """Batch invariance: a row's noise is the same alone or among other rows; another key
    or token number gives other noise; the noise looks standard Gumbel."""
    keys = torch.tensor([7, 2**62 + 5, 123456789], dtype=torch.int64)
    counters = torch.tensor([0, 3, 9], dtype=torch.int64)
    together = gumbel_noise(keys, counters, 1000)
    for i in range(3):
        assert torch.equal(gumbel_noise(keys[i:i + 1], counters[i:i + 1], 1000)[0], together[i])
    assert not torch.equal(gumbel_noise(keys[:1], counters[1:2], 1000), together[:1])
    big = gumbel_noise(torch.tensor([11]), torch.tensor([0]), 200_000)[0].double()
    assert abs(big.mean() - 0.5772) < 0.02 and abs(big.std() - 1.2825) < 0.02


def test_top_k_and_top_p_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    k2 = _draws(logits, SamplingParams(temperature=1.0, top_k=2, seed=1), 300)
    assert set(k2) == {0, 1}
    # probs at T=1: 0.64, 0.23, 0.086, ...; top_p 0.8 keeps tokens 0 and 1 (0.64 < 0.8).
    p8 = _draws(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=2), 300)
    assert set(p8) == {0, 1}
    # A tiny top_p keeps only the most likely token: greedy.
    assert set(_draws(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=3), 50)) == {0}
    # Unfiltered sampling reaches the tail.
    assert len(set(_draws(logits, SamplingParams(temperature=2.0, seed=4), 400))) >= 5


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0])
    draws = _draws(logits, SamplingParams(temperature=1.0, seed=5), 4000)
    probs = torch.softmax(logits, 0).tolist()
    for tok, p in enumerate(probs):
        assert abs(draws.count(tok) / 4000 - p) < 0.03


@pytest.mark.parametrize("bad", [
    {"temperature": -0.5}, {"top_p": 1.5}, {"top_p": 0.0}, {"max_tokens": 0},
    {"top_k": -3}, {"temperature": float("nan")}, {"stop": [""]},
])
def test_invalid_values_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_seeded_row_same_alone_and_in_mixed_batch(tiny_model):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (4, 19, 1, 33, 8, 12, 2, 27)]
    params = [SamplingParams(max_tokens=m, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for m, t, k, p, s in zip((12, 5, 16, 9, 12, 3, 16, 7),
                                       (0.8, 1.0, 0.0, 1.3, 0.7, 1.0, 0.9, 0.5),
                                       (0, 20, 0, 50, 5, 0, 0, 10),
                                       (1.0, 0.9, 1.0, 0.95, 1.0, 0.5, 0.8, 1.0),
                                       range(100, 108))]
    batched, _ = generate_batch(tiny_model, prompts, params)
    for prompt, p, out in zip(prompts, params, batched):
        alone, _ = generate_batch(tiny_model, [prompt], [p])
        assert alone[0].token_ids == out.token_ids
        assert len(out.token_ids) == p.max_tokens
    # Same seed twice gives the same tokens; another seed gives others.
    again, _ = generate_batch(tiny_model, prompts[:1], params[:1])
    assert again[0].token_ids == batched[0].token_ids
    other, _ = generate_batch(tiny_model, prompts[:1], [SamplingParams(
        max_tokens=12, temperature=0.8, seed=999, ignore_eos=True)])
    assert other[0].token_ids != batched[0].token_ids


def test_stop_token_ids_and_eos(tiny_model):
    prompt = [5, 9, 13]
    free = greedy_generate(tiny_model, prompt, 30)
    stop_tok = free[4]
    first = free.index(stop_tok)
    outs, _ = generate_batch(tiny_model, [prompt, prompt],
                             [SamplingParams(max_tokens=30, stop_token_ids=[stop_tok]),
                              SamplingParams(max_tokens=30)], eos_token_ids=(stop_tok,))
    assert outs[0].token_ids == free[: first + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == free[: first + 1] and outs[1].finish_reason == "stop"
    ignored, _ = generate_batch(tiny_model, [prompt], [SamplingParams(max_tokens=30, ignore_eos=True)],
                                eos_token_ids=(stop_tok,))
    assert ignored[0].token_ids == free and ignored[0].finish_reason == "length"


def test_context_limit_finishes_with_length(tiny_model):
    ctx = tiny_model.config.max_position_embeddings
    outs, _ = generate_batch(tiny_model, [[7] * (ctx - 3)], [SamplingParams(max_tokens=50, ignore_eos=True)])
    assert len(outs[0].token_ids) == 3 and outs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="context"):
        generate_batch(tiny_model, [[7] * ctx], [SamplingParams(max_tokens=5)])
    with pytest.raises(ValueError, match="empty"):
        generate_batch(tiny_model, [[]], [SamplingParams(max_tokens=5)])


def test_stop_strings_cut_text(smollm2_llm):
    llm = smollm2_llm
    ids = llm.tokenizer.encode("Count from one to ten: one, two, three,")
    free = llm.generate([ids], [SamplingParams(max_tokens=24)])[0]
    assert " five" in free.text
    cut = llm.generate([ids], [SamplingParams(max_tokens=24, stop=[" five"])])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(" five")]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
