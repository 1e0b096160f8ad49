"""Decoder classifiers and rerankers (nanoserve/classify.py, nanoserve/rerank.py), held in
float32 at 1e-4 to transformers on tiny random checkpoints it saves:
- every registered family with a `*ForSequenceClassification` (one parametrised test over
  the registry, no family named; the heads in turn: single-label, multi-label, one-output
  reward): `AutoModelForSequenceClassification` logits over each row alone against nanoserve's
  packed batches (a row ending in pad tokens among them: transformers pools the last token
  that is not the pad); what the logits mean by transformers' `problem_type` rule;
- a causal LM as a reranker: the Qwen3-Reranker model card's computation (its prefix and
  suffix tokens, the user turn tokenized and cut to the limit between them, the last
  position's "no" / "yes" logits, log-softmax, exp) on transformers' `AutoModelForCausalLM`
  over each pair alone, a tiny Qwen3 with the default model's tokenizer;
- the refusals: a causal LM to classify, a base model, a GGUF file, a tokenizer without the
  reranker's tokens, a limit with no room for a pair (one line each).
The jobs over both: tests/test_classify_job.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from nanoserve.errors import InputError, ModelError
from nanoserve.model.families import FAMILIES
from nanoserve.testing import save_byte_tokenizer, save_tiny_family
from tests.hf_oracle import hf_tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "a b c d e f g",
         "what is a classifier?", "a longer document: " + "more words and more words " * 6]
PAD = 0  # the byte tokenizer's NUL byte: a row may end in it
HEADS = {"single": dict(num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"}),
         "multi": dict(num_labels=4, problem_type="multi_label_classification"),
         "reward": dict(num_labels=1)}
# each family with a classifier, the heads in turn (every head on two or more families)
CLASSIFIERS = [(f.model_type, sorted(HEADS)[i % len(HEADS)])
               for i, f in enumerate(f for f in FAMILIES if f.classifier)]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    return save_byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))


@functools.cache
def _hf(folder: str, cls: str):
    import transformers

    return getattr(transformers, cls).from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type,head", CLASSIFIERS)
def test_classifier_logits_equal_transformers(tmp_path, byte_tokenizer, model_type, head):
    from nanoserve.classify import DecoderClassifier, load_classifier

    folder = save_tiny_family(tmp_path / "m", model_type, byte_tokenizer, classifier=True,
                              pad_token_id=PAD, **HEADS[head])
    clf = load_classifier(folder, dtype="float32", device="cpu", max_batch_tokens=60)
    assert isinstance(clf, DecoderClassifier) and clf.config.is_classifier
    hf = _hf(str(folder), "AutoModelForSequenceClassification")
    ids = [hf_tokenizer(folder)(t)["input_ids"] for t in TEXTS]
    assert clf.tokenizer.encode(TEXTS)[0] == ids
    ids.append(ids[1] + [PAD, PAD])  # transformers pools the "o", not a pad
    got = torch.cat([clf.classify(TEXTS), clf.classify_ids(ids[-1:])])  # several batches
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([r])).logits for r in ids])
    assert got.shape == (len(ids), HEADS[head]["num_labels"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got[-1], got[1], atol=1e-5, rtol=0)
    problem = hf.config.problem_type or ("regression" if hf.config.num_labels == 1
                                         else "single_label_classification")
    assert clf.config.problem_type == problem
    preds = clf.predict(got)
    if problem == "regression":  # a reward model: its raw value
        assert [p.score for p in preds] == pytest.approx(want[:, 0].tolist(), abs=1e-4)
        return
    probs = torch.sigmoid(want) if problem.startswith("multi") else want.softmax(-1)
    names = [hf.config.id2label[i] for i in range(hf.config.num_labels)]
    for p, row in zip(preds, probs):
        assert list(p.probs) == names
        assert list(p.probs.values()) == pytest.approx(row.tolist(), abs=1e-4)
        assert p.label == names[int(row.argmax())]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory, smollm2_gguf_path):
    """A tiny Qwen3ForCausalLM with the default model's tokenizer (ChatML's <|im_start|> and
    <|im_end|>, single 'yes' and 'no' tokens)."""
    return save_tiny_family(tmp_path_factory.mktemp("reranker"), "qwen3", smollm2_gguf_path)


PAIRS = [("what is a panda?", "The giant panda is a bear native to south central China."),
         ("hello", "world"), ("capital of France", "Paris " * 40)]


def card_scores(folder, pairs, instruction, max_length):
    """The model card's transformers code on each pair alone: (no, yes) logits and P(yes)."""
    from nanoserve.rerank import PREFIX, SUFFIX

    tok, model = hf_tokenizer(folder), _hf(str(folder), "AutoModelForCausalLM")
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    prefix = tok.encode(PREFIX, add_special_tokens=False)
    suffix = tok.encode(SUFFIX, add_special_tokens=False)
    texts = [f"<Instruct>: {instruction}\n<Query>: {q}\n<Document>: {d}" for q, d in pairs]
    enc = tok(texts, padding=False, truncation="longest_first",
              max_length=max_length - len(prefix) - len(suffix))
    logits = []
    with torch.no_grad():
        for ids in enc["input_ids"]:
            last = model(torch.tensor([prefix + ids + suffix])).logits[0, -1]
            logits.append(torch.stack([last[no], last[yes]]))
    logits = torch.stack(logits)
    return logits, torch.log_softmax(logits, dim=1)[:, 1].exp()


def test_reranker_equals_the_model_cards_computation(reranker_dir):
    from nanoserve.classify import load_classifier, read_classifier
    from nanoserve.rerank import DEFAULT_INSTRUCTION, LABELS, Reranker

    rr = load_classifier(reranker_dir, dtype="float32", device="cpu", rerank=True)
    assert isinstance(rr, Reranker) and rr.config.id2label == LABELS == ("no", "yes")
    config, tokenizer = read_classifier(reranker_dir, rerank=True)
    assert config.id2label == LABELS and tokenizer.instruction == DEFAULT_INSTRUCTION
    limit = 96  # the long document is cut
    rr.tokenizer = rr.tokenizer.with_limit(limit)
    for instruction in (DEFAULT_INSTRUCTION, "Find the capital"):
        rr.tokenizer = rr.tokenizer.with_instruction(instruction)
        logits, p_yes = card_scores(reranker_dir, PAIRS, instruction, limit)
        torch.testing.assert_close(rr.score(PAIRS), logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(rr.rerank(PAIRS), p_yes, atol=1e-4, rtol=0)
    assert [rr.tokenizer.encode_row(q, d)[2] for q, d in PAIRS] == [False, False, True]
    assert len(rr.tokenizer.encode_row(*PAIRS[2])[0]) == limit
    preds = rr.predict(rr.score(PAIRS))  # the score job's label-1 probability is P(yes)
    assert [p.probs["yes"] for p in preds] == pytest.approx(p_yes.tolist(), abs=1e-5)


def test_refusals_are_one_line(tmp_path, tiny_model_dir, byte_tokenizer, smollm2_gguf_path):
    from nanoserve.classify import read_classifier
    from nanoserve.model.model import build_model
    from nanoserve.rerank import RerankTokenizer
    from nanoserve.testing import save_tiny_embedding
    from nanoserve.weights.weights import load_checkpoint

    checks = [(tiny_model_dir, False, "is a causal LM without a sequence-classification head"),
              (save_tiny_embedding(tmp_path / "base", smollm2_gguf_path), True, "has no head"),
              (smollm2_gguf_path, True, "not a checkpoint folder")]
    for folder, rerank, message in checks:
        with pytest.raises(ModelError, match=message) as e:
            read_classifier(folder, rerank=rerank)
        assert "\n" not in str(e.value) and "Qwen3ForSequenceClassification" in str(e.value)
        assert "BertForSequenceClassification" in str(e.value)
    # a causal LM whose tokenizer has no 'yes' token; a limit with no room beside the prompt
    folder = save_tiny_family(tmp_path / "bytes", "llama", byte_tokenizer)
    with pytest.raises(ModelError, match="no token 'no'"):
        read_classifier(folder, rerank=True)
    with pytest.raises(InputError, match="leaves no room"):
        RerankTokenizer.from_folder(smollm2_gguf_path, 50)
    # a classifier's model has no LM head: it does not generate, and says what it does
    classifier = save_tiny_family(tmp_path / "c", "qwen2", byte_tokenizer, classifier=True)
    model = build_model(*load_checkpoint(classifier))
    with pytest.raises(ModelError, match="no LM head: it classifies"):
        model.compute_logits(torch.zeros(1, 64))
