"""Label scores (`nanoserve.sampling.choice_scores`, `LLM.choice_scores`) held to transformers'
forward on the same tiny float32 checkpoint: log-softmax over the vocabulary at each label
token given the prompt and the label's earlier tokens, summed per label, normalised over the
labels. Labels here are multi-token and share prefixes, so a first-token shortcut fails.
Multi-token labels are rare on a random model (probabilities ~1e-5), so their sums are also
compared as log-probabilities, where an error shows."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_tokenizer, label_logprob_sums, label_probabilities

LABELS = ["positive", "positive outlook", "negative", "neutral stance"]
PROMPTS = ["Review: the film was long but moving. Sentiment:",
           "The weather today is"]
BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # layers, K/V, KV heads, head_dim, tokens, float32


@pytest.fixture(scope="module")
def hf_tiny(tiny_job_model):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_job_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(tiny_job_model):
    return hf_tokenizer(tiny_job_model)


@pytest.fixture(scope="module")
def ten_block_llm(tiny_job_model):
    """The tiny model over a pool of 10 blocks of 16 tokens."""
    from nanoserve.llm import LLM

    llm = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=10 * BLOCK_BYTES)
    assert (llm.pool.num_blocks, llm.pool.block_size) == (10, 16)
    return llm


def encode_labels(hf_tok, labels):
    return [hf_tok(label, add_special_tokens=False)["input_ids"] for label in labels]


def test_label_probabilities_equal_transformers(tiny_llm, hf_tiny, hf_tok):
    label_ids = encode_labels(hf_tok, LABELS)
    assert any(len(ids) > 1 for ids in label_ids)
    prompts = [hf_tok(p)["input_ids"] for p in PROMPTS]
    got = tiny_llm.choice_scores(prompts, LABELS)
    for prompt, scores in zip(prompts, got):
        want = dict(zip(LABELS, label_probabilities(hf_tiny, prompt, label_ids)))
        assert list(scores) == LABELS
        assert abs(sum(scores.values()) - 1) < 1e-6
        for label in LABELS:
            assert abs(scores[label] - want[label]) < 1e-4, (label, scores, want)
    # the labels' probabilities really differ between the two prompts (not a constant)
    assert max(abs(got[0][lb] - got[1][lb]) for lb in LABELS) > 1e-3


def test_label_logprobs_over_a_pool_of_stale_blocks(ten_block_llm, hf_tiny, hf_tok):
    """Another prompt first fills the 10-block pool with its K/V; then each label's summed
    log-probability (not its normalised probability) equals transformers'. The prompts end
    inside a block, so a multi-token label's fork copies that partly filled block."""
    from nanoserve.sampling.choice_scores import label_logprobs
    from nanoserve.sampling.params import SamplingParams

    llm = ten_block_llm
    other = hf_tok(" ".join(["filler words about nothing in particular"] * 20))["input_ids"]
    llm.generate([other[:120]], SamplingParams(max_tokens=20, ignore_eos=True))
    label_ids = encode_labels(hf_tok, LABELS)
    prompts = [hf_tok(p)["input_ids"] for p in PROMPTS]
    assert all(len(p) % 16 for p in prompts)
    got = label_logprobs(llm.model, llm.pool, prompts, [label_ids] * len(prompts))
    for prompt, sums in zip(prompts, got):
        want = label_logprob_sums(hf_tiny, prompt, label_ids)
        assert max(abs(a - b) for a, b in zip(sums, want)) < 1e-4, (sums, want)


def test_a_ten_block_pool_scores_in_groups(ten_block_llm, hf_tiny, hf_tok):
    """Eight prompts of 17-24 tokens take two blocks each: the 10-block pool scores them in
    groups (five, then three), each equal to transformers; a prompt of 161 tokens needs 11
    blocks and is refused before any forward pass."""
    from nanoserve.errors import CacheFullError

    llm = ten_block_llm
    text = hf_tok(" ".join("one two three four five six seven eight nine ten".split() * 20)
                  )["input_ids"]
    prompts = [text[3 * i:3 * i + 17 + i] for i in range(8)]
    labels = ["yes", "no"]
    got = llm.choice_scores(prompts, labels)
    label_ids = encode_labels(hf_tok, labels)
    for prompt, scores in zip(prompts, got):
        want = label_probabilities(hf_tiny, prompt, label_ids)
        assert max(abs(scores[lb] - w) for lb, w in zip(labels, want)) < 1e-4
    long = text[:161]
    with pytest.raises(CacheFullError, match="needs 11 KV blocks; the pool has 10 free"):
        llm.choice_scores([long], labels)


def test_ties_and_empty_label_lists_are_one_line_errors(tiny_llm):
    with pytest.raises(ValueError, match="the choice list is empty"):
        tiny_llm.choice_scores(["x"], [])
    with pytest.raises(ValueError, match="'a' is given twice"):
        tiny_llm.choice_scores(["x"], ["a", "b", "a"])


def test_benchmark_smoke_builds_the_random_1b_shape(capsys):
    """benchmarks/choice_scores.py --shape 1b (what the GPU runs: nothing downloaded), shrunk
    for the CPU by --smoke: it loads random weights with a byte tokenizer, times both paths
    over every row, and its scores agree with the same rows prefilled through prompt
    logprobs (another path of the engine); each constrained token begins a label."""
    from benchmarks.choice_scores import LABELS, main

    result = main(["--smoke", "--shape", "1b"])
    assert result["rows"] == len(result["constrained"]) == 16
    assert result["check_error"] < 1e-4
    assert all(any(lb.startswith(t) and t for lb in LABELS) for t in result["constrained"])
    assert result["ratio"] > 0 and 0 <= result["agree"] <= 16
    out = capsys.readouterr().out
    assert "choice-scores-over-constrained-1tok" in out
    assert "rows whose scores were recomputed through prompt logprobs: 8" in out
