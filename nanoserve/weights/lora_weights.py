"""LoRA adapters in PEFT's format, read from local folders: `adapter_config.json` and
`adapter_model.safetensors` (what `PeftModel.save_pretrained` writes).

What is read, and what is refused (a `ModelError` naming the folder and the field or tensor):
- `peft_type` "LORA"; `r`; `lora_alpha`; `use_rslora` (the scale is lora_alpha / sqrt(r),
  else lora_alpha / r); `target_modules`, a list among q_proj, k_proj, v_proj, o_proj,
  gate_proj, up_proj, down_proj (or "all-linear": all seven). An embedding or LM-head target,
  a module path or a regular expression is refused;
- fields that would change the forward must hold their neutral value: `use_dora` false,
  `bias` "none", `lora_bias` false, `modules_to_save` and `trainable_token_indices` empty,
  `fan_in_fan_out` false, `rank_pattern` / `alpha_pattern` empty, `layers_to_transform`,
  `layers_pattern`, `layer_replication`, `exclude_modules`, `target_parameters` empty,
  `use_qalora` false, and the variants' configs (`alora_invocation_tokens`,
  `arrow_config`, `kasa_config`, `megatron_config`, `monteclora_config`, `use_bdlora`,
  `velora_config`) null;
- training-only fields are ignored (`lora_dropout`, `init_lora_weights` and the init
  methods' configs, `inference_mode`, `base_model_name_or_path`, ...); any other field is
  refused as unknown (the reader knows PEFT's LoRA fields up to 0.21);
- tensors: exactly `base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_A.weight`
  [r, in] and `...lora_B.weight` [out, r] for every decoder layer and target, in a floating
  dtype; `adapter_model.bin` (pickle) is never read.

`check_adapter` does all of that from the JSON and the safetensors header alone (torch-free:
the job's driver calls it before any worker starts); `load_adapter` then reads the tensors
into host memory as `LoraAdapter` (B with the scale folded in, in the model's dtype), from
which the engine fills its device slots (nanoserve/model/lora.py).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanoserve.errors import ModelError, NanoserveError
from nanoserve.model.config import ModelConfig
from nanoserve.model.lora import TARGETS, part_shapes

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# Fields that must hold a neutral value (any of these), and the fields read or ignored.
_EMPTY = (None, [], {}, "")
_NEUTRAL: dict[str, tuple] = {
    "use_dora": (False, None), "bias": ("none", None), "lora_bias": (False, None),
    "modules_to_save": _EMPTY, "trainable_token_indices": _EMPTY,
    "fan_in_fan_out": (False, None), "rank_pattern": _EMPTY, "alpha_pattern": _EMPTY,
    "layers_to_transform": _EMPTY, "layers_pattern": _EMPTY, "layer_replication": _EMPTY,
    "exclude_modules": _EMPTY, "target_parameters": _EMPTY, "use_qalora": (False, None),
    "alora_invocation_tokens": _EMPTY, "arrow_config": _EMPTY, "kasa_config": _EMPTY,
    "megatron_config": _EMPTY, "monteclora_config": _EMPTY, "use_bdlora": (None, False),
    "velora_config": _EMPTY,
}
_READ = ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules")
_IGNORED = ("base_model_name_or_path", "revision", "task_type", "inference_mode",
            "init_lora_weights", "lora_dropout", "auto_mapping", "megatron_core", "peft_version",
            "qalora_group_size", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
            "ensure_weight_tying")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]*")
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_(A|B)\.weight")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine uses of an adapter_config.json."""

    rank: int
    alpha: float
    rslora: bool
    targets: tuple[str, ...]  # in `TARGETS` order

    @property
    def scale(self) -> float:
        """The update's factor: lora_alpha / sqrt(r) under rsLoRA, else lora_alpha / r."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass
class LoraAdapter:
    """One adapter in host memory: `tensors[(layer, target)]` = (A [r, in], scale * B
    [out, r]) in the model's dtype (pinned for a CUDA device)."""

    name: str
    path: Path
    config: AdapterConfig
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def parse_lora_specs(specs: Mapping[str, str | Path] | Sequence[str] | None
                     ) -> dict[str, Path]:
    """{name: folder} from a mapping or from "NAME=PATH" strings (`--lora`). NanoserveError
    for a malformed one, a name given twice, or an object-store URI (adapters are read from
    local folders: copy one down first)."""
    if not specs:
        return {}
    if isinstance(specs, str):
        specs = [specs]
    pairs = list(specs.items()) if isinstance(specs, Mapping) else []
    if not isinstance(specs, Mapping):
        for spec in specs:
            name, sep, path = str(spec).partition("=")
            if not sep or not path:
                raise NanoserveError(f"--lora takes NAME=PATH (an adapter's name and its PEFT "
                                     f"folder), got {spec!r}")
            pairs.append((name, path))
    out: dict[str, Path] = {}
    for name, path in pairs:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise NanoserveError(f"LoRA adapter name {name!r}: use letters, digits and "
                                 f"_ . : / - (starting with a letter or digit)")
        if name in out:
            raise NanoserveError(f"LoRA adapter {name!r} is named twice")
        if "://" in str(path):
            raise NanoserveError(f"LoRA adapter {name!r}: {path} is a URI; adapters are read "
                                 f"from local folders (copy it to one first)")
        out[name] = Path(path).expanduser().absolute()
    return out


def read_adapter_config(folder: Path) -> AdapterConfig:
    """The adapter's `AdapterConfig`, every field checked (see the module docstring)."""
    file = folder / CONFIG_FILE
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"LoRA adapter {folder}: no {CONFIG_FILE} (a PEFT adapter folder "
                         f"holds {CONFIG_FILE} and {WEIGHTS_FILE})") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"LoRA adapter {folder}: {CONFIG_FILE} is not readable JSON "
                         f"({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"LoRA adapter {folder}: {CONFIG_FILE} is not a JSON object")

    def refuse(what: str) -> ModelError:
        return ModelError(f"LoRA adapter {folder}: {CONFIG_FILE}: {what}")

    for key, value in raw.items():
        if key in _NEUTRAL and value not in _NEUTRAL[key]:
            raise refuse(f"{key} = {json.dumps(value)} is not supported (only plain LoRA: "
                         f"{key} must be {json.dumps(_NEUTRAL[key][0])})")
        if key not in _NEUTRAL and key not in _READ and key not in _IGNORED:
            raise refuse(f"unknown field {key!r} (this reader knows PEFT's LoRA fields up "
                         f"to PEFT 0.21)")
    if raw.get("peft_type") != "LORA":
        raise refuse(f"peft_type = {json.dumps(raw.get('peft_type'))}; only LORA adapters run")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be an integer >= 1, got {json.dumps(rank)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise refuse(f"lora_alpha must be a number > 0, got {json.dumps(alpha)}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise refuse(f"use_rslora must be true or false, got {json.dumps(rslora)}")
    return AdapterConfig(rank, float(alpha), rslora, _targets(raw.get("target_modules"), refuse))


def _targets(value: Any, refuse) -> tuple[str, ...]:
    if value == "all-linear":
        return TARGETS
    if isinstance(value, str):
        raise refuse(f"target_modules = {json.dumps(value)}: a regular expression is not "
                     f"supported; list the modules ({', '.join(TARGETS)})")
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise refuse(f"target_modules must be a non-empty list of module names, got "
                     f"{json.dumps(value)}")
    for t in value:
        if t in ("embed_tokens", "lm_head"):
            raise refuse(f"target_modules: {t!r} (an embedding target) is not supported; "
                         f"LoRA applies to {', '.join(TARGETS)}")
        if t not in TARGETS:
            raise refuse(f"target_modules: {t!r} is not supported; LoRA applies to "
                         f"{', '.join(TARGETS)}")
    return tuple(t for t in TARGETS if t in value)


def expected_tensors(config: ModelConfig, adapter: AdapterConfig
                     ) -> dict[str, tuple[int, str, str, tuple[int, int]]]:
    """Each tensor the adapter must hold: name -> (layer, target, "A" | "B", shape)."""
    shapes = part_shapes(config)
    out = {}
    for layer in range(config.num_hidden_layers):
        for t in adapter.targets:
            where = "self_attn" if t in _ATTENTION else "mlp"
            n_out, n_in = shapes[t]
            for kind, shape in (("A", (adapter.rank, n_in)), ("B", (n_out, adapter.rank))):
                name = f"base_model.model.model.layers.{layer}.{where}.{t}.lora_{kind}.weight"
                out[name] = (layer, t, kind, shape)
    return out


def check_adapter(folder: str | Path, config: ModelConfig) -> AdapterConfig:
    """Everything `load_adapter` would refuse, from the config and the safetensors header
    alone (no tensor data read, no torch)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelError(f"LoRA adapter {folder}: no such folder")
    adapter = read_adapter_config(folder)
    moe = [layer for layer in range(config.num_hidden_layers) if config.is_moe_layer(layer)]
    mlp = [t for t in adapter.targets if t not in _ATTENTION]
    if moe and mlp:
        raise ModelError(f"LoRA adapter {folder}: target {mlp[0]!r} on a mixture-of-experts "
                         f"MLP (layer {moe[0]}) is not supported; attention targets are")
    header = _header(folder)
    expected = expected_tensors(config, adapter)
    for name, (dtype, shape) in header.items():
        if name not in expected:
            raise ModelError(f"LoRA adapter {folder}: tensor {name!r} is not a LoRA A/B of a "
                             f"decoder layer's {'/'.join(adapter.targets)} (its "
                             f"target_modules); nothing else is supported")
        want = expected[name][3]
        if tuple(shape) != want:
            raise ModelError(f"LoRA adapter {folder}: tensor {name!r} has shape {list(shape)}, "
                             f"expected {list(want)} (r = {adapter.rank} and the model's shape)")
        if dtype not in _FLOAT_DTYPES:
            raise ModelError(f"LoRA adapter {folder}: tensor {name!r} has dtype {dtype}, not "
                             f"floating point")
    missing = [n for n in expected if n not in header]
    if missing:
        raise ModelError(f"LoRA adapter {folder}: tensor {missing[0]!r} is missing (every "
                         f"layer's A and B of each of target_modules)")
    return adapter


def _header(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """The safetensors file's tensors from its JSON header: name -> (dtype, shape)."""
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        more = (f" ({file.with_suffix('.bin').name} is pickle, never read: save with "
                f"safe_serialization=True)") if (folder / "adapter_model.bin").exists() else ""
        raise ModelError(f"LoRA adapter {folder}: no {WEIGHTS_FILE}{more}")
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > file.stat().st_size:
                raise ValueError("its header runs past the file's end")
            header = json.loads(f.read(length))
        return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise ModelError(f"LoRA adapter {folder}: {WEIGHTS_FILE} is not a readable "
                         f"safetensors file ({e})") from None


def load_adapter(name: str, folder: str | Path, config: ModelConfig, dtype: torch.dtype,
                 pin: bool = False) -> LoraAdapter:
    """The adapter in host memory (see `LoraAdapter`), after `check_adapter`."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    adapter = check_adapter(folder, config)
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(folder / WEIGHTS_FILE, framework="pt") as f:
            for tensor, (layer, target, kind, _) in expected_tensors(config, adapter).items():
                w = f.get_tensor(tensor).float()
                if kind == "B":
                    w = w * adapter.scale
                w = w.to(dtype)
                tensors.setdefault((layer, target), {})[kind] = w.pin_memory() if pin else w
    except (SafetensorError, OSError) as e:
        raise ModelError(f"LoRA adapter {folder}: {WEIGHTS_FILE} is not readable (truncated "
                         f"or corrupt?): {e}") from None
    return LoraAdapter(name, folder, adapter,
                       {k: (v["A"], v["B"]) for k, v in tensors.items()})


def check_lora_adapters(specs: Mapping[str, str | Path] | Sequence[str] | None,
                        config: ModelConfig) -> dict[str, Path]:
    """`parse_lora_specs`, then `check_adapter` on each against the model's config: what a
    job's driver checks before any worker starts. Returns {name: folder}."""
    folders = parse_lora_specs(specs)
    for folder in folders.values():
        check_adapter(folder, config)
    return folders


__all__ = ["AdapterConfig", "LoraAdapter", "check_adapter", "check_lora_adapters",
           "expected_tensors", "load_adapter", "parse_lora_specs", "read_adapter_config"]
