"""The model families nanoserve runs: one `Family` record per architecture.

Every family is Llama's skeleton (nanoserve/model/model.py) with a few named options; a record
says which, and how a checkpoint of the family spells them:
- its names: the architecture (config.json's `architectures[0]`, also transformers' model
  class that tests/test_registry.py holds it to), `model_type`, the base model without
  an LM head where the family has one (`Qwen3Model`: embedding checkpoints), and the model
  with a sequence-classification head where transformers has one
  (`Qwen3ForSequenceClassification`: classifiers and reward models, nanoserve/classify.py);
- the config.json keys read for it, with the value transformers' config class derives when
  a key is missing (`defaults`);
- the attention options (q/k/v biases, q/k norm), its sliding-window rule (`WINDOW_RULES`),
  multimodal rotary sections and a vision tower;
- its mixture of experts' layout (`MoeLayout`);
- its GGUF architecture name, and whether llama.cpp permuted the q/k rows;
- the reasoning parser its chat models call for (nanoserve/sampling/reasoning.py);
- the options of its tiny random test checkpoint (`tiny`, built by nanoserve/testing.py).

nanoserve/model/config.py, nanoserve/weights/ (weights.py, moe_weights.py, gguf_file.py),
nanoserve/sampling/reasoning.py and nanoserve/testing.py read these records; none of them
branches on a family's name. Adding a Llama-like family is one record here
(docs/development.md). Plain data: no torch, no transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Which layers a family's `sliding_window` applies to (nanoserve/model/config.py derives them as
# transformers' config classes do):
WINDOW_RULES = (
    "none",  # no window (Llama)
    "every_layer",  # every layer whenever `sliding_window` is set (Mistral, Mixtral)
    "every_layer_if_used",  # every layer, only with `use_sliding_window` (Qwen3-MoE)
    "from_max_window_layers",  # with `use_sliding_window`: layers >= `max_window_layers`,
    # or those `layer_types` marks `sliding_attention` (Qwen2, Qwen3)
    "even_below_max_window_layers",  # with `use_sliding_window`: the layers `layer_types`
    # marks, by default the even ones below `max_window_layers` (Qwen2-MoE)
)


@dataclass(frozen=True)
class MoeLayout:
    """Where a family's experts sit and how its checkpoints name them (nanoserve/model/moe.py,
    nanoserve/weights/moe_weights.py). A layer's experts load stacked as `mlp.experts.gate_up_proj`
    and `mlp.experts.down_proj`, its router as `mlp.gate.weight`."""

    # per-expert tensor names (gate, up, down) under `<module>.experts.<e>.`, the family's
    # own spelling first
    expert_names: tuple[tuple[str, str, str], ...] = (("gate_proj", "up_proj", "down_proj"),)
    module: str = "mlp"  # the block under `model.layers.N.` holding router and experts
    every_layer: bool = False  # False: the layers `decoder_sparse_step` and `mlp_only_layers` leave
    width_key: str = "moe_intermediate_size"  # the config key of each expert's inner width
    always_renormalise: bool = False  # True: top-k weights renormalised; False: `norm_topk_prob`
    shared_expert: bool = False  # a sigmoid-gated shared expert (`shared_expert_intermediate_size`)


@dataclass(frozen=True)
class Family:
    name: str  # as the docs write it
    architecture: str  # config.json's `architectures[0]`; transformers' model class
    model_type: str
    defaults: Mapping[str, Any]  # config keys read for the family -> transformers' default
    base_model: str | None = None  # the same family without an LM head (embeddings)
    # the same family with a sequence-classification head in place of the LM head (`score`,
    # [num_labels, hidden], no bias; nanoserve/classify.py); None: transformers has none
    classifier: str | None = None
    qkv_bias: bool = False  # q, k and v carry biases (a `defaults` key `qkv_bias` overrides)
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotary embedding
    window: str = "none"  # one of WINDOW_RULES
    moe: MoeLayout | None = None
    # a vision tower (`vision_config`, nanoserve/multimodal/vision_model.py); the language model's keys
    # under `text_config` (5.x) or at the top level (4.x); images by `image_token_id`
    vision: bool = False
    # multimodal rotary: frequency pairs per (temporal, height, width) position, the published
    # checkpoints' when config.json gives none; None: plain rotary
    mrope_section: tuple[int, ...] | None = None
    # stored-name prefixes renamed at load (other transformers versions' nesting)
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    gguf_name: str | None = None  # GGUF `general.architecture`; None: no GGUF files
    gguf_permuted_qk: bool = False  # llama.cpp permuted q/k rows per head (its rotary layout)
    reasoning_parser: str | None = None  # picked by `reasoning_parser="auto"` (think tags given)
    tiny: Mapping[str, Any] = field(default_factory=dict)  # its tiny test checkpoint's options

    def __post_init__(self) -> None:
        if self.window not in WINDOW_RULES:
            raise ValueError(f"{self.name}: window rule {self.window!r} is not one of {WINDOW_RULES}")
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))

    def value(self, d: Mapping[str, Any], key: str) -> Any:
        """config.json's `key` (None where it says null), else the family's default (None
        where the family has none)."""
        return d[key] if key in d else self.defaults.get(key)


# What every family reads, with LlamaConfig's defaults; a family lists those that differ.
_LLAMA_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                   "tie_word_embeddings": False}
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}
# the tiny checkpoints' expert shapes (hidden 64): experts that a 30-token prompt spreads over
_TINY_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: tuple[Family, ...] = (
    Family("Llama", "LlamaForCausalLM", "llama", _LLAMA_DEFAULTS, base_model="LlamaModel",
           classifier="LlamaForSequenceClassification", gguf_name="llama", gguf_permuted_qk=True),
    Family("Mistral", "MistralForCausalLM", "mistral",
           {**_LLAMA_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096},
           base_model="MistralModel", classifier="MistralForSequenceClassification",
           window="every_layer"),
    Family("Qwen2", "Qwen2ForCausalLM", "qwen2",
           {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, **_QWEN_WINDOW},
           base_model="Qwen2Model", classifier="Qwen2ForSequenceClassification", qkv_bias=True,
           window="from_max_window_layers", gguf_name="qwen2"),
    Family("Qwen3", "Qwen3ForCausalLM", "qwen3",
           {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "head_dim": 128, **_QWEN_WINDOW},
           base_model="Qwen3Model", classifier="Qwen3ForSequenceClassification", qk_norm=True,
           window="from_max_window_layers",
           gguf_name="qwen3", reasoning_parser="qwen3"),
    Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe",
           {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False,
            "sliding_window": None, "num_experts": 128, "num_experts_per_tok": 8,
            "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1,
            "mlp_only_layers": []},
           classifier="Qwen3MoeForSequenceClassification", qk_norm=True,
           window="every_layer_if_used", moe=MoeLayout(),
           reasoning_parser="qwen3",
           # a dense layer 1 (mlp_only_layers), as Qwen3-MoE checkpoints may have
           tiny={**_TINY_EXPERTS, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    Family("Mixtral", "MixtralForCausalLM", "mixtral",
           {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
            "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 8,
            "num_experts_per_tok": 2},
           classifier="MixtralForSequenceClassification", window="every_layer",
           moe=MoeLayout(expert_names=(("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")),
                         module="block_sparse_moe", every_layer=True,
                         width_key="intermediate_size", always_renormalise=True),
           tiny={"num_local_experts": 4, "num_experts_per_tok": 2}),
    Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "qwen2_moe",
           {**_LLAMA_DEFAULTS, "max_position_embeddings": 32768, "use_sliding_window": False,
            "max_window_layers": 28, "qkv_bias": True, "num_experts": 60,
            "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "norm_topk_prob": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "shared_expert_intermediate_size": 5632},
           classifier="Qwen2MoeForSequenceClassification", qkv_bias=True,
           window="even_below_max_window_layers",
           moe=MoeLayout(shared_expert=True),
           tiny={**_TINY_EXPERTS, "shared_expert_intermediate_size": 64}),
    Family("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
           {**_LLAMA_DEFAULTS, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
            "rope_theta": 1e6, **_QWEN_WINDOW, "max_window_layers": 80,
            "image_token_id": 151655},
           qkv_bias=True, window="from_max_window_layers", vision=True,
           mrope_section=(16, 24, 24),
           renamed_prefixes=(("model.language_model.", "model."), ("model.visual.", "visual.")),
           tiny={"text_config": {"rms_norm_eps": 1e-6, "rope_parameters": {
                     "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
                 # the last block full attention, windows of 2 x 2 merged blocks
                 "vision_config": {"depth": 3, "hidden_size": 32, "intermediate_size": 64,
                                   "num_heads": 2, "out_hidden_size": 64, "patch_size": 14,
                                   "spatial_merge_size": 2, "temporal_patch_size": 2,
                                   "window_size": 56, "fullatt_block_indexes": [2]}}),
)

_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
_BY_BASE_MODEL = {f.base_model: f for f in FAMILIES if f.base_model}
_BY_CLASSIFIER = {f.classifier: f for f in FAMILIES if f.classifier}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
_BY_GGUF_NAME = {f.gguf_name: f for f in FAMILIES if f.gguf_name}
SUPPORTED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)
GGUF_NAMES = tuple(_BY_GGUF_NAME)


def by_architecture(architecture: str) -> Family | None:
    """The family of an architecture: with its LM head, without (the base model) or with a
    sequence-classification head in its place; None if not supported."""
    return (_BY_ARCHITECTURE.get(architecture) or _BY_BASE_MODEL.get(architecture)
            or _BY_CLASSIFIER.get(architecture))


def by_model_type(model_type: str) -> Family | None:
    return _BY_MODEL_TYPE.get(model_type)


def by_gguf_name(name: str) -> Family | None:
    return _BY_GGUF_NAME.get(name)


def supported() -> str:
    """The supported architectures for an error message: 'LlamaForCausalLM (llama), ...;
    encoders (...): BertModel, BertForSequenceClassification (bert), ...' (the encoders'
    records: nanoserve/model/encoder_families.py)."""
    from nanoserve.model.encoder_families import supported_encoders

    decoders = ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES)
    return f"{decoders}; encoders (nanoserve.encoder.Encoder, Embedder): {supported_encoders()}"


__all__ = ["FAMILIES", "GGUF_NAMES", "SUPPORTED_ARCHITECTURES", "WINDOW_RULES", "Family",
           "MoeLayout", "by_architecture", "by_gguf_name", "by_model_type", "supported"]
