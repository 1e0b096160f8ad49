"""Label scores (`nanoserve.choice_scores`, `LLM.choice_scores`) held to transformers'
forward on the same tiny float32 checkpoint: log-softmax over the vocabulary at each label
token given the prompt and the label's earlier tokens, summed per label, normalised over the
labels. Labels here are multi-token and share prefixes, so a first-token shortcut fails."""

from __future__ import annotations

import pytest
import torch

LABELS = ["positive", "positive outlook", "negative", "neutral stance"]
PROMPTS = ["Review: the film was long but moving. Sentiment:",
           "The weather today is"]


def reference(model_dir, tokenizer, prompt_ids, labels):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums = []
    for label in labels:
        ids = tokenizer.encode(label, add_special_tokens=False)
        seq = torch.tensor([list(prompt_ids) + ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(seq).logits[0].double(), dim=-1)
        n = len(prompt_ids)
        sums.append(sum(logp[n - 1 + t, tok].item() for t, tok in enumerate(ids)))
    probs = torch.softmax(torch.tensor(sums, dtype=torch.float64), dim=0)
    return dict(zip(labels, probs.tolist()))


def test_label_probabilities_equal_transformers(tiny_llm, tiny_job_model):
    tok = tiny_llm.tokenizer
    assert any(len(tok.encode(lb, add_special_tokens=False)) > 1 for lb in LABELS)
    prompts = [tok.encode(p) for p in PROMPTS]
    got = tiny_llm.choice_scores(prompts, LABELS)
    for prompt, scores in zip(prompts, got):
        want = reference(tiny_job_model, tok, prompt, LABELS)
        assert list(scores) == LABELS
        assert abs(sum(scores.values()) - 1) < 1e-6
        for label in LABELS:
            assert abs(scores[label] - want[label]) < 1e-4, (label, scores, want)
    # the labels' probabilities really differ between the two prompts (not a constant)
    assert max(abs(got[0][lb] - got[1][lb]) for lb in LABELS) > 1e-3


def test_ties_and_empty_label_lists_are_one_line_errors(tiny_llm):
    with pytest.raises(ValueError, match="the choice list is empty"):
        tiny_llm.choice_scores(["x"], [])
    with pytest.raises(ValueError, match="'a' is given twice"):
        tiny_llm.choice_scores(["x"], ["a", "b", "a"])


def test_benchmark_smoke_builds_the_random_1b_shape(capsys):
    """benchmarks/choice_scores.py --shape 1b (what the GPU runs: nothing downloaded), shrunk
    for the CPU by --smoke: it loads random weights with a byte tokenizer and prints its
    table and ratio."""
    from benchmarks.choice_scores import main

    result = main(["--smoke", "--shape", "1b"])
    assert result["ratio"] > 0
    assert "choice-scores-over-constrained-1tok" in capsys.readouterr().out
