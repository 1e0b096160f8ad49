"""Single-file GGUF (llama.cpp) checkpoints: metadata to a `ModelConfig`, tensors to Hugging
Face `LlamaForCausalLM` names, and the tokenizer metadata.

Architectures (`general.architecture`): the families whose record (nanoserve/model/families.py)
names one (`gguf_name`): `llama` (Llama; llama.cpp also writes Mistral as `llama`, without
its sliding window), `qwen2` (q/k/v biases) and `qwen3` (`attn_q_norm` / `attn_k_norm`),
tensor names as the gguf package's constants give them.

GGUF facts this module relies on:
- tensor shapes are listed innermost-first; numpy arrays from `GGUFReader` are already
  outermost-first (a `[d_out, d_in]` weight is listed as `(d_in, d_out)`);
- for `llama` only (`gguf_permuted_qk`), llama.cpp permutes the rows of `attn_q` / `attn_k`
  per head for its rotary layout (interleaved pairs); `_unpermute_rows` undoes it (n_head
  for q, n_kv_head for k); Qwen files keep Hugging Face's row order;
- metadata keys are prefixed by the architecture (`qwen2.embedding_length`);
- there is no `output.weight` when the LM head is tied to the embedding.

`GGUFReader` memory-maps the file: a tensor is read (and dequantized) only when converted.
Unquantized tensors (F32, F16, BF16, F64) keep their stored dtype; quantized ones are
dequantized with `gguf.quants.dequantize` to float32.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from nanoserve.errors import ModelError
from nanoserve.model.config import ModelConfig
from nanoserve.model.families import GGUF_NAMES, by_gguf_name

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_STORED_DTYPES = {  # GGUF types read as they are, no dequantization
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.F64: torch.float64,
}
_INTEGER_TYPES = {
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
}


def open_gguf(path: str | Path) -> GGUFReader:
    """Open (memory-map) a GGUF file; an unreadable or malformed file is a ModelError.

    Parsing the header takes seconds for a vocabulary-sized metadata block, and a process
    reads the same file for its config, its tensors and its tokenizer: the reader of the
    last two files opened is kept, keyed by path, size and modification time (a rewritten
    file is parsed again). Readers are only read from, never changed."""
    path = Path(path)
    try:
        stat = path.resolve().stat()
    except FileNotFoundError:
        raise ModelError(f"no such GGUF file: {path}") from None
    return _open_gguf_cached(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return GGUFReader(path)
    except FileNotFoundError:
        raise ModelError(f"no such GGUF file: {path}") from None
    except Exception as e:  # the reader raises ValueError, IndexError, ... on bad bytes
        raise ModelError(
            f"{path} is not a readable GGUF file: truncated (an interrupted download?) or "
            f"corrupt ({type(e).__name__}: {e})"
        ) from None


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors nanoserve does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def gguf_config_dict(reader: GGUFReader, path: str | Path = "") -> dict[str, Any]:
    """The GGUF metadata as a transformers-style `config.json` dict (5.x spelling)."""
    arch = _field(reader, "general.architecture")
    family = by_gguf_name(arch)
    if family is None:
        raise ModelError(
            f"{path}: GGUF architecture {arch!r} is not supported; nanoserve runs "
            f"{', '.join(repr(a) for a in GGUF_NAMES)}"
        )
    names = {t.name for t in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        if meta(key) is None:
            raise ModelError(f"{path}: GGUF metadata has no '{arch}.{key}'")
    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in names:
        raise ModelError(
            f"{path}: GGUF rope scaling ({scaling!r}, rope_freqs tensor: "
            f"{'rope_freqs.weight' in names}) is not supported; use the Hugging Face folder"
        )
    hidden = meta("embedding_length")
    n_heads = meta("attention.head_count")
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden // n_heads
    rot_dim = meta("rope.dimension_count", head_dim)
    if rot_dim != head_dim:
        raise ModelError(
            f"{path}: partial rotary (rope.dimension_count {rot_dim} < head_dim {head_dim}) "
            f"is not supported"
        )
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ModelError(f"{path}: GGUF metadata gives no vocabulary size")
    if family.qkv_bias and "blk.0.attn_q.bias" not in names:
        raise ModelError(f"{path}: a {arch} GGUF needs q/k/v biases (blk.0.attn_q.bias)")
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta("attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta("context_length", 2048),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_parameters": {"rope_type": "default", "rope_theta": meta("rope.freq_base", 10000.0)},
        "tie_word_embeddings": "output.weight" not in names,
        # Qwen2's q/k/v biases are the family's own; elsewhere a bias is unsupported
        "attention_bias": not family.qkv_bias and "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def read_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a llama / qwen2 / qwen3 GGUF file: its config and its tensors under Hugging Face names (names
    nanoserve does not use are skipped without being read). Shapes are not checked here."""
    path = Path(path)
    reader = open_gguf(path)
    config = ModelConfig.from_hf_dict(gguf_config_dict(reader, path))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        w = _to_torch(t, path)  # [outermost, ..., innermost]
        if not config.family.gguf_permuted_qk:
            pass  # only llama.cpp's llama converter permutes q/k rows
        elif name.endswith("q_proj.weight"):
            w = _unpermute_rows(w, config.num_attention_heads, f"{path}: {t.name}")
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rows(w, config.num_key_value_heads, f"{path}: {t.name}")
        tensors[name] = w
    return config, tensors


def prepared_contents(path: str | Path, tokenizer: tuple[str, dict[str, Any]]
                      ) -> dict[str, bytes]:
    """The files of a GGUF file's prepared copy (`nanoserve.weights.model_store`), by name: its
    config dict as `config.json`, the tensors `read_gguf` gives as `model.safetensors`
    (q/k/v and gate/up fused, `model_store.fuse_for_storage`), and
    `tokenizer` (`Tokenizer.to_prepared()` of the tokenizer built from this file) as
    `tokenizer.json` and `tokenizer_meta.json`."""
    import json

    from safetensors.torch import save

    from nanoserve.weights import model_store
    path = Path(path)
    backend_json, meta = tokenizer
    tensors, metadata = model_store.fuse_for_storage(read_gguf(path)[1])
    return {
        model_store.CONFIG_FILE: json.dumps(gguf_config_dict(open_gguf(path), path),
                                            indent=1).encode(),
        model_store.TENSORS_FILE: save(tensors, metadata=metadata),
        model_store.TOKENIZER_FILE: backend_json.encode(),
        model_store.TOKENIZER_META_FILE: json.dumps(meta, indent=1).encode(),
    }


def gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The tokenizer part of a GGUF file's metadata. Keys (None where the file has none):
    model (e.g. 'gpt2' for byte-level BPE), pre (pre-tokenizer name), tokens (list[str]),
    merges (list[str], 'a b' pairs), token_type (list[int], llama.cpp token types),
    bos_token_id, eos_token_id, unknown_token_id, padding_token_id, add_bos_token (bool),
    chat_template (str)."""
    reader = open_gguf(path)

    def tok(key: str) -> Any:
        return _field(reader, f"tokenizer.{key}")

    add_bos = tok("ggml.add_bos_token")
    return {
        "model": tok("ggml.model"),
        "pre": tok("ggml.pre"),
        "tokens": tok("ggml.tokens"),
        "merges": tok("ggml.merges"),
        "token_type": tok("ggml.token_type"),
        "bos_token_id": tok("ggml.bos_token_id"),
        "eos_token_id": tok("ggml.eos_token_id"),
        "unknown_token_id": tok("ggml.unknown_token_id"),
        "padding_token_id": tok("ggml.padding_token_id"),
        "add_bos_token": None if add_bos is None else bool(add_bos),
        "chat_template": tok("chat_template"),
    }


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _to_torch(t: Any, path: Path) -> torch.Tensor:
    """One GGUF tensor as a torch tensor of its logical shape (outermost first)."""
    qtype = t.tensor_type
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    if qtype in _STORED_DTYPES:
        return torch.from_numpy(np.array(t.data)).reshape(shape)  # copy out of the mmap
    if qtype == GGMLQuantizationType.BF16:  # stored as raw bytes
        raw = np.array(t.data).view(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
    if qtype in _INTEGER_TYPES:
        raise ModelError(f"{path}: tensor {t.name} has integer type {qtype.name}, not weights")
    try:
        values = dequantize(t.data, qtype)  # float32, [..., innermost]
    except NotImplementedError:
        raise ModelError(
            f"{path}: tensor {t.name} uses quantization type {qtype.name}, which the gguf "
            f"package cannot dequantize; use a file quantized as F32/F16/BF16/Q8_0/Q4_0/Q4_1/"
            f"Q5_0/Q5_1 or a k-quant (Q2_K..Q6_K)"
        ) from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def _unpermute_rows(w: torch.Tensor, n_head: int, what: str) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a q/k projection `[n_head*D, d]`. Within a
    head, Hugging Face orders the rows as [2, D/2] (first halves, then second halves of the
    rotary pairs); llama.cpp interleaves them as [D/2, 2]."""
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelError(f"{what} has {rows} rows, which cannot be split into {n_head} heads")
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])  # [H, D/2, 2, d]
        .swapaxes(1, 2)  # [H, 2, D/2, d]
        .reshape(w.shape)
        .contiguous()
    )
