"""Small real checkpoints for tests and benchmarks (needs the `test` extra: transformers).

`save_tiny_llama` writes a tiny random `LlamaForCausalLM` through transformers' own
`save_pretrained` (so the engine loads it through the real checkpoint path), with a real
tokenizer: batch jobs over it run in seconds on a CPU and still tokenize text as the model
they stand in for would.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(folder: str | Path, tokenizer_source: str | Path) -> Path:
    """A tiny random LlamaForCausalLM (hidden 64, 2 layers, GQA 4:2, tied embeddings, seed 0)
    saved in `folder`, with the tokenizer of `tokenizer_source` (a model path) as its
    tokenizer.json; returns `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanoserve.tokenizer import Tokenizer

    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    return folder


def save_tiny_family(folder: str | Path, family: str, tokenizer_source: str | Path, *,
                     sliding_window: int | None = None, chat_template: str | None = None,
                     special_tokens: dict[str, str] | None = None,
                     eos_tokens: tuple[str, ...] = ()) -> Path:
    """A tiny random checkpoint of `family` ('qwen2', 'qwen3' or 'mistral'; hidden 64,
    2 layers, GQA 4:2, untied, seed 0, random norm weights and biases) through transformers'
    own class, with the tokenizer of `tokenizer_source`. `sliding_window`: Mistral's on
    every layer; Qwen's (use_sliding_window) on layer 1 only. `chat_template` and
    `special_tokens` ({'bos_token': ..., 'eos_token': ...}) go into tokenizer_config.json,
    `eos_tokens` (token strings) into generation_config.json."""
    import json

    import torch
    import transformers

    from nanoserve.tokenizer import Tokenizer

    names = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    config_cls = getattr(transformers, f"{names[family]}Config")
    model_cls = getattr(transformers, f"{names[family]}ForCausalLM")
    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    window = {"sliding_window": sliding_window}
    if family != "mistral":
        window.update(use_sliding_window=sliding_window is not None, max_window_layers=1)
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2, **window)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    tokenizer_config = dict(special_tokens or {})
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    if tokenizer_config:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if eos_tokens:
        ids = [tok.token_to_id(t) for t in eos_tokens]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return folder


__all__ = ["save_tiny_embedding", "save_tiny_family", "save_tiny_llama"]


def assert_rows_match_engine(llm, prompts: list[str], rows: list[dict], max_tokens: int) -> None:
    """The batch job's oracle check: `rows` (output rows of a job over the text `prompts`,
    row id = position) hold every prompt exactly once, and each row's tokens, text and
    finish reason are what `llm.generate` gives that prompt alone (greedy, `max_tokens`)."""
    from nanoserve.sampling import SamplingParams

    assert sorted(r["id"] for r in rows) == list(range(len(prompts)))
    for row in rows:
        ids = llm.tokenizer.encode(prompts[row["id"]])
        (want,) = llm.generate([ids], [SamplingParams(max_tokens=max_tokens)])
        assert row["error"] is None, row["error"]
        assert row["generated_token_ids"] == want.token_ids, row["id"]
        assert row["generated_text"] == want.text, row["id"]
        assert row["finish_reason"] == want.finish_reason, row["id"]


def save_tiny_byte_llama(folder: str | Path, seed: int = 0) -> Path:
    """A tiny random LlamaForCausalLM (saved by transformers) with a byte-level tokenizer of
    its own: ids 0..255 are the 256 bytes, 256 `<s>`, 257 `</s>` (EOS). Every string is
    some sequence of tokens, so grammars (structured outputs) work on it, with no files
    from elsewhere: the GPU tests' model for output controls."""
    import json

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=256, eos_token_id=257)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_char = sorted(alphabet, key=lambda c: _BYTE_ORDER(c))
    vocab = {c: i for i, c in enumerate(byte_char)}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
    return folder


def _BYTE_ORDER(char: str) -> int:
    """The byte a byte-level BPE character stands for (GPT-2's bytes-to-unicode map)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def save_tiny_embedding(folder: str | Path, tokenizer_source: str | Path, *,
                        family: str = "qwen3", pooling: str | None = None,
                        normalize: bool = True, max_seq_length: int | None = None) -> Path:
    """A tiny random headless checkpoint (transformers' `Qwen3Model`, `LlamaModel` or
    `MistralModel`: no LM head, tensors named without `model.`; hidden 64, 2 layers, GQA 4:2,
    seed 0, random norm weights) with the tokenizer of `tokenizer_source`. With `pooling`
    ('lasttoken', 'mean' or 'cls'), sentence-transformers' files too: `modules.json`
    (Transformer, Pooling, and Normalize when `normalize`), `1_Pooling/config.json` and,
    with `max_seq_length`, `sentence_bert_config.json`."""
    import json

    import torch
    import transformers

    from nanoserve.tokenizer import Tokenizer

    names = {"qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral"}
    config_cls = getattr(transformers, f"{names[family]}Config")
    model_cls = getattr(transformers, f"{names[family]}Model")
    folder = Path(folder)
    tok = Tokenizer.from_path(tokenizer_source)
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                     bos_token_id=1, eos_token_id=2)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.backend.save(str(folder / "tokenizer.json"))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / "1_Pooling").mkdir(exist_ok=True)
        modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                 "weightedmean_tokens", "lasttoken")
        want = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token"}[pooling]
        pool_cfg = {"word_embedding_dimension": 64,
                    **{f"pooling_mode_{m}": m == want for m in modes}, "include_prompt": True}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool_cfg))
        if max_seq_length is not None:
            (folder / "sentence_bert_config.json").write_text(
                json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}))
    return folder
