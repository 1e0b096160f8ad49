"""Checkpoint loading: a Hugging Face folder (config.json + safetensors, single or sharded) or a
single-file GGUF, to a `ModelConfig` and a state dict with `LlamaForCausalLM` names.

Invariants of what `load_checkpoint` returns:
- the state dict holds exactly the names of `expected_shapes(config)`, each with that shape
  (extra tensors in the file, e.g. rotary `inv_freq` or a tied `lm_head.weight`, are dropped);
- tensors keep their stored dtype (bf16 stays bf16); GGUF quantized tensors become float32;
- a mixture of experts' per-expert tensors come stacked, one per projection
  (nanoserve/weights/moe_weights.py);
- an FP8 checkpoint (`config.quantization`, nanoserve/model/quantization.py) adds, beside each
  stored FP8 weight, its scale tensors under their stored names (`...weight_scale` or
  `...weight_scale_inv`, and `...input_scale`): nanoserve/weights/fp8.py turns them into a model;
- weights are read only through safetensors or GGUF, never with `torch.load` / pickle.
Every problem with the files is a `ModelError` naming the file and, where there is one, the
tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from nanoserve.errors import ModelError
from nanoserve.model.config import STACKED, ModelConfig
from nanoserve.model.quantization import scale_names
from nanoserve.weights.moe_weights import expert_shapes, stack_experts, stacked_shapes

if TYPE_CHECKING:  # torch is imported where tensors are made: a job's driver reads no weights
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide for `config`, by Hugging Face name, with its
    shape. `lm_head.weight` only when the head is not tied to the embedding (and the model
    has one), `score.weight` for a classifier; q/k/v biases
    with `qkv_bias` (Qwen2), `q_norm`/`k_norm` weights with `qk_norm` (Qwen3)."""
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_dim)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if config.is_moe_layer(layer):  # router and stacked experts (nanoserve/weights/moe_weights.py)
            shapes.update(expert_shapes(config, layer))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (i, d)
        shapes[p + "mlp.up_proj.weight"] = (i, d)
        shapes[p + "mlp.down_proj.weight"] = (d, i)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings and not config.headless:
        shapes["lm_head.weight"] = (v, d)
    if config.is_classifier:  # a sequence-classification head in the LM head's place
        shapes["score.weight"] = (config.num_labels, d)
    if config.vision is not None:
        from nanoserve.multimodal.vision_config import vision_shapes

        shapes.update({f"visual.{n}": s for n, s in vision_shapes(config.vision).items()})
    return shapes


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a Hugging Face checkpoint folder or a `.gguf` file; see the module invariants."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from nanoserve.weights.model_store import (
            CONFIG_FILE,
            PreparedCacheError,
            prepared_default_model,
        )

        # The default model: converted once, then read as safetensors (model_store).
        prepared = prepared_default_model(path, _prepared_contents)
        if prepared is not None:
            try:
                config = ModelConfig.from_hf_dict(prepared.read_json(CONFIG_FILE))
                return config, _checked(config, prepared.tensors(), str(path))
            except PreparedCacheError as e:
                prepared.discard(e)
        from nanoserve.weights.gguf_file import (
            read_gguf,  # the gguf package: imported for GGUF only
        )

        config, tensors = read_gguf(path)
        return config, _checked(config, tensors, str(path))
    if path.is_dir():
        config = _read_config(path)
        files = _safetensors_files(path)
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(_read_safetensors(file))
        source = str(files[0]) if len(files) == 1 else f"{path} ({len(files)} safetensors shards)"
        return config, _checked(config, tensors, source)
    if path.exists():
        raise ModelError(f"{path} is neither a .gguf file nor a checkpoint folder")
    raise ModelError(f"no such checkpoint: {path}")


def validate_checkpoint(path: str | Path) -> ModelConfig:
    """What `load_checkpoint` would refuse, found from headers alone (no tensor data is
    read): the config, every expected tensor's presence and shape, and that each file is
    as long as its header says. Cheap enough for a job's driver to call before any worker
    loads the model."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from nanoserve.weights.model_store import (
            CONFIG_FILE,
            PreparedCacheError,
            prepared_default_model,
        )

        # The default model: its GGUF header is parsed once, when its prepared copy is
        # written (model_store); then its config and tensor shapes are read from that.
        prepared = prepared_default_model(path, _prepared_contents)
        if prepared is not None:
            try:
                config = ModelConfig.from_hf_dict(prepared.read_json(CONFIG_FILE))
                _check_shapes(config, prepared.tensor_shapes(), str(path))
                return config
            except PreparedCacheError as e:
                prepared.discard(e)
        from nanoserve.weights.gguf_file import gguf_config_dict, hf_name, open_gguf

        reader = open_gguf(path)  # memory-maps: a truncated file fails here
        config = ModelConfig.from_hf_dict(gguf_config_dict(reader, path))
        # GGUF shapes are innermost-first; ours are outermost-first.
        shapes = {hf_name(t.name): tuple(int(x) for x in reversed(t.shape.tolist()))
                  for t in reader.tensors}
        _check_shapes(config, {k: v for k, v in shapes.items() if k}, str(path))
        return config
    if not path.is_dir():
        return load_checkpoint(path)[0]  # raises the same clear error
    config = _read_config(path)
    shapes = {}
    files = _safetensors_files(path)
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as e:
            raise ModelError(
                f"{file} is not a readable safetensors file (truncated or corrupt?): {e}"
            ) from None
    source = str(files[0]) if len(files) == 1 else f"{path} ({len(files)} safetensors shards)"
    _check_shapes(config, shapes, source)
    return config


def _prepared_contents(path: Path) -> dict[str, bytes]:
    """The default model's prepared files (`nanoserve.weights.model_store`), from its GGUF file."""
    from nanoserve.weights.gguf_file import open_gguf, prepared_contents
    from nanoserve.weights.tokenizer import Tokenizer

    return prepared_contents(path, Tokenizer.from_gguf(path, open_gguf(path)).to_prepared())


def _with_model_prefix(config: ModelConfig, tensors: dict) -> dict:
    """A base model saved alone (transformers' `Qwen3Model`/`LlamaModel`, as embedding
    checkpoints are) names its tensors without the `model.` prefix: add it. A family's
    `renamed_prefixes` (nanoserve/model/families.py) are renamed: e.g. a vision-language model saved
    with the nested names (`model.language_model.*`, `model.visual.*`) gets the flat ones
    (`model.*`, `visual.*`) that transformers 5.25 writes."""
    renamed = config.family.renamed_prefixes
    if any(name.startswith(old) for name in tensors for old, _ in renamed):
        tensors = {_renamed(name, renamed): t for name, t in tensors.items()}
    if "model.embed_tokens.weight" in tensors or "embed_tokens.weight" not in tensors:
        return tensors
    return {name if name.startswith("lm_head.") else f"model.{name}": t
            for name, t in tensors.items()}


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _check_shapes(config: ModelConfig, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    shapes = stacked_shapes(config, _with_model_prefix(config, shapes))
    for name, shape in expected_shapes(config).items():
        if name not in shapes:
            raise ModelError(f"tensor {name!r} is missing from {source}")
        if shapes[name] != shape:
            raise ModelError(
                f"tensor {name!r} in {source} has shape {list(shapes[name])}, "
                f"expected {list(shape)} from the config"
            )


def _read_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelError(f"no config.json in {folder}")
    try:
        d = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ModelError(f"{config_path} does not hold a JSON object")
    return ModelConfig.from_hf_dict(d)


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index lists, or model.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ModelError(f"{index} is not a valid safetensors index ({e!r})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelError(f"shard {file.name} listed in {index} is missing")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise ModelError(
            f"{folder} holds only PyTorch pickle weights (.bin/.pt); nanoserve reads "
            f"safetensors only (pickle files can run code when loaded): convert the "
            f"checkpoint to safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise ModelError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}")


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(file, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise ModelError(
            f"{file} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from None


def _checked(
    config: ModelConfig, tensors: dict[str, torch.Tensor], source: str
) -> dict[str, torch.Tensor]:
    """Keep the expected tensors, in `expected_shapes` order; refuse missing or misshapen ones."""
    shapes = expected_shapes(config)
    tensors = stack_experts(config, _with_model_prefix(config, tensors))
    missing = [name for name in shapes if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelError(f"tensor {missing[0]!r}{more} is missing from {source}")
    out = {}
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ModelError(
                f"tensor {name!r} in {source} has shape {list(t.shape)}, "
                f"expected {list(shape)} from the config"
            )
        if not t.is_floating_point():
            raise ModelError(f"tensor {name!r} in {source} has dtype {t.dtype}, not floating point")
        out[name] = t
    if config.quantization is not None:  # an FP8 linear's scales ride beside its weight
        out.update({n: tensors[n] for n in scale_names(config.quantization, shapes)
                    if n in tensors})
        out.update({n + "_scale": tensors[n + "_scale"] for n in shapes
                    if n.endswith(STACKED) and n + "_scale" in tensors})
    return out
