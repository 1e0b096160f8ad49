"""Encoders (nanoserve/encoder/): BERT, XLM-RoBERTa and ModernBERT, each a tiny random
checkpoint saved by transformers (`nanoserve.encoder.testing`; ModernBERT with 3 layers,
global attention every 2 and a window of +- 2, so both kinds of layer run over rows longer
than the window), held in float32 at 1e-4 to independent oracles:
- transformers' `AutoModel` last hidden states, each row alone and unpadded, against
  nanoserve's packed batch of rows of different lengths;
- `AutoModelForSequenceClassification` logits (single-label, multi-label, one-output
  regression; ModernBERT with cls and mean pooling);
- sentence-transformers' `SentenceTransformer.encode` (mean pooling + Normalize) against
  `Embedder.load` and `Encoder.embed`, and `CrossEncoder.predict` on text pairs against
  `Encoder.score`;
- transformers' tokenizer (`AutoTokenizer` on the same files) for the ids, pairs' segment
  ids and truncation to the model's max positions.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from nanoserve.encoder.testing import save_tiny_encoder
from nanoserve.errors import ModelError

TYPES = ["bert", "xlm-roberta", "modernbert"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "hello", "a b c d e f g",
         "what is an encoder?",
         "a longer document: " + "more words and more words " * 20]  # cut to max positions
PAIRS = [("what is an encoder?", "an encoder of words"), ("hello", "world"),
         ("the quick brown fox", "jumps over the lazy dog " * 12)]


@functools.cache
def _hf(folder: str, head: bool):
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if head else AutoModel
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


@functools.cache
def _hf_tok(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def hf_encode(folder, texts, pairs=False):
    """transformers' tokenizer on the folder's files, truncating to the model's limit."""
    tok = _hf_tok(str(folder))
    args = ([a for a, _ in texts], [b for _, b in texts]) if pairs else (texts,)
    enc = tok(*args, truncation=True)
    return enc["input_ids"], enc.get("token_type_ids")


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    return {t: save_tiny_encoder(tmp_path_factory.mktemp(f"{t}-base"), t) for t in TYPES}


def _packed(model, rows, types=None):
    cu = torch.zeros(len(rows) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor([len(r) for r in rows]), 0)
    flat = torch.tensor([t for r in rows for t in r])
    tt = torch.tensor([t for r in types for t in r]) if types is not None else None
    return flat, cu, tt


@pytest.mark.parametrize("model_type", TYPES)
def test_last_hidden_states_equal_transformers(base_dirs, model_type):
    """Our packed batch (rows of different lengths back to back) against transformers' base
    model over each row alone; our tokenizer's ids are transformers' (texts cut to the
    model's max positions)."""
    from nanoserve.encoder import Encoder

    folder = base_dirs[model_type]
    enc = Encoder.load(folder, dtype="float32", device="cpu")
    assert enc.config.headless and enc.config.family.model_type == model_type
    ids, _ = enc.tokenizer.encode(TEXTS)
    want_ids, _ = hf_encode(folder, TEXTS)
    assert ids == want_ids
    assert len(ids[-1]) == enc.config.max_position_embeddings  # the long text was cut
    if model_type == "modernbert":  # rows longer than the local window: both kinds run
        assert enc.config.layer_types == ("full_attention", "sliding_attention", "full_attention")
        assert min(len(r) for r in ids) > enc.config.local_attention + 1  # window +- 2
    flat, cu, _ = _packed(enc.model, ids)
    with torch.no_grad():
        got = enc.model.encode(flat, cu)
        hf = _hf(str(folder), False)
        want = torch.cat([hf(torch.tensor([r])).last_hidden_state[0] for r in ids])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


CLASSIFIERS = [
    ("bert", dict(num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"})),
    ("bert", dict(num_labels=4, problem_type="multi_label_classification")),
    ("bert", dict(num_labels=1)),
    ("xlm-roberta", dict(num_labels=3)),
    ("xlm-roberta", dict(num_labels=2, problem_type="multi_label_classification")),
    ("xlm-roberta", dict(num_labels=1, problem_type="regression")),
    ("modernbert", dict(num_labels=3, classifier_pooling="cls")),
    ("modernbert", dict(num_labels=3, classifier_pooling="mean",
                        problem_type="multi_label_classification")),
    ("modernbert", dict(num_labels=1)),
]


@pytest.mark.parametrize("model_type,options", CLASSIFIERS,
                         ids=[f"{t}-{o['num_labels']}-{o.get('problem_type', '')}"
                              f"{o.get('classifier_pooling', '')}" for t, o in CLASSIFIERS])
def test_classification_logits_equal_transformers(tmp_path, model_type, options):
    from nanoserve.encoder import Encoder

    folder = save_tiny_encoder(tmp_path / "m", model_type, head=True, **options)
    enc = Encoder.load(folder, dtype="float32", device="cpu", max_batch_tokens=40)
    got = enc.classify(TEXTS)  # several packed batches
    ids, types = hf_encode(folder, TEXTS)
    hf = _hf(str(folder), True)
    with torch.no_grad():
        want = torch.cat([hf(torch.tensor([r])).logits for r in ids])
    assert got.shape == (len(TEXTS), options["num_labels"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # what the logits mean: transformers' problem_type rule
    preds = enc.predict(got)
    problem = hf.config.problem_type or ("regression" if options["num_labels"] == 1
                                         else "single_label_classification")
    assert enc.config.problem_type == problem
    if problem == "regression":
        assert [p.score for p in preds] == pytest.approx(want[:, 0].tolist(), abs=1e-4)
    else:
        probs = torch.sigmoid(want) if problem.startswith("multi") else want.softmax(-1)
        names = [hf.config.id2label[i] for i in range(options["num_labels"])]
        for p, row in zip(preds, probs):
            assert list(p.probs) == names
            assert list(p.probs.values()) == pytest.approx(row.tolist(), abs=1e-4)
            assert p.label == names[int(row.argmax())]


def test_sentence_transformers_encode_agrees(tmp_path):
    """A BERT embedding folder (mean pooling, Normalize, max_seq_length 16): Embedder.load
    routes it to the encoder; both it and Encoder.embed give sentence-transformers' vectors."""
    import sentence_transformers

    from nanoserve.embed import Embedder
    from nanoserve.encoder import Encoder
    from nanoserve.encoder.model import EncoderModel

    folder = save_tiny_encoder(tmp_path / "st", "bert", sentence_transformers="mean",
                               max_seq_length=16)
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    want = torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True))
    emb = Embedder.load(str(folder), dtype="float32", device="cpu", max_batch_tokens=30)
    assert isinstance(emb.model, EncoderModel)
    assert (emb.pooling.pooling, emb.pooling.normalize, emb.limit) == ("mean", True, 16)
    assert emb.prepare(TEXTS)[1] == 1  # the long text cut, its [SEP] kept
    torch.testing.assert_close(emb.embed(TEXTS), want, atol=1e-4, rtol=0)
    enc = Encoder.load(folder, dtype="float32", device="cpu")
    torch.testing.assert_close(enc.embed(TEXTS), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["xlm-roberta", "modernbert"])
def test_embedder_on_a_bare_encoder_pools_by_mean(base_dirs, model_type):
    """No sentence-transformers files: mean pooling (sentence-transformers' default for a
    bare encoder), normalised, cut to the max positions."""
    import sentence_transformers

    from nanoserve.embed import Embedder

    folder = base_dirs[model_type]
    emb = Embedder.load(str(folder), dtype="float32", device="cpu")
    assert emb.pooling.pooling == "mean"
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    want = torch.nn.functional.normalize(
        torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True)), dim=-1)
    torch.testing.assert_close(emb.embed(TEXTS), want, atol=1e-4, rtol=0)


def test_cross_encoder_scores_equal_sentence_transformers(tmp_path):
    """A BERT cross-encoder (one output): pairs encoded with segment ids 0 / 1 as
    transformers' tokenizer does, the longer text cut first; sentence-transformers'
    `CrossEncoder.predict` (sigmoid of the logit by default, raw with Identity)."""
    from sentence_transformers import CrossEncoder

    from nanoserve.encoder import Encoder

    folder = save_tiny_encoder(tmp_path / "ce", "bert", head=True, num_labels=1)
    enc = Encoder.load(folder, dtype="float32", device="cpu")
    ids, types = enc.tokenizer.encode_pairs(PAIRS)
    want_ids, want_types = hf_encode(folder, PAIRS, pairs=True)
    assert (ids, types) == (want_ids, want_types)
    assert any(1 in t for t in types) and len(ids[-1]) == enc.config.max_position_embeddings
    got = enc.score(PAIRS)
    ce = CrossEncoder(str(folder), device="cpu")
    raw = torch.as_tensor(ce.predict(PAIRS, activation_fn=torch.nn.Identity()))
    torch.testing.assert_close(got[:, 0], raw, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.sigmoid(got[:, 0]), torch.as_tensor(ce.predict(PAIRS)),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", TYPES)
def test_config_defaults_equal_transformers(model_type):
    """A config.json with only the required keys reads as transformers' full one does."""
    from transformers import AutoConfig

    from nanoserve.encoder.config import EncoderConfig
    from nanoserve.model.encoder_families import encoder_by_model_type

    family = encoder_by_model_type(model_type)
    shape = dict(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                 intermediate_size=48)
    full = {**AutoConfig.for_model(model_type, **shape).to_dict(),
            "architectures": [family.base_model]}
    minimal = {**shape, "model_type": model_type, "architectures": [family.base_model]}
    assert EncoderConfig.from_hf_dict(minimal) == EncoderConfig.from_hf_dict(full)
    headed = {**full, "architectures": [family.architecture]}
    assert EncoderConfig.from_hf_dict(headed).id2label == ("LABEL_0", "LABEL_1")


def test_records_are_transformers_classes_and_listed_in_errors():
    import transformers

    from nanoserve.encoder.config import EncoderConfig
    from nanoserve.model.encoder_families import ENCODERS, encoder_by_architecture
    from nanoserve.model.families import supported

    for family in ENCODERS:
        for arch in (family.architecture, family.base_model):
            assert encoder_by_architecture(arch) is family
            assert getattr(transformers, arch).config_class.model_type == family.model_type
            assert f"{arch}" in supported()
    with pytest.raises(ModelError, match="unsupported encoder 'RobertaModel'.*BertModel"):
        EncoderConfig.from_hf_dict({"architectures": ["RobertaModel"], "model_type": "roberta"})


def test_bad_checkpoints_are_refused(tmp_path, base_dirs):
    from nanoserve.encoder.config import EncoderConfig
    from nanoserve.encoder.model import load_encoder

    with pytest.raises(ModelError, match="position_embedding_type"):
        EncoderConfig.from_hf_dict({"architectures": ["BertModel"], "model_type": "bert",
                                    "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "intermediate_size": 8,
                                    "position_embedding_type": "relative_key"})
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in base_dirs["bert"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["encoder.layer.1.attention.self.key.bias"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelError, match="encoder.layer.1.attention.self.key.bias"):
        load_encoder(bad)
    d = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**d, "hidden_size": 48}))
    with pytest.raises(ModelError, match="shape"):
        load_encoder(bad)
