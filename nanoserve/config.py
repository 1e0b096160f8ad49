"""Model configuration: one frozen dataclass, read from a Hugging Face `config.json`
(transformers 4.x and 5.x spellings) or from GGUF metadata.

The supported families share Llama's skeleton; what differs is a few named options:
- Llama (`LlamaForCausalLM`): none of them;
- Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): `qkv_bias` (biases on q, k and v); a sliding
  window only when `use_sliding_window`, and then only on the layers
  `>= max_window_layers` (or those `layer_types` marks `sliding_attention`);
- Qwen3 (`Qwen3ForCausalLM`): `qk_norm` (RMSNorm over each head of q and k, before the
  rotary embedding); its window rules are Qwen2's;
- Mistral (`MistralForCausalLM`): `sliding_window` on every layer when set (v0.1: 4096);
- Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention, and a mixture of experts
  (`num_experts`, top `num_experts_per_tok`, `norm_topk_prob`) in place of the MLP on the
  layers `moe_layers` lists (`decoder_sparse_step`, `mlp_only_layers`); its window, with
  `use_sliding_window`, on every layer;
- Mixtral (`MixtralForCausalLM`): Mistral's attention and window, experts on every layer
  (top-k weights always renormalised);
- Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (`qkv_bias`), Qwen3-MoE's experts
  plus a shared expert (`shared_expert_intermediate_size`) gated by sigmoid(x w); its window
  on the layers `layer_types` marks (by default the even ones below `max_window_layers`).
- Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a Qwen2 language model (its keys under
  `text_config` in 5.x, at the top level in 4.x) with multimodal rotary positions
  (`mrope_section`: how many frequency pairs rotate by the temporal, height and width
  position) and a vision tower (`vision`, nanoserve/vision_model.py).
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
from nanoserve.quantization import Fp8Scheme, read_scheme
from nanoserve.vision_config import VisionConfig

# architecture (config.json's `architectures[0]`) -> its `model_type`
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# A mixture-of-experts layer's stacked expert tensors, under `mlp.experts.` (gate and up
# fused): what nanoserve/moe_weights.py stacks a checkpoint's experts into.
STACKED = ("gate_up_proj", "down_proj")
# The same families without an LM head (embedding checkpoints, e.g. Qwen3-Embedding saved
# by sentence-transformers): they load for `embed`, not for generation.
HEADLESS = {"LlamaModel": "llama", "MistralModel": "mistral", "Qwen2Model": "qwen2",
            "Qwen3Model": "qwen3"}


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
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # q, k and v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head before rotary (Qwen3)
    sliding_window: int | None = None  # tokens a query sees, itself included; None: all
    sliding_window_layers: tuple[int, ...] | None = None  # layers with the window; None: all
    quantization: Fp8Scheme | None = None  # an FP8 checkpoint's format (nanoserve/quantization.py)
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

    def __post_init__(self) -> None:
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
        """Whether `layer`'s MLP is the mixture of experts (nanoserve/moe.py)."""
        return layer in self.moe_layers

    @property
    def headless(self) -> bool:
        """A checkpoint without an LM head (`HEADLESS`): it embeds, it does not generate."""
        return self.architecture in HEADLESS

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict (4.x or 5.x keys)."""
        model_type = d.get("model_type", "llama")
        vision = None
        if model_type == "qwen2_5_vl":  # the language model's keys: nested in 5.x, flat in 4.x
            vision = VisionConfig.from_hf_dict(d.get("vision_config") or {})
            d = {**d, **(d.get("text_config") or {}), "model_type": model_type,
                 "architectures": d.get("architectures"),
                 "tie_word_embeddings": d.get("tie_word_embeddings",
                                              (d.get("text_config") or {}).get(
                                                  "tie_word_embeddings", False))}
        default_arch = {t: a for a, t in FAMILIES.items()}.get(model_type, "LlamaForCausalLM")
        archs = d.get("architectures") or [default_arch]
        arch = archs[0]
        if FAMILIES.get(arch, HEADLESS.get(arch)) != model_type:
            raise ModelError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}); "
                f"nanoserve runs {', '.join(f'{a} ({t})' for a, t in FAMILIES.items())}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ModelError(f"config.json has no {key!r}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ModelError("attention_bias / mlp_bias are not supported")
        window, window_layers = _sliding_window(d, model_type)
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        # 5.x: rope_parameters holds rope_theta and the scaling; 4.x: rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        mrope = rope.get("mrope_section")
        if model_type == "qwen2_5_vl":
            mrope = tuple(int(x) for x in (mrope or (16, 24, 24)))
            rope_type = "default" if rope_type == "mrope" else rope_type  # 4.x's name
        else:
            mrope = None
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
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            qkv_bias=model_type in ("qwen2", "qwen2_5_vl") or (
                model_type == "qwen2_moe" and bool(d.get("qkv_bias", True))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=window,
            sliding_window_layers=window_layers,
            quantization=read_scheme(d.get("quantization_config")),
            **_moe_options(d, model_type),
            mrope_section=mrope,
            vision=vision,
            image_token_id=d.get("image_token_id") if vision is not None else None,
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


def _sliding_window(d: dict[str, Any], model_type: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, layers that use it) as transformers' config classes derive them."""
    window = d.get("sliding_window")
    if model_type in ("mistral", "mixtral"):  # MistralConfig: every layer, whenever set
        return (int(window) if window is not None else None), None
    if model_type == "qwen3_moe":  # Qwen3MoeConfig: every layer, with use_sliding_window
        use = d.get("use_sliding_window", False) and window is not None
        return (int(window) if use else None), None
    if model_type == "qwen2_moe":  # Qwen2MoeConfig: the even layers below max_window_layers
        if not d.get("use_sliding_window", False) or window is None:
            return None, None
        n_layers = int(d["num_hidden_layers"])
        types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < int(d.get("max_window_layers", 28))
            else "full_attention" for i in range(n_layers)]
        return int(window), tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if model_type not in ("qwen2", "qwen3", "qwen2_5_vl"):
        return None, None
    # Qwen2Config / Qwen3Config: no window unless use_sliding_window; then the layers that
    # layer_types marks, or by default those from max_window_layers on.
    if not d.get("use_sliding_window", False) or window is None:
        return None, None
    n_layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", 28))
        layers = tuple(range(first, n_layers))
    else:
        if len(types) != n_layers:
            raise ModelError(f"layer_types has {len(types)} entries for {n_layers} layers")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return int(window), layers


def _moe_options(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelConfig` as transformers' Qwen3MoeConfig,
    Qwen2MoeConfig and MixtralConfig derive them (4.x `num_experts`, 5.x `num_local_experts`)."""
    if model_type not in ("qwen3_moe", "mixtral", "qwen2_moe"):
        return {}
    n_layers = int(d["num_hidden_layers"])
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is None:
        raise ModelError("config.json has no 'num_experts' / 'num_local_experts'")
    if model_type == "mixtral":  # every layer; the expert width is intermediate_size
        return dict(num_experts=int(experts), num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=tuple(range(n_layers)))
    shared = int(d.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    step = int(d.get("decoder_sparse_step", 1))
    dense = set(d.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(n_layers)
                   if i not in dense and int(experts) > 0 and (i + 1) % step == 0)
    return dict(num_experts=int(experts), num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(d.get("moe_intermediate_size", d["intermediate_size"])),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)), moe_layers=layers,
                shared_expert_intermediate_size=shared)
