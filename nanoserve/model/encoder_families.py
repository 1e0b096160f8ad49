"""The encoder architectures nanoserve runs: one `EncoderFamily` record per architecture.

The decoder families (nanoserve/model/families.py) share Llama's skeleton; encoders do not (no
causal mask, no KV cache, post-norm BERT blocks or ModernBERT's rotary pre-norm blocks), so
their records live here, with the same idea: a record names the architecture as config.json
writes it (`architectures[0]`, also transformers' class), its `model_type`, the base model
without a head (`BertModel`: embedding checkpoints, what sentence-transformers saves), the
block layout (`kind`: 'bert' or 'modernbert', the module that builds it) and the prefix its
base model's tensors carry inside the head model (`bert.`, `roberta.`, `model.`).

Plain data: no torch, no transformers (nanoserve/model/families.py reads it for its error messages).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("bert", "modernbert")


@dataclass(frozen=True)
class EncoderFamily:
    name: str  # as the docs write it
    architecture: str  # the sequence-classification class: config.json's `architectures[0]`
    model_type: str
    base_model: str  # the same encoder without a head (its last hidden states)
    kind: str  # one of KINDS: nanoserve/encoder/bert.py or nanoserve/encoder/modernbert.py
    prefix: str  # the base model's tensor names inside `architecture`'s checkpoint
    # absolute positions start at pad_token_id + 1 (RoBERTa's, from fairseq); False: at 0
    position_offset: bool = False
    tokenizer: str = ""  # the tokenizer.json model its checkpoints ship (docs only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")


ENCODERS: tuple[EncoderFamily, ...] = (
    EncoderFamily("BERT", "BertForSequenceClassification", "bert", "BertModel", "bert", "bert.",
                  tokenizer="WordPiece"),
    EncoderFamily("XLM-RoBERTa", "XLMRobertaForSequenceClassification", "xlm-roberta",
                  "XLMRobertaModel", "bert", "roberta.", position_offset=True,
                  tokenizer="Unigram"),
    EncoderFamily("ModernBERT", "ModernBertForSequenceClassification", "modernbert",
                  "ModernBertModel", "modernbert", "model.", tokenizer="BPE"),
)

_BY_ARCHITECTURE = {**{f.architecture: f for f in ENCODERS}, **{f.base_model: f for f in ENCODERS}}
_BY_MODEL_TYPE = {f.model_type: f for f in ENCODERS}


def encoder_by_architecture(architecture: str) -> EncoderFamily | None:
    """The encoder of an architecture, with or without its classification head; None if
    nanoserve runs no such encoder."""
    return _BY_ARCHITECTURE.get(architecture)


def encoder_by_model_type(model_type: str) -> EncoderFamily | None:
    return _BY_MODEL_TYPE.get(model_type)


def is_encoder_config(d: dict) -> bool:
    """Whether a config.json dict is one of these encoders (by architecture, else model_type)."""
    archs = d.get("architectures") or []
    if archs:
        return encoder_by_architecture(archs[0]) is not None
    return encoder_by_model_type(d.get("model_type", "")) is not None


def supported_encoders() -> str:
    """For error messages: 'BertModel, BertForSequenceClassification (bert), ...'."""
    return ", ".join(f"{f.base_model}, {f.architecture} ({f.model_type})" for f in ENCODERS)


__all__ = ["ENCODERS", "KINDS", "EncoderFamily", "encoder_by_architecture",
           "encoder_by_model_type", "is_encoder_config", "supported_encoders"]
