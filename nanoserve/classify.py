"""Classifiers: a checkpoint folder with a sequence-classification head behind one face
(`Classifier`), whatever model is under it; a causal LM as a reranker.

    clf = load_classifier("reward-model/")                  # picked by config.json
    logits = clf.classify_ids(clf.tokenizer.encode(...))    # [B, num_labels] float32
    preds = clf.predict(logits)                             # labels + probs, or scores

    clf = DecoderClassifier.load("Qwen3-classifier/")       # or the class itself
    logits = clf.classify(["a text", ...])                  # [B, num_labels] float32
    logits = clf.score([("text 1", "text 2"), ...])         # pairs: the tokenizer's template

What `load_classifier` (and, without the weights, `read_classifier`) gives for a folder:
- an encoder with a head (BERT, XLM-RoBERTa, ModernBERT): `nanoserve.encoder.Encoder`;
- a decoder with a head, `*ForSequenceClassification` of a registered family
  (nanoserve/model/families.py's `classifier`): `DecoderClassifier`;
- a causal LM, `*ForCausalLM`, where `rerank=True` (the score task): `nanoserve.rerank.
  Reranker`, a two-label head ("no", "yes") from its last-position logits;
anything else (a causal LM to classify, a base model, a GGUF file) is a ModelError of one
line naming what runs.

`DecoderClassifier` is transformers' `GenericForSequenceClassification`: the decoder's final
normed hidden state at the row's last token that is not `pad_token_id`, times `score.weight`
[num_labels, d] (no bias). Rows run packed, no KV cache, through nanoserve/embed.py's
`pooled_prefill` (the embeddings' path, last-token pooling); a row's trailing pad tokens
are dropped first (attention is causal, so the last kept token's state is the one
transformers pools). Logits mean what `problem_type` says (nanoserve/model/labels.py):
single-label softmax, multi-label sigmoid, regression (a reward model, one output) raw.
Texts are tokenized by the folder's tokenizer.json as transformers' fast tokenizer does (its
own BOS / EOS, `truncation=True` to the model's positions). `read_classifier` is torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nanoserve.encoder.tokenizer import EncoderTokenizer, read_encoder_classifier
from nanoserve.errors import ModelError
from nanoserve.model.encoder_families import ENCODERS, is_encoder_config
from nanoserve.model.families import FAMILIES, by_architecture
from nanoserve.model.labels import Prediction, interpret
from nanoserve.options import ENGINE

if TYPE_CHECKING:  # torch is imported where a model loads: a job's driver reads no weights
    import torch


class Classifier(Protocol):
    """What the classify and score tasks need of a classifier, the same for an `Encoder`, a
    `DecoderClassifier` and a `Reranker`:
    - `config`: `max_position_embeddings` (the most tokens a row may hold), `num_labels`,
      `id2label` (label names in id order) and `problem_type`;
    - `tokenizer`: `encode_row(text, text_2=None) -> (ids, segment ids, cut)`,
      `with_limit(max_tokens)`, `instruction` (None but for a reranker's);
    - `classify_ids(ids, types=None)`: token ids per row -> logits [B, num_labels] float32 on
      the CPU, in input order; `predict(logits)`: one `Prediction` per row."""

    config: Any
    tokenizer: Any

    def classify_ids(self, ids: Sequence[Sequence[int]], types: Any = None) -> torch.Tensor: ...

    def predict(self, logits: torch.Tensor) -> list[Prediction]: ...


def batch_tokens(max_batch_tokens: int | None) -> int:
    """The tokens a packed prefill holds: as given (at least 1), else the embedder's default
    (`nanoserve.embed.DEFAULT_MAX_BATCH_TOKENS`)."""
    if max_batch_tokens is None:
        from nanoserve.embed import DEFAULT_MAX_BATCH_TOKENS

        return DEFAULT_MAX_BATCH_TOKENS
    return max(1, int(max_batch_tokens))


def pooled_part(ids: Sequence[int], pad_token_id: int | None) -> list[int]:
    """The row up to its last token that is not `pad_token_id` (the whole row without one;
    its first token when every token is the pad): what transformers' head pools at its end."""
    end = len(ids)
    if pad_token_id is not None:
        while end > 1 and ids[end - 1] == pad_token_id:
            end -= 1
    return list(ids[:end])


class DecoderClassifier:
    """A decoder with a sequence-classification head (see the module docstring)."""

    def __init__(self, model: Any, folder: str | Path, max_batch_tokens: int | None = None
                 ) -> None:
        if not model.config.is_classifier:
            raise ModelError(f"{model.config.architecture} has no sequence-classification head")
        self.model = model
        self.config = model.config
        self.folder = Path(folder)
        self.tokenizer = EncoderTokenizer.from_folder(folder, self.config.max_position_embeddings)
        self.max_batch_tokens = batch_tokens(max_batch_tokens)

    @classmethod
    def load(cls, folder: str | Path, dtype: str | torch.dtype = ENGINE["dtype"].default,
             device: str = "auto", max_batch_tokens: int | None = None) -> DecoderClassifier:
        """A `*ForSequenceClassification` checkpoint folder (no KV pool)."""
        import torch

        from nanoserve.embed import _dtype
        from nanoserve.model.model import build_model
        from nanoserve.weights.weights import load_checkpoint

        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                           if device == "auto" else device)
        config, state = load_checkpoint(folder)
        if not config.is_classifier:
            raise ModelError(_refusal(Path(folder), config.architecture, rerank=False))
        return cls(build_model(config, state, _dtype(dtype, dev), dev), folder, max_batch_tokens)

    def classify(self, texts: Sequence[str]) -> torch.Tensor:
        """Texts -> logits [B, num_labels] float32 (cut to the model's positions)."""
        return self.classify_ids(self.tokenizer.encode(texts)[0])

    def score(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor:
        """(text_1, text_2) pairs, one input each by the tokenizer's pair template -> logits
        [B, num_labels] float32."""
        return self.classify_ids(self.tokenizer.encode_pairs(pairs)[0])

    def classify_ids(self, ids: Sequence[Sequence[int]], types: Any = None) -> torch.Tensor:
        """Token ids per row (segment ids unused) -> logits [B, num_labels] float32 on the
        CPU, in input order; rows packed into batches of at most `max_batch_tokens`."""
        import torch

        from nanoserve.embed import pooled_prefill, token_batches

        rows = [pooled_part(r, self.config.pad_token_id) for r in ids]
        out = torch.empty(len(rows), self.config.num_labels, dtype=torch.float32)
        with torch.inference_mode():
            for start, end in token_batches([len(r) for r in rows], self.max_batch_tokens):
                last = pooled_prefill(self.model, rows[start:end], "last")  # [b, d] float32
                out[start:end] = self.model.classify(last).cpu()
        return out

    def predict(self, logits: torch.Tensor) -> list[Prediction]:
        """Logits -> one Prediction per row, by the config's problem_type."""
        return interpret(logits, self.config)


def load_classifier(folder: str | Path, dtype: str | torch.dtype = ENGINE["dtype"].default,
                    device: str = "auto", max_batch_tokens: int | None = None, *,
                    rerank: bool = False) -> Classifier:
    """The folder's classifier (see the module docstring); `rerank`: a causal LM loads as a
    `Reranker` instead of being refused. ModelError (one line) for anything else.
    `max_batch_tokens`: tokens a packed prefill holds (None: the embedder's default)."""
    kind = _kind(Path(folder), rerank)[0]
    if kind == "encoder":
        from nanoserve.encoder.api import Encoder

        read_encoder_classifier(folder)  # a base encoder (no head) refused in one line
        return Encoder.load(folder, dtype, device, batch_tokens(max_batch_tokens))
    if kind == "reranker":
        from nanoserve.rerank import Reranker

        return Reranker.load(folder, dtype, device, max_batch_tokens)
    return DecoderClassifier.load(folder, dtype, device, max_batch_tokens)


def read_classifier(folder: str | Path, *, rerank: bool = False) -> tuple[Any, Any]:
    """The folder's classifier config and tokenizer (`Classifier.config`, `.tokenizer`),
    without its weights (a decoder's checked from the safetensors headers). ModelError, one
    line naming what runs, for a folder that is no classifier (see the module docstring)."""
    path = Path(folder)
    kind, config = _kind(path, rerank)
    if kind == "encoder":
        return read_encoder_classifier(path)
    if kind == "reranker":
        from nanoserve.rerank import RerankTokenizer, reranker_config

        return (reranker_config(config),
                RerankTokenizer.from_folder(path, config.max_position_embeddings))
    return config, EncoderTokenizer.from_folder(path, config.max_position_embeddings)


def _kind(path: Path, rerank: bool) -> tuple[str, Any]:
    """("encoder", None), ("decoder", its ModelConfig) or ("reranker", its ModelConfig)."""
    d = _config_dict(path)
    if d is not None and is_encoder_config(d):
        return "encoder", None
    arch = (d.get("architectures") or [d.get("model_type")])[0] if d is not None else None
    if not isinstance(arch, str) or by_architecture(arch) is None:
        raise ModelError(_refusal(path, arch, rerank))
    from nanoserve.weights.weights import validate_checkpoint

    config = validate_checkpoint(path)
    if config.is_classifier:
        return "decoder", config
    if rerank and not config.headless:
        return "reranker", config
    raise ModelError(_refusal(path, arch, rerank))


def _config_dict(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _refusal(path: Path, arch: Any, rerank: bool) -> str:
    """One line: what the model is, and what classify (or score) runs."""
    what = repr(arch) if arch else "no readable config.json"
    heads = ", ".join([f.architecture for f in ENCODERS]
                      + [f.classifier for f in FAMILIES if f.classifier])
    family = by_architecture(arch) if isinstance(arch, str) else None
    if family is not None and arch == family.architecture:  # a causal LM given to classify
        return (f"model {path} ({arch}) is a causal LM without a sequence-classification head: "
                f"classify runs {heads}; a causal LM scores (query, document) pairs as a "
                f"reranker (nanoserve score)")
    task = "classify and score run" if rerank else "classify runs"
    also = "; score also runs a causal LM as a reranker (*ForCausalLM)" if rerank else ""
    if family is not None:
        return f"model {path} ({arch}) has no head: {task} {heads}{also}"
    return (f"model {path} ({what}) is not a checkpoint folder with a sequence-classification "
            f"head; {task} {heads}{also}")


__all__ = ["Classifier", "DecoderClassifier", "batch_tokens", "load_classifier", "pooled_part",
           "read_classifier"]
