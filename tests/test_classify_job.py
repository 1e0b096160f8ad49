"""Classification and cross-encoder score jobs (`run_job(..., task="classify" | "score")`,
ray_jobs/tasks/classify.py), on the tests' local Ray (CPU), over tiny random encoders with
a sequence-classification head (nanoserve/encoder/testing.py). Oracles: transformers'
`AutoModelForSequenceClassification` over each row alone (its tokenizer cutting to the
limit), softmax / sigmoid in float32; sentence-transformers' `CrossEncoder.predict` for
the score task. A decoder classifier and a causal-LM reranker (tiny Qwen3s with the default
model's tokenizer) through the commands: each row equal to the library's call on the row
alone (`nanoserve.load_classifier`, itself held to transformers in
tests/test_decoder_classifiers.py)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import torch

from nanoserve.encoder.testing import save_tiny_encoder
from nanoserve.errors import InputError, ModelError
from ray_jobs import run_job

LONG = "the quick brown fox jumps over the lazy dog " * 12  # above BERT's 64 positions
TEXTS = ["great film", "dull", "the quick brown fox jumps over the lazy dog", "hello world",
         "what is an encoder", LONG, "a b c d e f g", "film of words", "query passage",
         "longer document more words", "the dog"]
ROWS = [{"text": t} for t in TEXTS[:4]] + [{"text": "   "}] + [{"text": t} for t in TEXTS[4:]] \
    + [{"text": None}]
BAD = {4: "empty text", 12: "no text"}  # row position -> its error
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(out):
    return {r["id"]: r for r in ds.dataset(out).to_table().to_pylist()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify-job")
    return {
        "single": save_tiny_encoder(root / "single", "bert", head=True, num_labels=3,
                                    id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),
        "multi": save_tiny_encoder(root / "multi", "bert", head=True, num_labels=4, seed=1,
                                   problem_type="multi_label_classification"),
        "reward": save_tiny_encoder(root / "reward", "xlm-roberta", head=True, num_labels=1,
                                    seed=2),
        "cross": save_tiny_encoder(root / "cross", "bert", head=True, num_labels=1, seed=3),
        "cross2": save_tiny_encoder(root / "cross2", "xlm-roberta", head=True, num_labels=2,
                                    seed=4),
    }


def hf_logits(folder, text, text_2=None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    enc = tok(text, text_2, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**enc).logits[0].float(), model.config


def check_classify(rows, folder, multi=False, regression=False):
    assert sorted(rows) == list(range(len(ROWS)))
    for i, row in enumerate(ROWS):
        got = rows[i]
        if i in BAD:
            assert got["error"] is not None and BAD[i] in got["error"], got
            assert "\n" not in got["error"]
            assert got["label"] is None and got["probs"] is None and got["score"] is None
            continue
        assert got["error"] is None, got["error"]
        logits, config = hf_logits(folder, row["text"])
        if regression:
            assert got["label"] is None and got["probs"] is None
            assert got["score"] == pytest.approx(float(logits[0]), abs=1e-4)
            continue
        probs = torch.sigmoid(logits) if multi else torch.softmax(logits, -1)
        want = {config.id2label[k]: float(p) for k, p in enumerate(probs)}
        got_probs = dict(got["probs"])
        assert list(got_probs) == list(want)
        for label, p in want.items():
            assert got_probs[label] == pytest.approx(p, abs=1e-4), (i, label)
        assert got["label"] == (None if multi else config.id2label[int(probs.argmax())])
        assert got["score"] is None


def test_classify_job_equals_transformers_and_resumes(ray_session, models, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    kw = dict(model=str(models["single"]), task="classify", batch_size=4, progress=False)
    summary = run_job(src, out, **kw)
    assert (summary.rows, summary.error_rows, summary.truncated_rows) == (len(ROWS), 2, 1)
    assert "truncated: 1 row(s)" in summary.format()
    table = ds.dataset(out).to_table()
    assert table.column_names == ["id", "text", "label", "probs", "score", "num_input_tokens",
                                  "error"]
    assert table.schema.field("probs").type == pa.map_(pa.string(), pa.float64())
    rows = read(out)
    assert rows[5 + 1]["num_input_tokens"] == 64  # LONG: cut to the model's positions
    check_classify(rows, models["single"])
    again = run_job(src, out, **kw)  # complete: nothing computed again
    assert again.rows == 0 and again.rows_resumed == len(ROWS)
    with pytest.raises(InputError, match="limit"):
        run_job(src, out, **{**kw, "max_input_tokens": 32})


def test_multi_label_and_regression_heads(ray_session, models, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    run_job(src, tmp_path / "multi", model=str(models["multi"]), task="classify",
            batch_size=5, progress=False)
    check_classify(read(tmp_path / "multi"), models["multi"], multi=True)
    run_job(src, tmp_path / "reward", model=str(models["reward"]), task="classify",
            batch_size=5, progress=False)
    check_classify(read(tmp_path / "reward"), models["reward"], regression=True)


PAIRS = [("what is an encoder", "an encoder of words"), ("hello", "world"),
         ("query", LONG), ("the dog", "the lazy dog"), ("film", "a great film")]


def cross_encoder_scores(folder, pairs, two_labels=False):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folder), device="cpu")
    if two_labels:
        return model.predict(pairs, apply_softmax=True)[:, 1].tolist()
    return model.predict(pairs, activation_fn=torch.nn.Identity()).tolist()


def test_score_job_equals_cross_encoder(ray_session, models, tmp_path):
    rows = [{"text_1": a, "text_2": b} for a, b in PAIRS] + [{"text_1": "only one"}]
    src = write_rows(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "scores"
    kw = dict(model=str(models["cross"]), task="score", batch_size=2, progress=False)
    summary = run_job(src, out, **kw)
    assert (summary.rows, summary.error_rows, summary.truncated_rows) == (len(rows), 1, 1)
    got = read(out)
    assert ds.dataset(out).to_table().column_names == ["id", "text_1", "text_2", "score",
                                                       "num_input_tokens", "error"]
    want = cross_encoder_scores(models["cross"], PAIRS)
    for i, w in enumerate(want):
        assert got[i]["error"] is None and got[i]["score"] == pytest.approx(w, abs=1e-4)
    assert got[len(PAIRS)]["score"] is None and "text_2" in got[len(PAIRS)]["error"]
    assert run_job(src, out, **kw).rows_resumed == len(rows)
    # the same folder, another task: refused
    with pytest.raises(InputError, match="other settings"):
        run_job(src, out, **{**kw, "task": "classify", "prompt_column": "text_1"})
    # a two-label head, pairs as query + document: the probability of label 1
    qd = write_rows(tmp_path / "qd.jsonl", [{"query": a, "document": b} for a, b in PAIRS])
    run_job(qd, tmp_path / "two", model=str(models["cross2"]), task="score", progress=False)
    got = read(tmp_path / "two")
    for i, w in enumerate(cross_encoder_scores(models["cross2"], PAIRS, two_labels=True)):
        assert got[i]["score"] == pytest.approx(w, abs=1e-4)


def test_job_level_refusals(models, tiny_model_dir, tmp_path):
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(ModelError, match="BertForSequenceClassification") as e:
        run_job(src, tmp_path / "out", model=str(tiny_model_dir), task="classify")
    assert "\n" not in str(e.value) and "LlamaForCausalLM" in str(e.value)
    with pytest.raises(InputError, match="text_1 and text_2"):
        run_job(src, tmp_path / "out", model=str(models["cross"]), task="score")
    with pytest.raises(InputError, match="one output or two labels"):
        run_job(write_rows(tmp_path / "p.jsonl", [{"text_1": "a", "text_2": "b"}]),
                tmp_path / "out", model=str(models["single"]), task="score")
    with pytest.raises(InputError, match="applies to a causal-LM reranker"):
        run_job(write_rows(tmp_path / "p.jsonl", [{"text_1": "a", "text_2": "b"}]),
                tmp_path / "out", model=str(models["cross"]), task="score", instruction="x")


def test_nanoserve_classify_and_score_commands(ray_session, models, tmp_path, capsys):
    from nanoserve_cli import main

    for command in ("classify", "score"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "--max-input-tokens" in text and "--batch-size" in text and "--model" in text
    src = write_rows(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out"
    assert main(["classify", str(src), "-o", str(out), "--model", str(models["single"]),
                 "--max-input-tokens", "16", "--no-truncate", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "rows: 13 (3 error rows)" in printed and "truncated: 0 row(s)" in printed
    assert "above the limit of 16" in read(out)[6]["error"]
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"text_1": a, "text_2": b} for a, b in PAIRS])
    assert main(["score", str(pairs), "-o", str(tmp_path / "s"), "--model",
                 str(models["cross"]), "--no-progress"]) == 0
    assert main(["classify", str(src), "-o", str(tmp_path / "d"), "--model",
                 str(models["single"]).rsplit("/", 1)[0] + "/nothing", "--no-progress"]) == 2


def test_data_processor_classifies_and_scores(ray_session, models):
    import ray.data

    from ray_jobs.data_processor import build_processor

    process = build_processor(str(models["single"]), task="classify", num_gpus=0, batch_size=4)
    out = process(ray.data.from_items([{"id": i, **r} for i, r in enumerate(ROWS)])).take_all()
    check_classify({r["id"]: r for r in out}, models["single"])
    process = build_processor(str(models["cross"]), task="score", num_gpus=0, batch_size=2)
    out = process(ray.data.from_items([{"text_1": a, "text_2": b} for a, b in PAIRS])).take_all()
    want = cross_encoder_scores(models["cross"], PAIRS)
    assert [r["score"] for r in out] == pytest.approx(want, abs=1e-4)
    with pytest.raises(InputError, match="not a classify option"):
        build_processor(str(models["single"]), task="classify", num_gpus=0, pooling="mean")


@pytest.fixture(scope="module")
def decoders(tmp_path_factory, smollm2_gguf_path):
    """A Qwen3ForSequenceClassification of three labels and a Qwen3ForCausalLM (a reranker),
    tiny and random, with the default model's tokenizer."""
    from nanoserve.testing import save_tiny_family

    root = tmp_path_factory.mktemp("decoder-jobs")
    return {"classifier": save_tiny_family(root / "classifier", "qwen3", smollm2_gguf_path,
                                           classifier=True, num_labels=3, id2label=LABELS),
            "reranker": save_tiny_family(root / "reranker", "qwen3", smollm2_gguf_path)}


INSTRUCTION = "Given a question, find the passage that answers it"


def test_decoder_classifier_and_reranker_commands(ray_session, decoders, tmp_path, capsys):
    """`nanoserve classify` on a decoder classifier, `nanoserve score` with a causal LM as a
    reranker (an instruction, a limit that cuts the long document): each row's columns are
    the library's on the row alone. A causal LM to classify, a rerun with another
    instruction: refused in one line, before any work."""
    from nanoserve import load_classifier
    from nanoserve_cli import main

    src = write_rows(tmp_path / "in.jsonl", ROWS)
    model = ["--model", str(decoders["classifier"]), "--no-progress"]
    assert main(["classify", str(src), "-o", str(tmp_path / "labels"), *model]) == 0
    assert "rows: 13 (2 error rows)" in capsys.readouterr().out
    rows = read(tmp_path / "labels")
    clf = load_classifier(decoders["classifier"], dtype="float32", device="cpu")
    for i, row in enumerate(ROWS):
        if i in BAD:
            assert BAD[i] in rows[i]["error"] and rows[i]["probs"] is None
            continue
        (pred,) = clf.predict(clf.classify([row["text"]]))
        assert (rows[i]["label"], rows[i]["score"], rows[i]["error"]) == (pred.label, None, None)
        assert dict(rows[i]["probs"]) == pytest.approx(pred.probs, abs=1e-5)
        assert rows[i]["num_input_tokens"] == len(clf.tokenizer.encode([row["text"]])[0][0])

    pairs = [{"query": q, "document": d} for q, d in PAIRS] + [{"query": "no document"}]
    src = write_rows(tmp_path / "pairs.jsonl", pairs)
    score = ["score", str(src), "-o", str(tmp_path / "rr"), "--model", str(decoders["reranker"]),
             "--max-input-tokens", "100", "--no-progress"]
    assert main([*score, "--instruction", INSTRUCTION]) == 0
    assert "truncated: 1 row(s)" in capsys.readouterr().out
    got = read(tmp_path / "rr")
    rr = load_classifier(decoders["reranker"], dtype="float32", device="cpu", rerank=True)
    rr.tokenizer = rr.tokenizer.with_limit(100).with_instruction(INSTRUCTION)
    for i, p in enumerate(rr.rerank(PAIRS).tolist()):
        assert got[i]["error"] is None and got[i]["score"] == pytest.approx(p, abs=1e-5)
        assert got[i]["num_input_tokens"] == len(rr.tokenizer.encode_row(*PAIRS[i])[0])
    assert got[len(PAIRS)]["score"] is None and "document" in got[len(PAIRS)]["error"]
    assert main([*score, "--instruction", "another"]) == 2
    assert "other settings" in capsys.readouterr().err
    src = write_rows(tmp_path / "texts.jsonl", ROWS)
    assert main(["classify", str(src), "-o", str(tmp_path / "lm"), "--model",
                 str(decoders["reranker"]), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a causal LM without a sequence-classification head" in err
