"""BERT's encoder, also XLM-RoBERTa's (same blocks; RoBERTa's positions start at
pad_token_id + 1 and are counted over the row's non-pad tokens, as fairseq did).

    x = LayerNorm(word[id] + position[p] + token_type[t])          # embeddings
    per block (post-norm):
        x = LayerNorm(x + out(attention(q, k, v of x)))            # bidirectional, biases
        x = LayerNorm(x + down(act(up(x))))                        # act: `hidden_act`, GELU

Shapes: ids, token types, positions [N] (rows packed by `PackedRows`), hidden [N, d].
Parameter names are nanoserve's (`weights.py` maps transformers' onto them); q, k and v are
one [3d, d] projection, stored q then k then v.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoserve.encoder.config import EncoderConfig
from nanoserve.encoder.layers import PackedRows, activation, packed_attention


class BertBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.up = nn.Linear(d, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, d)
        self.mlp_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        q, k, v = self.qkv(x).view(-1, 3, self.heads, self.head_dim).unbind(1)  # [N, H, D] each
        a = packed_attention(q, k, v, rows).reshape(x.shape)
        x = self.attn_norm(x + self.attn_out(a))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    """Embeddings and blocks: packed ids [N] -> last hidden states [N, d]."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, d)
        self.position = nn.Embedding(cfg.position_table, d)
        self.token_type = nn.Embedding(cfg.type_vocab_size, d) if cfg.type_vocab_size else None
        self.emb_norm = nn.LayerNorm(d, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.num_hidden_layers))

    def positions(self, ids: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """[N] rows of the position table: the token's place in its row (BERT); RoBERTa's
        pad_token_id + the count of non-pad tokens up to it in its row (pad: pad_token_id)."""
        if not self.cfg.family.position_offset:
            return rows.col
        pad = self.cfg.pad_token_id or 0
        real = (ids != pad).long()
        seen = torch.cumsum(real, 0)
        starts = rows.cu_seqlens[:-1]
        before = (seen[starts] - real[starts])[rows.row]  # non-pad tokens before the row
        return (seen - before) * real + pad

    def forward(self, ids: torch.Tensor, rows: PackedRows,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word(ids) + self.position(self.positions(ids, rows))
        if self.token_type is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            x = x + self.token_type(token_type_ids)
        x = self.emb_norm(x)
        for layer in self.layers:
            x = layer(x, rows)
        return x


__all__ = ["BertBlock", "BertEncoder"]
