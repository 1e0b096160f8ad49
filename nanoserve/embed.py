"""Embeddings: one pooled vector per input, from a prefill alone.

    emb = Embedder.load("Qwen3-Embedding-0.6B/")          # pooling read from the folder
    vectors = emb.embed(["a document", "another"])        # [2, dim] float32, on the CPU

Rows are packed back to back into one row of at most `max_batch_tokens` tokens
(`AttentionMetadata.packed`: `cu_seqlens`, the ragged prefill kernel) and run through the
model's forward without a KV cache (no pool is written, nothing is kept after the batch);
no decode step. The final normed hidden states are pooled per row (`pool`), in float32:
- `last`: the row's last token (Qwen3-Embedding; the tokenizer appends its end token);
- `mean`: the average over the row's tokens;
- `cls`: the row's first token;
then cut to the first `dimensions` values (Matryoshka) and, with `normalize`, scaled to
unit L2 norm (in that order, as Qwen3-Embedding documents for shorter vectors).

Where the settings come from (`resolve_pooling`): the arguments when given, else the model
folder's sentence-transformers files (`modules.json` with its `Pooling` module's
`config.json`, a `Normalize` module, `sentence_bert_config.json`'s `max_seq_length`), else
the defaults: `last`, normalised, all dimensions, the model's context as the input limit.
An `instruction` prefixes each text as Qwen3-Embedding's queries are:
`Instruct: {instruction}\\nQuery:{text}`.

An encoder folder (BERT, XLM-RoBERTa, ModernBERT: nanoserve/encoder/) runs the same way
through its `EncoderModel` (`Embedder.for_encoder`): bidirectional attention over the
packed rows, pooled by mean where the folder has no Pooling config.

Inputs longer than the limit are cut to it (keeping the tokenizer's closing special tokens,
so last-token pooling still reads the end token); `Embedder.prepare` says which were cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nanoserve.errors import InputError, ModelError
from nanoserve.model.attention import AttentionMetadata
from nanoserve.options import ENGINE

POOLING_MODES = ("last", "mean", "cls")
DEFAULT_MAX_BATCH_TOKENS = 16384
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None  # None: the model's hidden size
    instruction: str | None = None
    max_input_tokens: int | None = None  # None: the model's context

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise InputError(f"pooling must be one of {', '.join(POOLING_MODES)}, "
                             f"got {self.pooling!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise InputError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        if self.max_input_tokens is not None and (not isinstance(self.max_input_tokens, int)
                                                  or self.max_input_tokens < 1):
            raise InputError(f"max_input_tokens must be an integer >= 1, "
                             f"got {self.max_input_tokens!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize,
                "dimensions": self.dimensions, "instruction": self.instruction,
                "max_input_tokens": self.max_input_tokens}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} is not readable JSON: {e}") from None


def sentence_transformers_settings(folder: str | Path) -> dict[str, Any]:
    """What a model folder's sentence-transformers files say: `pooling`, `normalize`,
    `max_input_tokens` (the keys it has; {} for a folder without `modules.json`). A module
    nanoserve does not run (Dense, max pooling, ...) is a ModelError: skipping it would give
    other vectors than the model's."""
    folder = Path(folder)
    if not folder.is_dir() or not (folder / "modules.json").is_file():
        return {}
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        raise ModelError(f"{folder / 'modules.json'} does not hold a list of modules")
    out: dict[str, Any] = {"normalize": False}
    for m in modules:
        kind = m.get("type", "") if isinstance(m, dict) else ""
        if kind == _ST_TRANSFORMER:
            continue
        if kind == _ST_NORMALIZE:
            out["normalize"] = True
        elif kind == _ST_POOLING:
            pooling_cfg = _read_json(folder / m.get("path", "") / "config.json")
            out["pooling"] = _pooling_mode(pooling_cfg, folder)
            out["include_prompt"] = bool(pooling_cfg.get("include_prompt", True))
        else:
            raise ModelError(f"{folder / 'modules.json'}: module {kind or m!r} is not supported "
                             f"(nanoserve runs Transformer, Pooling and Normalize)")
    bert = folder / "sentence_bert_config.json"
    if bert.is_file():
        limit = _read_json(bert).get("max_seq_length")
        if isinstance(limit, int) and limit > 0:
            out["max_input_tokens"] = limit
    return out


def _pooling_mode(cfg: dict[str, Any], folder: Path) -> str:
    """A sentence-transformers Pooling config's mode, as one of POOLING_MODES."""
    names = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
    if isinstance(cfg.get("pooling_mode"), str):
        mode = cfg["pooling_mode"]
        if mode in names:
            return names[mode]
        raise ModelError(f"{folder}: pooling mode {mode!r} is not supported "
                         f"({', '.join(POOLING_MODES)})")
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    keys = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
            "pooling_mode_cls_token": "cls"}
    if len(on) != 1 or on[0] not in keys:
        raise ModelError(f"{folder}: pooling {', '.join(on) or 'none'} is not supported "
                         f"(one of {', '.join(keys)})")
    return keys[on[0]]


def resolve_pooling(model_path: str | Path, hidden_size: int, max_context: int, *,
                    pooling: str | None = None, normalize: bool | None = None,
                    dimensions: int | None = None, instruction: str | None = None,
                    max_input_tokens: int | None = None) -> PoolingConfig:
    """The job's pooling: the arguments given, else the model folder's, else the defaults
    (see the module docstring). InputError for a dimension above the hidden size."""
    st = sentence_transformers_settings(model_path)
    cfg = PoolingConfig(
        pooling=pooling if pooling is not None else st.get("pooling", "last"),
        normalize=normalize if normalize is not None else st.get("normalize", True),
        dimensions=dimensions, instruction=instruction or None,
        max_input_tokens=min(max_input_tokens or st.get("max_input_tokens") or max_context,
                             max_context))
    if (cfg.instruction and cfg.pooling == "mean"
            and not st.get("include_prompt", True)):
        raise InputError("the model's Pooling config leaves the prompt out of the mean "
                         "(include_prompt false), which nanoserve does not do: embed "
                         "without --instruction, or with --pooling last")
    if dimensions is not None and dimensions > hidden_size:
        raise InputError(f"dimensions ({dimensions}) is above the model's hidden size "
                         f"({hidden_size})")
    return cfg


def _dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """As `LLM`'s: 'auto' is bfloat16 on a GPU and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise InputError(f"unknown dtype {dtype!r}; choose auto, {', '.join(names)}")
    return names[dtype]


def with_instruction(text: str, instruction: str | None) -> str:
    """Qwen3-Embedding's query form."""
    return text if not instruction else f"Instruct: {instruction}\nQuery:{text}"


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [N, d] (rows packed by `cu_seqlens` [B + 1]) -> [B, d] float32."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    if mode == "last":
        return hidden[ends - 1].float()
    if mode == "cls":
        return hidden[starts].float()
    if mode == "mean":
        lens = ends - starts
        row = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)
        sums = torch.zeros(len(lens), hidden.shape[-1], dtype=torch.float32,
                           device=hidden.device)
        sums.index_add_(0, row, hidden.float())
        return sums / lens[:, None].float()
    raise ValueError(f"unknown pooling {mode!r}")


def finish(vectors: torch.Tensor, cfg: PoolingConfig) -> torch.Tensor:
    """Matryoshka cut, then L2 normalisation (float32)."""
    if cfg.dimensions is not None:
        vectors = vectors[:, :cfg.dimensions]
    if cfg.normalize:
        vectors = F.normalize(vectors, p=2.0, dim=-1)
    return vectors


class Embedder:
    """A loaded model's prefill as an embedding function (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, pooling: PoolingConfig,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.pooling = pooling
        self.max_batch_tokens = max(1, int(max_batch_tokens))
        self.limit = pooling.max_input_tokens or self.config.max_position_embeddings
        self.dim = pooling.dimensions or self.config.hidden_size
        self._suffix: tuple[int, ...] | None = None

    @classmethod
    def load(cls, model: str, dtype: str | torch.dtype = ENGINE["dtype"].default,
             device: str = "auto",
             max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, num_threads: int | None = None,
             **pooling: Any) -> Embedder:
        """Load a checkpoint (folder or name) for embedding only: no KV pool. On the CPU,
        `num_threads` as `nanoserve.llm.LLM`'s."""
        from nanoserve.cpu_threads import configure_torch_threads
        from nanoserve.model.model import build_model
        from nanoserve.weights.model_store import resolve_model
        from nanoserve.weights.tokenizer import Tokenizer
        from nanoserve.weights.weights import load_checkpoint

        path = resolve_model(model)
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                           if device == "auto" else device)
        if dev.type == "cpu":
            configure_torch_threads(num_threads)
        from nanoserve.encoder.model import is_encoder_folder, load_encoder

        if is_encoder_folder(path):  # BERT, XLM-R, ModernBERT: nanoserve/encoder/
            return cls.for_encoder(load_encoder(path, _dtype(dtype, dev), dev), path,
                                   max_batch_tokens, **pooling)
        config, state = load_checkpoint(path)
        built = build_model(config, state, _dtype(dtype, dev), dev)
        del state
        cfg = resolve_pooling(path, config.hidden_size, config.max_position_embeddings,
                              **pooling)
        return cls(built, Tokenizer.from_path(path), cfg, max_batch_tokens)

    @classmethod
    def for_encoder(cls, model: Any, folder: str | Path,
                    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, **pooling: Any) -> Embedder:
        """An encoder (nanoserve/encoder/model.py's `EncoderModel`, loaded from `folder`) as
        an embedding function: its tokenizer from the folder, its rows at most its max
        positions; pooling as for a decoder, except that a folder without a Pooling config
        pools by mean (sentence-transformers' default for a bare encoder)."""
        from nanoserve.weights.tokenizer import Tokenizer

        if pooling.get("pooling") is None and "pooling" not in sentence_transformers_settings(folder):
            pooling["pooling"] = "mean"
        cfg = resolve_pooling(folder, model.config.hidden_size,
                              model.config.max_position_embeddings, **pooling)
        return cls(model, Tokenizer.from_path(folder), cfg, max_batch_tokens)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def suffix(self) -> tuple[int, ...]:
        """The special tokens the tokenizer closes every text with (e.g. Qwen3's
        `<|endoftext|>`): kept when a text is cut to the limit."""
        if self._suffix is None:
            plain = self.tokenizer.encode("a", add_special_tokens=False)
            full = self.tokenizer.encode("a")
            at = next((i for i in range(len(full) - len(plain) + 1)
                       if full[i:i + len(plain)] == plain), None)
            self._suffix = tuple(full[at + len(plain):]) if at is not None else ()
        return self._suffix

    def encode(self, text: str) -> list[int]:
        """A text's token ids (the instruction prefixed), not yet cut to the limit."""
        return self.tokenizer.encode(with_instruction(text, self.pooling.instruction))

    def truncate(self, ids: list[int] | tuple[int, ...]) -> tuple[list[int], bool]:
        """(ids cut to the limit, whether they were cut)."""
        ids = list(ids)
        if len(ids) <= self.limit:
            return ids, False
        suffix = list(self.suffix())
        if suffix and ids[-len(suffix):] == suffix and len(suffix) < self.limit:
            return ids[:self.limit - len(suffix)] + suffix, True
        return ids[:self.limit], True

    def prepare(self, inputs: list[str] | list[list[int]]) -> tuple[list[list[int]], int]:
        """Texts (or token id lists) as token ids within the limit, and how many were cut.
        InputError for an empty input."""
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        for i in texts:
            if not inputs[i].strip():
                raise InputError(f"input {i} is empty: a text needs at least one "
                                 f"non-space character")
        encoded: dict[int, list[int]] = {}
        if texts:  # in the tokenizer library's parallel batch encoder where it has one
            instructed = [with_instruction(inputs[i], self.pooling.instruction) for i in texts]
            many = getattr(self.tokenizer, "encode_batch", None)
            ids_list = many(instructed) if many else [self.tokenizer.encode(t)
                                                      for t in instructed]
            encoded = dict(zip(texts, ids_list))
        out, cut = [], 0
        for i, x in enumerate(inputs):
            x = encoded.get(i, x)
            if len(x) == 0:
                raise InputError(f"input {i} has no tokens")
            ids, was_cut = self.truncate(x)
            cut += was_cut
            out.append(ids)
        return out, cut

    @torch.inference_mode()
    def embed_ids(self, rows: list[list[int]]) -> torch.Tensor:
        """[B, dim] float32 on the CPU, in input order. Each row at most `limit` tokens."""
        out = torch.empty(len(rows), self.dim, dtype=torch.float32)
        for start, end in token_batches([len(r) for r in rows], self.max_batch_tokens):
            pooled = pooled_prefill(self.model, rows[start:end], self.pooling.pooling)
            out[start:end] = finish(pooled, self.pooling).cpu()
        return out

    def embed(self, inputs: list[str] | list[list[int]]) -> torch.Tensor:
        """Texts or token id lists -> [B, dim] float32 on the CPU (inputs cut to the limit)."""
        rows, _ = self.prepare(inputs)
        return self.embed_ids(rows)


def token_batches(lens: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) ranges of rows of these lengths, each of at most `max_tokens`
    tokens (a longer row runs alone), covering every row in order."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lens):
        if i > start and total + n > max_tokens:
            out.append((start, i))
            start, total = i, 0
        total += n
    if start < len(lens):
        out.append((start, len(lens)))
    return out


@torch.inference_mode()
def pooled_prefill(model: Any, rows: list[list[int]], mode: str) -> torch.Tensor:
    """One packed prefill of `rows` (token ids, each 1..max_position_embeddings long), no KV
    cache, pooled per row by `mode` (`pool`): [len(rows), d] float32 on the model's device.
    The one prefill-only path: embeddings (`Embedder`), a decoder classifier's `score` head
    and a causal-LM reranker's last-position logits (nanoserve/classify.py, rerank.py), and
    an encoder's embeddings (`EncoderModel.hidden_states`, bidirectional)."""
    dev = model.device
    lens = [len(r) for r in rows]
    if min(lens) < 1:
        raise InputError("an input has no tokens")
    if max(lens) > model.config.max_position_embeddings:
        raise InputError(f"an input has {max(lens)} tokens, more than the model's context "
                         f"({model.config.max_position_embeddings})")
    # built on the host, then moved once: ids, each token's position in its row, offsets
    n = torch.tensor(lens, dtype=torch.long)
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(n, 0)
    positions = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1].long(), n)
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    ids, positions, cu = (x.to(dev, non_blocking=True) for x in (ids[None], positions[None], cu))
    meta = AttentionMetadata.packed(cu, max(lens))
    hidden = model.hidden_states(ids, positions, None, meta)[0]  # [N, d]
    return pool(hidden, cu, mode)


__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "Embedder", "POOLING_MODES", "PoolingConfig", "finish",
           "pool", "pooled_prefill", "resolve_pooling", "sentence_transformers_settings",
           "token_batches", "with_instruction"]
