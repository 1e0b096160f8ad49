"""The online-softmax step the attention kernels run for each key/value tile.

FlashAttention's recurrence over tiles of keys, in log2 units (the caller folds log2(e) into
`qk_scale`): with running max m, running sum l and unnormalised output acc for a block of
queries, one tile of scores s = q·kᵀ·scale (hidden keys at -inf) updates

    m' = max(m, rowmax(s)),  α = 2^(m - m'),  p = 2^(s - m'),
    l' = l·α + rowsum(p),    acc' = acc·α + p·v.

After the last tile the output is acc / l, and m + log2(l) is the log-sum-exp (what the
split-K combine needs). A row that has seen only hidden keys keeps m = -inf and l = 0.

Decorated when this module is imported, like the kernels that call it (see nanoserve_kernels/_triton.py).
"""

from __future__ import annotations

from nanoserve_kernels._triton import tl, triton


@triton.jit
def online_softmax_step(q, k, v, visible, qk_scale, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """One tile into the running state; returns the new (m_i, l_i, acc).

    q [M, D] (float32 when DOT_FP32, else the cache dtype); k, v [N, D]; visible [M, N] or
    [1, N] (broadcast), True where the query may attend the key; m_i, l_i [M] float32;
    acc [M, D] float32. DOT_FP32: both products in IEEE float32 (float32 caches and the
    interpreter), else tensor-core dots in the cache dtype with float32 accumulation."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * qk_scale, float("-inf"))  # [M, N]
    return online_softmax_update(s, v, m_i, l_i, acc, DOT_FP32)


@triton.jit
def online_softmax_probs(s, m_i, l_i):
    """The step's weights: s [M, N] float32 in log2 units, -inf where hidden -> (m', l',
    alpha [M], p [M, N] float32); the caller adds p·v to acc * alpha."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no visible key so far (a sliding window's tile can hide a whole row) keeps
    # m = -inf; subtracting 0 instead keeps alpha and p at 0 rather than NaN (-inf - -inf).
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, alpha, p


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """The step after the scores: s [M, N] float32 in log2 units, -inf where hidden; v
    [N, D] (float8 e4m3 too: p is then cast to e4m3 for the product, while l sums the
    unrounded p); returns the new (m_i, l_i, acc)."""
    m_new, l_i, alpha, p = online_softmax_probs(s, m_i, l_i)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


__all__ = ["online_softmax_probs", "online_softmax_step", "online_softmax_update"]
