"""Tiny random encoder checkpoints for tests (needs the `test` extra: transformers).

`save_tiny_encoder` writes one of BERT, XLM-RoBERTa or ModernBERT through transformers' own
classes and `save_pretrained`, with a tokenizer built here from nothing, of the kind the
family ships (WordPiece, Unigram, byte-level BPE), its post-processor adding the family's
special tokens for texts and pairs; sentence-transformers' files on request. Nothing is
fetched.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

# whole words the tokenizers know, so texts split into words and pieces alike
WORDS = ("the quick brown fox jumps over lazy dog hello world a b c d e f g film great dull "
         "query passage what is an encoder of and words more longer document").split()
_CHARS = string.ascii_lowercase + string.digits + ".,:;!?'-"

# the tiny shapes: hidden 32, 2 layers (ModernBERT: 3, global every 2, a window of +- 2)
TINY = {
    "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=48, max_position_embeddings=64, type_vocab_size=2),
    "xlm-roberta": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=40, type_vocab_size=1),
    "modernbert": dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                       intermediate_size=48, max_position_embeddings=64,
                       global_attn_every_n_layers=2, local_attention=4,
                       global_rope_theta=160000.0, local_rope_theta=10000.0),
}


def wordpiece_tokenizer() -> Any:
    """BERT's: lower-cased, WordPiece over whole words, letters and ##letters;
    [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4; [CLS] a [SEP] b [SEP] (b's type id 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS,
             *[c for c in _CHARS if c not in WORDS], *[f"##{c}" for c in _CHARS],
             "##ing", "##ed", "##er"]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(dict.fromkeys(vocab))},
                                     unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    return tok


def unigram_tokenizer() -> Any:
    """XLM-R's kind: Metaspace + Unigram; <s> 0, <pad> 1, </s> 2, <unk> 3;
    <s> a </s></s> b </s> (type ids all 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(f"\u2581{w}", -2.0 - 0.01 * i) for i, w in enumerate(WORDS)]
    pieces += [(c, -6.0) for c in _CHARS] + [(f"\u2581{c}", -7.0) for c in _CHARS]
    pieces += [("\u2581", -8.0), ("ing", -4.0), ("er", -4.5)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    return tok


def bpe_tokenizer() -> Any:
    """ModernBERT's kind: byte-level BPE (the 256 byte characters and a few merges), then
    [CLS] 0.. : [UNK], [CLS], [SEP], [PAD], [MASK]; [CLS] a [SEP] b [SEP]."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("t", "h"), ("th", "e"), ("Ġ", "the"), ("e", "r"), ("o", "r"), ("Ġ", "w"),
              ("Ġw", "or"), ("i", "n"), ("in", "g")]
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    return tok


_TOKENIZERS = {"bert": (wordpiece_tokenizer, {"cls_token": "[CLS]", "sep_token": "[SEP]",
                                              "pad_token": "[PAD]", "unk_token": "[UNK]",
                                              "mask_token": "[MASK]"}),
               "xlm-roberta": (unigram_tokenizer, {"bos_token": "<s>", "eos_token": "</s>",
                                                   "cls_token": "<s>", "sep_token": "</s>",
                                                   "pad_token": "<pad>", "unk_token": "<unk>"}),
               "modernbert": (bpe_tokenizer, {"cls_token": "[CLS]", "sep_token": "[SEP]",
                                              "pad_token": "[PAD]", "unk_token": "[UNK]",
                                              "mask_token": "[MASK]"})}


def tiny_encoder(model_type: str, vocab_size: int, *, head: bool, seed: int = 0,
                 special_ids: dict[str, int] | None = None, **options: Any) -> Any:
    """transformers' tiny random encoder of `model_type` ('bert', 'xlm-roberta',
    'modernbert'): its base model, or with `head` its `*ForSequenceClassification`
    (`options`: num_labels, problem_type, classifier_pooling, ...), in eval mode, with random
    norm weights and biases (so a missing or misplaced one shows) and matrices drawn at
    std 1/sqrt(fan-in), not transformers' 0.02: its tiny init leaves attention near uniform
    and logits near the bias, where positions, rotary and segments barely show."""
    import torch
    import transformers

    from nanoserve.model.encoder_families import encoder_by_model_type

    family = encoder_by_model_type(model_type)
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(model_type, vocab_size=vocab_size,
                                            **{**TINY[model_type], **(special_ids or {}),
                                               **options})
    cls = getattr(transformers, family.architecture if head else family.base_model)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or name.endswith("bias"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:  # matrices of unit gain: attention that is not uniform, logits of size 1
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.eval()


def save_tiny_encoder(folder: str | Path, model_type: str, *, head: bool = False,
                      sentence_transformers: str | None = None, normalize: bool = True,
                      max_seq_length: int | None = None, seed: int = 0,
                      **options: Any) -> Path:
    """A tiny random encoder (`tiny_encoder`) saved by transformers in `folder`, with its
    tokenizer (tokenizer.json + tokenizer_config.json naming the fast tokenizer class, its
    special tokens, the model's max positions and its inputs: BERT's token_type_ids). With `sentence_transformers` ('mean' or
    'cls'): modules.json (Transformer, Pooling, Normalize when `normalize`), the Pooling
    config and, with `max_seq_length`, sentence_bert_config.json."""
    folder = Path(folder)
    make, specials = _TOKENIZERS[model_type]
    tok = make()
    ids = {f"{k[:-6]}_token_id": tok.token_to_id(v) for k, v in specials.items()
           if k in ("pad_token", "cls_token", "sep_token", "bos_token", "eos_token")}
    if model_type == "xlm-roberta":
        ids = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
    model = tiny_encoder(model_type, tok.get_vocab_size(), head=head, seed=seed,
                         special_ids=ids, **options)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    limit = model.config.max_position_embeddings - (2 if model_type == "xlm-roberta" else 0)
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if model_type == "bert" \
        else ["input_ids", "attention_mask"]  # BERT's segments; the others have none
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": limit,
         "model_input_names": inputs, **specials}))
    if sentence_transformers is not None:
        from nanoserve.testing import write_sentence_transformers_files

        write_sentence_transformers_files(folder, sentence_transformers,
                                          model.config.hidden_size, normalize, max_seq_length)
    return folder


__all__ = ["TINY", "WORDS", "bpe_tokenizer", "save_tiny_encoder", "tiny_encoder",
           "unigram_tokenizer", "wordpiece_tokenizer"]
