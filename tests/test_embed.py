"""Embeddings (nanoserve/embed.py, LLM.embed): tiny headless checkpoints saved by
transformers, whose tokenizer closes every text with `<|endoftext|>` as Qwen3-Embedding's
does, give the vectors of transformers' base model + the documented pooling over the ids
transformers' own tokenizer gives (`AutoTokenizer` on the same files, truncating to the
limit), and those of sentence-transformers' `encode` on the same folder (in the test
extra: never skipped).

What these tests catch (each is a mutation in `tests/mutations.py`, run there to see it
fail):
- truncation that cuts the closing token off (a plain cut to the limit, where last-token
  pooling then reads a word instead of the end token):
  `test_truncation_keeps_the_closing_token`, and sentence-transformers' comparison;
- mean pooling over a wrong count (its scale: hidden by L2 normalisation, so each pooling
  is also compared unnormalised): `test_llm_embed_matches_transformers[mean]`.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from nanoserve.errors import InputError, ModelError
from nanoserve.testing import save_tiny_embedding

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello", "a b c d e f g",
         "Embeddings of a longer document: " + "words and more words " * 12]
CLOSING = "<|endoftext|>"  # Qwen3-Embedding's tokenizer appends it; last-token pooling reads it


@pytest.fixture(scope="module")
def qwen3_embed_dir(tmp_path_factory, smollm2_gguf_path):
    return save_tiny_embedding(tmp_path_factory.mktemp("qwen3-embed"), smollm2_gguf_path,
                               closing_token=CLOSING)


@pytest.fixture(scope="module")
def st_mean_dir(tmp_path_factory, smollm2_gguf_path):
    """A tiny Qwen3Model with sentence-transformers' files: mean pooling, no Normalize,
    max_seq_length 24."""
    return save_tiny_embedding(tmp_path_factory.mktemp("qwen3-st"), smollm2_gguf_path,
                               pooling="mean", normalize=False, max_seq_length=24,
                               closing_token=CLOSING)


@pytest.fixture(scope="module")
def st_last_dir(tmp_path_factory, smollm2_gguf_path):
    """Qwen3-Embedding's layout: last-token pooling, Normalize, max_seq_length 12 (the
    longest text is cut)."""
    return save_tiny_embedding(tmp_path_factory.mktemp("qwen3-st-last"), smollm2_gguf_path,
                               pooling="lasttoken", normalize=True, max_seq_length=12,
                               closing_token=CLOSING)


@functools.lru_cache(maxsize=8)
def _hf_model(folder: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def hf_ids(folder, texts, limit=None):
    """Token ids from transformers' tokenizer on the model's files (not nanoserve's), cut to
    `limit` the way transformers cuts (the closing token kept)."""
    tok = _hf_tokenizer(str(folder))
    return [tok(t, truncation=limit is not None, max_length=limit)["input_ids"] for t in texts]


def oracle(folder, ids_list, pooling="last", normalize=True, dimensions=None):
    """transformers' base model (float32) over each row alone, then the pooling."""
    model = _hf_model(str(folder))
    out = []
    with torch.no_grad():
        for ids in ids_list:
            h = model(torch.tensor([ids])).last_hidden_state[0]  # [T, d]
            v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
            if dimensions:
                v = v[:dimensions]
            if normalize:
                v = torch.nn.functional.normalize(v, dim=-1)
            out.append(v)
    return torch.stack(out)


@pytest.fixture(scope="module")
def qwen3_llm(qwen3_embed_dir):
    from nanoserve.llm import LLM

    return LLM(str(qwen3_embed_dir), dtype="float32", device="cpu", kv_cache_bytes=1 << 20)


def test_headless_checkpoint_loads_and_refuses_to_generate(qwen3_llm):
    assert qwen3_llm.config.headless
    from nanoserve.sampling.params import SamplingParams

    with pytest.raises(ModelError, match="no LM head"):
        qwen3_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_llm_embed_matches_transformers(qwen3_llm, qwen3_embed_dir, pooling):
    ids = hf_ids(qwen3_embed_dir, TEXTS)
    closing = _hf_tokenizer(str(qwen3_embed_dir)).convert_tokens_to_ids(CLOSING)
    assert all(row[-1] == closing for row in ids)
    got = qwen3_llm.embed(TEXTS, pooling=pooling)
    want = oracle(qwen3_embed_dir, ids, pooling)
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), 64)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    # unnormalised, so the pooling's own scale shows (normalisation hides a mean's count)
    raw = qwen3_llm.embed(TEXTS, pooling=pooling, normalize=False)
    torch.testing.assert_close(raw, oracle(qwen3_embed_dir, ids, pooling, normalize=False),
                               atol=1e-4, rtol=1e-5)


def test_batch_equals_rows_alone_and_dimensions(qwen3_llm, qwen3_embed_dir):
    many = [TEXTS[i % len(TEXTS)] + f" {i}" for i in range(23)]
    together = qwen3_llm.embed(many, max_batch_tokens=64)  # several packed batches
    alone = torch.cat([qwen3_llm.embed([t]) for t in many])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    short = qwen3_llm.embed(TEXTS, dimensions=16, normalize=True)
    ids = hf_ids(qwen3_embed_dir, TEXTS)
    torch.testing.assert_close(short, oracle(qwen3_embed_dir, ids, dimensions=16),
                               atol=1e-4, rtol=0)


def test_instruction_and_token_ids(qwen3_llm, qwen3_embed_dir):
    got = qwen3_llm.embed(["what is a fox?"], instruction="Retrieve passages")
    text = "Instruct: Retrieve passages\nQuery:what is a fox?"
    (ids,) = hf_ids(qwen3_embed_dir, [text])
    torch.testing.assert_close(got, oracle(qwen3_embed_dir, [ids]), atol=1e-4, rtol=0)
    torch.testing.assert_close(qwen3_llm.embed([ids]), got, atol=1e-6, rtol=0)


def test_sentence_transformers_config_is_read(st_mean_dir):
    from nanoserve.embed import Embedder

    emb = Embedder.load(str(st_mean_dir), dtype="float32", device="cpu")
    assert (emb.pooling.pooling, emb.pooling.normalize, emb.limit) == ("mean", False, 24)
    rows, cut = emb.prepare(TEXTS)
    assert cut == 1 and rows == hf_ids(st_mean_dir, TEXTS, limit=24)
    want = oracle(st_mean_dir, rows, "mean", normalize=False)
    torch.testing.assert_close(emb.embed_ids(rows), want, atol=1e-4, rtol=0)
    # flags win over the folder
    flagged = Embedder.load(str(st_mean_dir), dtype="float32", device="cpu", pooling="last",
                            normalize=True)
    torch.testing.assert_close(flagged.embed_ids(rows), oracle(st_mean_dir, rows),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("limit", [6, 12, 2])
def test_truncation_keeps_the_closing_token(qwen3_embed_dir, limit):
    """Texts above the limit are cut as transformers' tokenizer cuts them: the first
    limit - 1 tokens, then the closing token, which last-token pooling reads."""
    from nanoserve.embed import Embedder

    emb = Embedder.load(str(qwen3_embed_dir), dtype="float32", device="cpu",
                        max_input_tokens=limit)
    rows, cut = emb.prepare(TEXTS)
    want = hf_ids(qwen3_embed_dir, TEXTS, limit=limit)
    assert rows == want
    assert cut == sum(len(r) > limit for r in hf_ids(qwen3_embed_dir, TEXTS)) > 0
    closing = _hf_tokenizer(str(qwen3_embed_dir)).convert_tokens_to_ids(CLOSING)
    assert all(len(r) <= limit and r[-1] == closing for r in rows)
    torch.testing.assert_close(emb.embed(TEXTS), oracle(qwen3_embed_dir, want), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_llama_and_mistral_base_models(tmp_path, smollm2_gguf_path, family):
    from nanoserve.embed import Embedder

    folder = save_tiny_embedding(tmp_path / family, smollm2_gguf_path, family=family)
    emb = Embedder.load(str(folder), dtype="float32", device="cpu", pooling="mean")
    rows, _ = emb.prepare(TEXTS[:3])
    assert rows == hf_ids(folder, TEXTS[:3])
    torch.testing.assert_close(emb.embed_ids(rows), oracle(folder, rows, "mean"),
                               atol=1e-4, rtol=0)


def test_bad_inputs_and_settings(qwen3_llm, st_mean_dir, tmp_path):
    with pytest.raises(InputError, match="empty"):
        qwen3_llm.embed(["fine", "   "])
    with pytest.raises(InputError, match="pooling"):
        qwen3_llm.embed(["x"], pooling="max")
    with pytest.raises(InputError, match="hidden size"):
        qwen3_llm.embed(["x"], dimensions=65)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in st_mean_dir.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    (bad / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Dense"}]))
    from nanoserve.embed import Embedder

    with pytest.raises(ModelError, match="Dense"):
        Embedder.load(str(bad), dtype="float32", device="cpu")


@pytest.mark.parametrize("folder", ["st_last_dir", "st_mean_dir"])
def test_sentence_transformers_encode_agrees(folder, request):
    """sentence-transformers' `encode` over the same folder: its tokenizer, truncation to
    max_seq_length, pooling and normalisation against nanoserve's."""
    import sentence_transformers

    from nanoserve.embed import Embedder

    path = request.getfixturevalue(folder)
    model = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    emb = Embedder.load(str(path), dtype="float32", device="cpu")
    assert emb.prepare(TEXTS)[1] == 1  # the longest text is cut
    want = torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True))
    torch.testing.assert_close(emb.embed(TEXTS), want, atol=1e-4, rtol=0)


def test_pooling_settings_from_files(tmp_path):
    """sentence-transformers' newer `pooling_mode` key; include_prompt false with an
    instruction is refused for mean pooling (nanoserve would average the prompt in)."""
    from nanoserve.embed import resolve_pooling, sentence_transformers_settings

    (tmp_path / "modules.json").write_text(json.dumps(
        [{"type": "sentence_transformers.models.Transformer", "path": ""},
         {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode": "mean", "include_prompt": False}))
    assert sentence_transformers_settings(tmp_path) == {
        "normalize": False, "pooling": "mean", "include_prompt": False}
    assert resolve_pooling(tmp_path, 64, 512).max_input_tokens == 512
    with pytest.raises(InputError, match="include_prompt"):
        resolve_pooling(tmp_path, 64, 512, instruction="Retrieve")
    assert resolve_pooling(tmp_path, 64, 512, instruction="Retrieve", pooling="last").pooling \
        == "last"
