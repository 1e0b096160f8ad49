"""An encoder's config.json as a frozen dataclass (`EncoderConfig.from_hf_dict`).

Keys are read as transformers' config classes read them, with their defaults where a key is
missing (BertConfig / XLMRobertaConfig / ModernBertConfig, transformers 5.x and the 4.x
spellings `global_rope_theta`, `local_rope_theta`, `global_attn_every_n_layers`).

Invariants:
- `max_position_embeddings` is the most tokens one row may hold: config.json's value less
  RoBERTa's position offset (pad_token_id + 1) where the family has one; `position_table`
  is config.json's value (the rows of BERT's position embedding);
- `layer_types[i]` is 'full_attention' or 'sliding_attention' (ModernBERT; BERT: all full);
  a sliding layer's query at row position p sees the keys at |p - q| <= local_attention // 2;
- `id2label` has `num_labels` entries, in label-id order; `problem_type` is one of
  PROBLEM_TYPES (config.json's, else regression for one output, single-label otherwise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanoserve.errors import ModelError
from nanoserve.model.encoder_families import (
    EncoderFamily,
    encoder_by_architecture,
    encoder_by_model_type,
    supported_encoders,
)
from nanoserve.model.labels import PROBLEM_TYPES, head_labels

LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers' defaults where config.json leaves a key out, per model_type
_DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": {"hidden_act": "gelu", "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
             "type_vocab_size": 2, "pad_token_id": 0, "position_embedding_type": "absolute"},
    "xlm-roberta": {"hidden_act": "gelu", "layer_norm_eps": 1e-12,
                    "max_position_embeddings": 512, "type_vocab_size": 2, "pad_token_id": 1,
                    "position_embedding_type": "absolute"},
    "modernbert": {"hidden_activation": "gelu", "norm_eps": 1e-5, "max_position_embeddings": 8192,
                   "pad_token_id": 50283, "norm_bias": False, "attention_bias": False,
                   "mlp_bias": False, "classifier_bias": False, "classifier_activation": "gelu",
                   "classifier_pooling": "cls", "local_attention": 128,
                   "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0,
                   "local_rope_theta": 10000.0},
}


@dataclass(frozen=True)
class EncoderConfig:
    family: EncoderFamily
    architecture: str  # config.json's architectures[0]: the base model or its classifier
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str  # the MLP's activation (ModernBERT's `hidden_activation`)
    norm_eps: float
    position_table: int  # config.json's max_position_embeddings
    pad_token_id: int | None
    type_vocab_size: int = 0  # BERT's token type embeddings; 0: none (ModernBERT)
    # ModernBERT
    layer_types: tuple[str, ...] = ()
    local_attention: int = 0  # the whole local window: a token sees +- local_attention // 2
    global_rope_theta: float = 0.0
    local_rope_theta: float = 0.0
    norm_bias: bool = True  # LayerNorms carry biases (BERT: always)
    attention_bias: bool = True  # Wqkv / Wo biases (BERT: always)
    mlp_bias: bool = True
    classifier_bias: bool = True  # ModernBERT's head dense bias
    classifier_activation: str = "tanh"  # ModernBERT's head activation; BERT's pooler: tanh
    classifier_pooling: str = "cls"  # ModernBERT: 'cls' or 'mean'; BERT: always [CLS]
    # the classification head (architecture != base model)
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    problem_type: str = "single_label_classification"

    @property
    def headless(self) -> bool:
        """The base model: last hidden states only (embeddings)."""
        return self.architecture == self.family.base_model

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int:
        """Where row position 0 reads the position table (RoBERTa: pad_token_id + 1)."""
        return (self.pad_token_id or 0) + 1 if self.family.position_offset else 0

    @property
    def max_position_embeddings(self) -> int:
        """The most tokens one row may hold."""
        return self.position_table - self.position_offset

    def window(self, layer: int) -> int | None:
        """The half window of `layer` (keys at |p - q| <= it), None for global attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.local_attention // 2
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> EncoderConfig:
        archs = d.get("architectures") or []
        family = (encoder_by_architecture(archs[0]) if archs
                  else encoder_by_model_type(d.get("model_type", "")))
        if family is None or (d.get("model_type") not in (None, family.model_type)):
            raise ModelError(f"unsupported encoder {archs[0] if archs else None!r} (model_type "
                             f"{d.get('model_type')!r}); nanoserve runs {supported_encoders()}")
        arch = archs[0] if archs else family.base_model
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size"):
            if key not in d:
                raise ModelError(f"config.json has no {key!r}")
        defaults = _DEFAULTS[family.model_type]

        def get(key: str) -> Any:
            return d[key] if d.get(key) is not None else defaults.get(key)

        common: dict[str, Any] = dict(
            family=family, architecture=arch, vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            intermediate_size=d["intermediate_size"],
            position_table=get("max_position_embeddings"), pad_token_id=get("pad_token_id"))
        if d["hidden_size"] % d["num_attention_heads"]:
            raise ModelError(f"hidden_size ({d['hidden_size']}) is not a multiple of "
                             f"num_attention_heads ({d['num_attention_heads']})")
        if arch == family.architecture:
            common.update(head_labels(d))
        if family.kind == "bert":
            if get("position_embedding_type") != "absolute":
                raise ModelError(f"position_embedding_type {get('position_embedding_type')!r} "
                                 f"is not supported (absolute only)")
            return cls(**common, hidden_act=get("hidden_act"), norm_eps=get("layer_norm_eps"),
                       type_vocab_size=get("type_vocab_size"))
        return cls(**common, **_modernbert_keys(d, get))


def _modernbert_keys(d: dict[str, Any], get: Any) -> dict[str, Any]:
    n = d["num_hidden_layers"]
    every = get("global_attn_every_n_layers")
    layer_types = tuple(d.get("layer_types") or (
        "sliding_attention" if i % every else "full_attention" for i in range(n)))
    if len(layer_types) != n or any(t not in LAYER_TYPES for t in layer_types):
        raise ModelError(f"layer_types {list(layer_types)} is not {n} of {LAYER_TYPES}")
    rope = d.get("rope_parameters") or {}
    thetas = {}
    for kind, old in (("full_attention", "global_rope_theta"),
                      ("sliding_attention", "local_rope_theta")):
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default":
            raise ModelError(f"rope type {params['rope_type']!r} is not supported (default only)")
        thetas[kind] = float(params.get("rope_theta", get(old)))
    return dict(hidden_act=get("hidden_activation"), norm_eps=get("norm_eps"),
                layer_types=layer_types, local_attention=get("local_attention"),
                global_rope_theta=thetas["full_attention"],
                local_rope_theta=thetas["sliding_attention"], norm_bias=get("norm_bias"),
                attention_bias=get("attention_bias"), mlp_bias=get("mlp_bias"),
                classifier_bias=get("classifier_bias"),
                classifier_activation=get("classifier_activation"),
                classifier_pooling=_pooling(get("classifier_pooling")))


def _pooling(value: str) -> str:
    if value not in ("cls", "mean"):
        raise ModelError(f"classifier_pooling {value!r} is not supported (cls or mean)")
    return value


def read_encoder_config(folder: str | Path) -> EncoderConfig:
    """A checkpoint folder's config.json; ModelError if unreadable or not an encoder."""
    path = Path(folder) / "config.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(d, dict):
        raise ModelError(f"{path} does not hold an object")
    return EncoderConfig.from_hf_dict(d)


__all__ = ["LAYER_TYPES", "PROBLEM_TYPES", "EncoderConfig", "read_encoder_config"]
