"""Sequence-classification heads over an encoder's last hidden states, and what their
logits mean.

Each head maps packed hidden states [N, d] (rows by `PackedRows`) to logits [B, num_labels]:
- BERT (`BertForSequenceClassification`): the pooler, tanh(dense(h[CLS])), then `classifier`;
- XLM-RoBERTa (its RobertaClassificationHead): out_proj(tanh(dense(h[<s>])));
- ModernBERT: classifier(norm(act(dense(pooled)))), pooled the row's first token ('cls') or
  the mean over its tokens ('mean'), per `classifier_pooling`.
The row's first token is its [CLS] / <s>: the tokenizer puts it there.

What the logits mean (`interpret`, by `problem_type`) is nanoserve/model/labels.py's, shared
with the decoders' heads.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.encoder.config import EncoderConfig
from nanoserve.encoder.layers import PackedRows, activation


def first_tokens(hidden: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """[N, d] -> [B, d]: each row's first token."""
    return hidden[rows.cu_seqlens[:-1]]


def mean_tokens(hidden: torch.Tensor, rows: PackedRows) -> torch.Tensor:
    """[N, d] -> [B, d]: each row's mean, summed in float32."""
    sums = torch.zeros(len(rows.lens), hidden.shape[-1], dtype=torch.float32,
                       device=hidden.device)
    sums.index_add_(0, rows.row, hidden.float())
    return (sums / rows.lens[:, None].float()).to(hidden.dtype)


class BertHead(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, hidden: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(first_tokens(hidden, rows))))


class RobertaHead(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, hidden: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first_tokens(hidden, rows))))


class ModernBertHead(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.pooling = cfg.classifier_pooling
        self.dense = nn.Linear(d, d, bias=cfg.classifier_bias)
        self.act = activation(cfg.classifier_activation)
        self.norm = nn.LayerNorm(d, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.classifier = nn.Linear(d, cfg.num_labels)

    def forward(self, hidden: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        pooled = (first_tokens if self.pooling == "cls" else mean_tokens)(hidden, rows)
        return self.classifier(self.norm(self.act(self.dense(pooled))))


def build_head(cfg: EncoderConfig) -> nn.Module | None:
    """The head of a classification checkpoint; None for a base model."""
    if cfg.headless:
        return None
    if cfg.family.kind == "modernbert":
        return ModernBertHead(cfg)
    return RobertaHead(cfg) if cfg.family.position_offset else BertHead(cfg)


__all__ = ["BertHead", "ModernBertHead", "RobertaHead", "build_head", "first_tokens",
           "mean_tokens"]
