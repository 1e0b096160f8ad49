"""Model configuration: one frozen dataclass, read from a Hugging Face `config.json`
(transformers 4.x and 5.x spellings) or from GGUF metadata.

The supported families share Llama's skeleton; what differs is a few named options, and
each family's record (nanoserve/model/families.py) says which it has and which config keys it
reads, with transformers' defaults:
- `qkv_bias` (biases on q, k and v: Qwen2, Qwen2-MoE, Qwen2.5-VL), `qk_norm` (RMSNorm over
  each head of q and k, before the rotary embedding: Qwen3, Qwen3-MoE);
- a sliding window, on the layers the family's rule (`families.WINDOW_RULES`) derives from
  `sliding_window`, `use_sliding_window`, `max_window_layers` and `layer_types`;
- a mixture of experts (`num_experts`, top `num_experts_per_tok`, `norm_topk_prob`) in place
  of the MLP on the layers `moe_layers` lists (every layer, or those `decoder_sparse_step`
  and `mlp_only_layers` leave), with Qwen2-MoE's shared expert
  (`shared_expert_intermediate_size`) gated by sigmoid(x w);
- Qwen2.5-VL: a Qwen2 language model (its keys under `text_config` in 5.x, at the top level
  in 4.x) with multimodal rotary positions (`mrope_section`: how many frequency pairs
  rotate by the temporal, height and width position) and a vision tower (`vision`,
  nanoserve/multimodal/vision_model.py).
A window W means what transformers' `sliding_window_overlay` means: the query at position
p sees the keys at positions p-W+1 .. p (W tokens, itself included).

Invariant: a `ModelConfig` never changes after it is built; derived quantities are
properties, not stored fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.errors import ModelError
from nanoserve.model.families import Family, by_architecture, by_model_type, supported
from nanoserve.model.labels import head_labels
from nanoserve.model.quantization import Fp8Scheme, read_scheme
from nanoserve.multimodal.vision_config import VisionConfig

# A mixture-of-experts layer's stacked expert tensors, under `mlp.experts.` (gate and up
# fused): what nanoserve/weights/moe_weights.py stacks a checkpoint's experts into.
STACKED = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ('llama3') frequency scaling of the rotary embedding."""

    factor: float  # how much longer the context is than the original one
    low_freq_factor: float  # wavelengths above original/low_freq_factor are scaled fully
    high_freq_factor: float  # wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # model width d
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # KV heads; query heads share them in groups (GQA)
    head_dim: int
    max_position_embeddings: int  # the context length the model was trained for
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain rotary
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # a family's, its base model's (no LM head) or its classifier's (a `score` head instead)
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # q, k and v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before rotary (Qwen3)
    sliding_window: int | None = None  # tokens a query sees, itself included; None: all
    sliding_window_layers: tuple[int, ...] | None = None  # layers with the window; None: all
    quantization: Fp8Scheme | None = None  # an FP8 checkpoint's format (nanoserve/model/quantization.py)
    num_experts: int = 0  # experts of a mixture-of-experts layer; 0: a dense model
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's SwiGLU inner width
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the mixture of experts
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert width; 0: none
    # Qwen2.5-VL: frequency pairs per (temporal, height, width) position; sums to head_dim/2
    mrope_section: tuple[int, ...] | None = None
    vision: VisionConfig | None = None  # the vision tower (Qwen2.5-VL)
    image_token_id: int | None = None  # the placeholder an image's tokens replace
    # a classifier's head (nanoserve/model/labels.py): outputs, labels in id order, what the
    # logits mean; 0 and () for a model without one
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    problem_type: str = "single_label_classification"
    pad_token_id: int | None = None  # a classifier pools the last token that is not this

    def __post_init__(self) -> None:
        if by_architecture(self.architecture) is None:
            raise ModelError(f"unsupported architecture {self.architecture!r}; nanoserve runs "
                             f"{supported()}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"1..num_experts ({self.num_experts})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.head_dim:
            raise ModelError(f"mrope_section {list(self.mrope_section)} does not cover "
                             f"head_dim {self.head_dim} (its sum must be head_dim / 2)")

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (keys p-W+1..p seen from position p), or None."""
        if self.sliding_window is None:
            return None
        if self.sliding_window_layers is not None and layer not in self.sliding_window_layers:
            return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the mixture of experts (nanoserve/model/moe.py)."""
        return layer in self.moe_layers

    @property
    def family(self) -> Family:
        """The architecture's record in nanoserve/model/families.py."""
        family = by_architecture(self.architecture)
        assert family is not None  # __post_init__ refused the others
        return family

    @property
    def headless(self) -> bool:
        """No LM head: a base model (embedding checkpoints, e.g. Qwen3-Embedding saved by
        sentence-transformers) or a classifier. It embeds or classifies; it does not generate."""
        return self.architecture != self.family.architecture

    @property
    def is_classifier(self) -> bool:
        """A `*ForSequenceClassification` checkpoint: `score.weight` [num_labels, hidden] over
        the final normed hidden state of a row's last token (nanoserve/classify.py)."""
        return self.architecture == self.family.classifier

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict (4.x or 5.x keys)."""
        model_type = d.get("model_type", "llama")
        family = by_model_type(model_type)
        vision = None
        if family is not None and family.vision:  # the language model's keys: nested in 5.x
            vision = VisionConfig.from_hf_dict(d.get("vision_config") or {})
            text = d.get("text_config") or {}
            d = {**d, **text, "model_type": model_type, "architectures": d.get("architectures"),
                 "tie_word_embeddings": d.get("tie_word_embeddings",
                                              text.get("tie_word_embeddings", False))}
        arch = (d.get("architectures")
                or [family.architecture if family else "LlamaForCausalLM"])[0]
        if family is None or by_architecture(arch) is not family:
            raise ModelError(f"unsupported architecture {arch!r} (model_type {model_type!r}); "
                             f"nanoserve runs {supported()}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ModelError(f"config.json has no {key!r}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ModelError("attention_bias / mlp_bias are not supported")
        window, window_layers = _sliding_window(d, family)
        n_heads = d["num_attention_heads"]
        head_dim = family.value(d, "head_dim") or d["hidden_size"] // n_heads
        # 5.x: rope_parameters holds rope_theta and the scaling; 4.x: rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = float(rope.get("rope_theta", family.value(d, "rope_theta")))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mrope = None
        if family.mrope_section is not None:
            mrope = tuple(int(x) for x in (rope.get("mrope_section") or family.mrope_section))
            rope_type = "default" if rope_type == "mrope" else rope_type  # 4.x's name
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ModelError(f"unsupported rope scaling type {rope_type!r}")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qkv_bias = family.qkv_bias
        if "qkv_bias" in family.defaults:  # a config key of the family (Qwen2-MoE)
            qkv_bias = bool(family.value(d, "qkv_bias"))
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=family.value(d, "max_position_embeddings"),
            rms_norm_eps=float(family.value(d, "rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(family.value(d, "tie_word_embeddings")),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            qkv_bias=qkv_bias,
            qk_norm=family.qk_norm,
            sliding_window=window,
            sliding_window_layers=window_layers,
            quantization=read_scheme(d.get("quantization_config")),
            **_moe_options(d, family),
            mrope_section=mrope,
            vision=vision,
            image_token_id=family.value(d, "image_token_id") if vision is not None else None,
            **(dict(head_labels(d), pad_token_id=d.get("pad_token_id"))
               if arch == family.classifier else {}),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelError(f"no config.json in {path.parent}") from None
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    def rope_inv_freq(self) -> list[float]:
        """Inverse frequencies of the rotary embedding, `[head_dim // 2]`, with llama3
        scaling applied when configured (same formula as transformers)."""
        dim = self.head_dim
        inv = [1.0 / (self.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
        s = self.rope_scaling
        if s is None:
            return inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen > low_wavelen:
                out.append(f / s.factor)
            elif wavelen < high_wavelen:
                out.append(f)
            else:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                out.append((1 - smooth) * f / s.factor + smooth * f)
        return out


def _sliding_window(d: dict[str, Any], family: Family
                    ) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, layers that use it; None: every layer) by the family's rule
    (`families.WINDOW_RULES`), as transformers' config classes derive them."""
    window = family.value(d, "sliding_window")
    rule = family.window
    if rule == "none" or window is None:
        return None, None
    if rule == "every_layer":  # MistralConfig, MixtralConfig: whenever set
        return int(window), None
    if not family.value(d, "use_sliding_window"):  # the Qwen rules: only when used
        return None, None
    if rule == "every_layer_if_used":  # Qwen3MoeConfig
        return int(window), None
    n_layers = int(d["num_hidden_layers"])
    first = int(family.value(d, "max_window_layers"))
    types = d.get("layer_types")
    if types is None and rule == "from_max_window_layers":  # Qwen2Config, Qwen3Config
        return int(window), tuple(range(first, n_layers))
    if types is None:  # "even_below_max_window_layers": Qwen2MoeConfig
        types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers:
        raise ModelError(f"layer_types has {len(types)} entries for {n_layers} layers")
    return int(window), tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def _moe_options(d: dict[str, Any], family: Family) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` as transformers' config class of the
    family derives them (4.x `num_experts`, 5.x and Mixtral `num_local_experts`)."""
    moe = family.moe
    if moe is None:
        return {}
    n_layers = int(d["num_hidden_layers"])
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is None:
        experts = family.defaults.get("num_local_experts", family.defaults.get("num_experts"))
    experts = int(experts)
    if moe.every_layer:
        layers = tuple(range(n_layers))
    else:
        step = int(family.value(d, "decoder_sparse_step"))
        dense = set(family.value(d, "mlp_only_layers") or ())
        layers = tuple(i for i in range(n_layers)
                       if i not in dense and experts > 0 and (i + 1) % step == 0)
    norm = moe.always_renormalise or bool(family.value(d, "norm_topk_prob"))
    shared = int(family.value(d, "shared_expert_intermediate_size") or 0) if moe.shared_expert else 0
    return dict(num_experts=experts, num_experts_per_tok=int(family.value(d, "num_experts_per_tok")),
                moe_intermediate_size=int(family.value(d, moe.width_key)), norm_topk_prob=norm,
                moe_layers=layers, shared_expert_intermediate_size=shared)
