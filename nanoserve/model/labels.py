"""A sequence-classification head's labels and what its logits mean: one reading for every
classifier (the encoders' heads, nanoserve/encoder/heads.py; the decoders' `score` head,
nanoserve/classify.py; a causal-LM reranker's yes/no, nanoserve/rerank.py).

`head_labels` reads config.json as transformers does: `id2label` in label-id order (else
`LABEL_0..` for `num_labels`, default 2), `problem_type` as given, else regression for one
output and single-label classification otherwise. `interpret` turns logits [B, num_labels]
into predictions by `problem_type`: single-label: softmax, the argmax's label; multi-label:
sigmoid, the labels at >= 0.5; regression: the raw outputs (the first one as `score`).

Torch-free at import (a job's driver reads labels without the engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.errors import ModelError

if TYPE_CHECKING:
    import torch

PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


def head_labels(d: dict[str, Any]) -> dict[str, Any]:
    """config.json's `num_labels`, `id2label` (a tuple in id order) and `problem_type`.
    ModelError for id2label keys that are not 0..n-1 or an unknown problem_type."""
    raw = d.get("id2label")
    if raw:
        labels = {int(k): str(v) for k, v in raw.items()}
        if sorted(labels) != list(range(len(labels))):
            raise ModelError(f"id2label keys {sorted(labels)} are not 0..{len(labels) - 1}")
        id2label = tuple(labels[i] for i in range(len(labels)))
    else:
        id2label = tuple(f"LABEL_{i}" for i in range(int(d.get("num_labels", 2))))
    problem = d.get("problem_type") or ("regression" if len(id2label) == 1
                                        else "single_label_classification")
    if problem not in PROBLEM_TYPES:
        raise ModelError(f"problem_type {problem!r} is not one of {PROBLEM_TYPES}")
    return dict(num_labels=len(id2label), id2label=id2label, problem_type=problem)


@dataclass(frozen=True)
class Prediction:
    """One row's reading of its logits. label: the predicted label (single-label: the
    argmax; multi-label: the most probable); labels: multi-label's labels at >= 0.5 (single-
    label: (label,)); probs: label -> probability (None for regression); score: regression's
    first output (None otherwise)."""

    label: str | None
    labels: tuple[str, ...]
    probs: dict[str, float] | None
    score: float | None


def interpret(logits: torch.Tensor, cfg: Any) -> list[Prediction]:
    """logits [B, num_labels] -> one Prediction per row, by `cfg.problem_type` (`cfg`: any
    config with `id2label` and `problem_type`, an encoder's or a decoder's)."""
    import torch

    logits = logits.float().cpu()
    names = cfg.id2label or tuple(f"LABEL_{i}" for i in range(logits.shape[-1]))
    if cfg.problem_type == "regression":
        return [Prediction(None, (), None, float(row[0])) for row in logits]
    multi = cfg.problem_type == "multi_label_classification"
    probs = torch.sigmoid(logits) if multi else torch.softmax(logits, dim=-1)
    out = []
    for p in probs:
        top = names[int(p.argmax())]
        on = tuple(n for n, x in zip(names, p.tolist()) if x >= 0.5) if multi else (top,)
        out.append(Prediction(top, on, dict(zip(names, p.tolist())), None))
    return out


__all__ = ["PROBLEM_TYPES", "Prediction", "head_labels", "interpret"]
