"""Model configuration: one frozen dataclass, read from a Hugging Face `config.json`
(transformers 4.x and 5.x spellings) or from GGUF metadata.

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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict (4.x or 5.x keys)."""
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        model_type = d.get("model_type", "llama")
        if arch not in SUPPORTED_ARCHITECTURES or model_type != "llama":
            raise ModelError(
                f"unsupported architecture {arch!r} (model_type {model_type!r}); "
                f"nanoserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ModelError(f"config.json has no {key!r}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ModelError("attention_bias / mlp_bias are not supported")
        n_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
        # 5.x: rope_parameters holds rope_theta and the scaling; 4.x: rope_theta + rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        legacy = d.get("rope_scaling") or {}
        rope = {**legacy, **rope}
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
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
