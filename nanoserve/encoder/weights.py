"""An encoder checkpoint's tensors, named as transformers saves them, onto nanoserve's
modules (nanoserve/encoder/bert.py, modernbert.py, heads.py).

transformers' names (the base model's under the family's prefix in a classification
checkpoint: `bert.`, `roberta.`, `model.`; without it in a base model's, which is what
sentence-transformers saves) -> nanoserve's:

    BERT / XLM-R                                     ModernBERT
    embeddings.word_embeddings       body.word       embeddings.tok_embeddings   body.word
    embeddings.position_embeddings   body.position   embeddings.norm             body.emb_norm
    embeddings.token_type_embeddings body.token_type layers.i.attn_norm          ...attn_norm
    embeddings.LayerNorm             body.emb_norm   layers.i.attn.Wqkv          ...qkv
    encoder.layer.i.attention.self.{query,key,value} layers.i.attn.Wo            ...attn_out
                             body.layers.i.qkv (q, k, v stacked on dim 0)
    ...attention.output.dense        ...attn_out     layers.i.mlp_norm           ...mlp_norm
    ...attention.output.LayerNorm    ...attn_norm    layers.i.mlp.Wi             ...wi
    ...intermediate.dense            ...up           layers.i.mlp.Wo             ...wo
    ...output.dense                  ...down         final_norm                  body.final_norm
    ...output.LayerNorm              ...mlp_norm
    heads: BERT `<prefix>pooler.dense` -> head.pooler, `classifier` -> head.classifier;
    XLM-R `classifier.dense` / `classifier.out_proj` -> head.dense / head.out_proj;
    ModernBERT `head.dense`, `head.norm`, `classifier` -> head.dense, head.norm, head.classifier.

Every parameter of the built model must be found with its shape (ModelError naming it
otherwise); a tensor no parameter reads is a ModelError too, except a base model's unused
pooler and `position_ids` buffers of older checkpoints. Read through safetensors only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from nanoserve.encoder.config import EncoderConfig
from nanoserve.errors import ModelError

# nanoserve's module path ({i}: a layer) -> transformers' module path(s) under the prefix
_BERT_BODY = {
    "word": ("embeddings.word_embeddings",),
    "position": ("embeddings.position_embeddings",),
    "token_type": ("embeddings.token_type_embeddings",),
    "emb_norm": ("embeddings.LayerNorm",),
    "layers.{i}.qkv": ("encoder.layer.{i}.attention.self.query",
                       "encoder.layer.{i}.attention.self.key",
                       "encoder.layer.{i}.attention.self.value"),
    "layers.{i}.attn_out": ("encoder.layer.{i}.attention.output.dense",),
    "layers.{i}.attn_norm": ("encoder.layer.{i}.attention.output.LayerNorm",),
    "layers.{i}.up": ("encoder.layer.{i}.intermediate.dense",),
    "layers.{i}.down": ("encoder.layer.{i}.output.dense",),
    "layers.{i}.mlp_norm": ("encoder.layer.{i}.output.LayerNorm",),
}
_MODERNBERT_BODY = {
    "word": ("embeddings.tok_embeddings",),
    "emb_norm": ("embeddings.norm",),
    "layers.{i}.attn_norm": ("layers.{i}.attn_norm",),
    "layers.{i}.qkv": ("layers.{i}.attn.Wqkv",),
    "layers.{i}.attn_out": ("layers.{i}.attn.Wo",),
    "layers.{i}.mlp_norm": ("layers.{i}.mlp_norm",),
    "layers.{i}.wi": ("layers.{i}.mlp.Wi",),
    "layers.{i}.wo": ("layers.{i}.mlp.Wo",),
    "final_norm": ("final_norm",),
}
# heads: full transformers names; "{prefix}" is the family's base-model prefix
_HEADS = {
    "bert": {"pooler": ("{prefix}pooler.dense",), "classifier": ("classifier",)},
    "roberta": {"dense": ("classifier.dense",), "out_proj": ("classifier.out_proj",)},
    "modernbert": {"dense": ("head.dense",), "norm": ("head.norm",),
                   "classifier": ("classifier",)},
}
_LAYER = re.compile(r"\.(\d+)\.")


def _head_kind(cfg: EncoderConfig) -> str:
    if cfg.family.kind == "modernbert":
        return "modernbert"
    return "roberta" if cfg.family.position_offset else "bert"


def source_names(cfg: EncoderConfig, name: str, prefix: str) -> tuple[str, ...]:
    """transformers' tensor names that make nanoserve's parameter `name` ('body.layers.0.
    qkv.weight', 'head.classifier.bias'), stacked on dim 0 in this order."""
    part, module_path, param = name.partition(".")[0], *name.split(".", 1)[1].rsplit(".", 1)
    layer = _LAYER.search(f".{module_path}.")
    template = _LAYER.sub(".{i}.", f".{module_path}.").strip(".") if layer else module_path
    if part == "body":
        table = _BERT_BODY if cfg.family.kind == "bert" else _MODERNBERT_BODY
        sources = [prefix + s for s in table[template]]
    else:
        sources = [s.format(prefix=cfg.family.prefix) for s in _HEADS[_head_kind(cfg)][template]]
    i = layer.group(1) if layer else ""
    return tuple(f"{s.replace('{i}', i)}.{param}" for s in sources)


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ModelError(f"{index} is not a safetensors index: {e}") from None
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise ModelError(f"{folder}: no model.safetensors (nanoserve reads safetensors only)")


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(Path(folder)):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except (OSError, SafetensorError) as e:
            raise ModelError(f"{file} could not be read: {e}") from None
    return out


def _ignorable(name: str, cfg: EncoderConfig) -> bool:
    return name.endswith("position_ids") or (cfg.headless and ".pooler." in f".{name}")


def load_into(model: torch.nn.Module, cfg: EncoderConfig, tensors: dict[str, torch.Tensor],
              source: str = "checkpoint") -> None:
    """Copy `tensors` (transformers' names) into `model`'s parameters (nanoserve's names:
    `body.*`, `head.*`), converting dtype; see the module docstring for what is refused."""
    prefix = cfg.family.prefix
    if cfg.headless and source_names(cfg, "body.word.weight", "")[0] in tensors:
        prefix = ""  # a base model's own names (some exports keep the head model's prefix)
    used: set[str] = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            names = source_names(cfg, name, prefix)
            missing = [n for n in names if n not in tensors]
            if missing:
                raise ModelError(f"{source}: no tensor {missing[0]!r} (for {name})")
            value = torch.cat([tensors[n] for n in names]) if len(names) > 1 else tensors[names[0]]
            if tuple(value.shape) != tuple(param.shape):
                raise ModelError(f"{source}: {', '.join(names)} has shape {tuple(value.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))
            used.update(names)
    extra = sorted(n for n in tensors if n not in used and not _ignorable(n, cfg))
    if extra:
        raise ModelError(f"{source}: tensors nanoserve does not read: {', '.join(extra[:5])}"
                         f"{' ...' if len(extra) > 5 else ''}")


__all__ = ["checkpoint_files", "load_into", "read_tensors", "source_names"]
