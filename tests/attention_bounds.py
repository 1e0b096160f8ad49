"""How far an attention kernel's output may lie from the exact attention of its inputs, from
the number formats the kernel rounds to: the tolerance of tests/test_fp8_kv_gpu.py, and
what tests/test_fp8_kv.py checks that tolerance against on the CPU (an emulation of the
decode kernel's FP8 arithmetic). A helper module of the tests, not a test file.

The exact attention is the reference computed in float64 over the same inputs (bfloat16
queries, e4m3 entries times their scales). Against it, a kernel that reads an FP8 cache:
- rounds each probability p = exp(s - running max) before p·v: to e4m3 on the decode
  kernel's FP8 tensor-core path (3 mantissa bits: within 2^-4 p; subnormal spacing 2^-9,
  so within 2^-10; below 2^-10 it becomes 0), to bfloat16 elsewhere (7 mantissa bits: within 2^-8 p). The
  softmax's sum adds the unrounded p. Seen from the global maximum M, a token's weight
  P = exp(s - M) <= p, so its rounding moves the numerator by at most
  e(P) = min(P, max(2^-4 P, 2^-10)) |v| (e4m3) or 2^-8 P |v| (bfloat16), whatever the
  tiles and splits; the token holding M has p = 2^0 = 1 in its own tile, exact in either
  format, when it leads the next score by more than the scores' own error;
- on the decode kernel's "f16" form (the default on a GPU), rounds p to float16 instead
  (10 mantissa bits: within 2^-11 p down to 2^-14, then within 2^-25 absolute; below 2^-25
  it becomes 0) and multiplies q exactly (float16 at a power-of-two scale);
- splits each query head into two e4m3 terms on the "e4m3" path (`_split_query`: hi at scale
  amax/448, lo the remainder at its own max/448), so the query it multiplies is within
  2^-8 |q_d| + 2^-22 amax of q (each term within half an e4m3 step of what it encodes);
  to first order that moves output j by sum_d dq_d * dO_j/dq_d, where
  dO_j/dq_d = scale * sum_t w_t (k_td - kbar_d)(v_tj - o_j) (w the softmax weights);
- sums products in float32 on tensor cores (taken as within 2^-12 of the sum of the
  terms' magnitudes, generously: FP8 tensor cores keep fewer bits than float32), and
  rounds its output to bfloat16 (2^-8 relative).
Each rounding term is bounded twice, and the smaller is used: the worst case (every error
at its largest with one sign) and Hoeffding's inequality for errors that are independent
and centred (round to nearest): |sum_t a_t d_t| <= LAMBDA * sqrt(sum_t a_t^2) for |d_t| <= 1,
except with probability 2 exp(-LAMBDA^2 / 2) (about 3e-8 an element at 6). Probabilities
that may flush to 0 (a biased error) are counted in the worst case only. A factor 1.25
covers the first-order expansion, and each bound grows by exp(2 ds) for scores moved by ds.
"""

from __future__ import annotations

import math

import torch

LAMBDA = 6.0
E4M3_HALF_STEP = 2.0**-4  # relative, normal range
E4M3_FLOOR = 2.0**-10  # half the subnormal spacing 2^-9 (p in [0, 1]: unscaled)
BF16_HALF_STEP = 2.0**-8
F16_HALF_STEP = 2.0**-11  # relative, normal range (p >= 2^-14)
F16_FLOOR = 2.0**-25  # half the float16 subnormal spacing 2^-24
SUM_EPS = 2.0**-12  # float32 sums on tensor cores, relative to the sum of |terms|
SLACK = 1.25


def uses_fp8_products(head_dim: int, block_n: int) -> bool:
    """Whether the decode kernel runs its products on FP8 tensor cores (on a GPU, from an
    FP8 cache with bfloat16 queries): both reduction sides at least 32
    (`nanoserve_kernels.paged_attention.paged_decode_attention`)."""
    return 1 << (head_dim - 1).bit_length() >= 32 and block_n >= 32


def uses_f16_form(head_dim: int, block_n: int) -> bool:
    """Whether the decode kernel runs its "f16" form (on a GPU, from an FP8 cache with
    bfloat16 queries, `fp8_form="f16"`): an even head_dim padding to >= 32, steps >= 16
    (`nanoserve_kernels.paged_attention.uses_f16_form`)."""
    return head_dim % 2 == 0 and 1 << (head_dim - 1).bit_length() >= 32 and block_n >= 16


def head_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
               fp8_products: bool, f16_products: bool = False) -> torch.Tensor:
    """q [D] (the kernel's input, e.g. bfloat16 values), k, v [n, D] (the values read: entries
    times their scales) -> [D] float64: the most the kernel's output for this query head may
    differ from the exact attention (see the module docstring)."""
    q, k, v = q.double(), k.double(), v.double()
    s = scale * (k @ q)  # [n]
    order = torch.sort(s, descending=True)
    m = order.values[0]
    lead = float(order.values[0] - order.values[1]) if len(s) > 1 else math.inf
    P = torch.exp(s - m)
    L = P.sum()
    w = P / L
    o = w @ v  # [D]
    va, dv = v.abs(), (v - o).abs()
    qa, ka = q.abs(), k.abs()
    sums = scale * SUM_EPS * (ka @ qa)  # [n] score error of the float32 sums
    dq = None
    if fp8_products:
        dq = 2.0**-8 * qa + 2.0**-22 * qa.max()  # the two e4m3 terms' error
        ds = scale * (ka @ dq) + sums
    else:
        ds = sums
    ds_max = float(ds.max())
    grow = math.exp(2 * ds_max)

    # the probabilities' rounding
    Pg = P * grow
    if fp8_products or f16_products:
        step, floor = (F16_HALF_STEP, F16_FLOOR) if f16_products else (E4M3_HALF_STEP,
                                                                       E4M3_FLOOR)
        e = torch.clamp(Pg * step, min=floor)
        flush = P / grow <= floor  # may round to 0: a biased error, worst case only
        biased = (Pg * flush) @ va
        e = torch.where(flush, torch.zeros_like(e), e)
    else:
        e = Pg * BF16_HALF_STEP
        biased = torch.zeros_like(o)
    if lead > 2 * ds_max:  # the maximum's p is 1 in its own tile: exact
        e[order.indices[0]] = 0.0
    worst = e @ va
    spread = LAMBDA * torch.sqrt((e * e) @ (va * va))
    b_p = (torch.minimum(worst, spread) + biased) * grow / L

    # the query's two e4m3 terms (first order), the float32 sums of both products
    b_q = torch.zeros_like(o)
    if dq is not None:
        kbar = w @ k
        jac = scale * ((k - kbar) * w[:, None]).T @ (v - o)  # [D(q), D(v)]: dO_j / dq_d
        b_q = torch.minimum(dq @ jac.abs(), LAMBDA * torch.sqrt((dq * dq) @ (jac * jac)))
    b_sums = (w * sums) @ dv + SUM_EPS * grow * (w @ va)
    inner = SLACK * (b_p + b_q + b_sums)
    return inner + BF16_HALF_STEP * (o.abs() + inner) + 2.0**-20 * (w @ va)


def gather_row(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """A row's first n entries [n, Hkv, D] through its block table."""
    block = cache.shape[1]
    t = torch.arange(n, device=cache.device)
    return cache[table.long()[t // block], t % block]


def decode_bound(q, k8, v8, tables, lens, scale, k_scale, v_scale, *, fp8_products,
                 f16_products=False, window=None) -> torch.Tensor:
    """[B, Hq, D] float64 on the CPU: `head_bound` of every row and query head of a paged
    decode attention over an FP8 pool (each row's query sees its last `window` tokens)."""
    q, k8, v8, tables, lens = (x.cpu() for x in (q, k8, v8, tables, lens))
    B, Hq, D = q.shape
    group = Hq // k8.shape[2]
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for r in range(B):
        n = int(lens[r])
        lo = max(0, n - window) if window else 0
        kr = gather_row(k8, tables[r], n)[lo:].double() * k_scale
        vr = gather_row(v8, tables[r], n)[lo:].double() * v_scale
        for h in range(Hq):
            out[r, h] = head_bound(q[r, h], kr[:, h // group], vr[:, h // group], scale,
                                   fp8_products=fp8_products, f16_products=f16_products)
    return out


def prefill_bound(q, k8, v8, tables, cu, lens, scale, k_scale, v_scale) -> torch.Tensor:
    """[N, Hq, D] float64 on the CPU: `head_bound` of every new token and query head of a
    paged prefill over an FP8 pool (it dequantizes the entries to q's dtype, bfloat16
    probabilities for p·v); new token j of row b sees positions 0 .. cached + j."""
    q, k8, v8, tables, cu, lens = (x.cpu() for x in (q, k8, v8, tables, cu, lens))
    N, Hq, D = q.shape
    group = Hq // k8.shape[2]
    out = torch.empty(N, Hq, D, dtype=torch.float64)
    for b in range(len(lens)):
        n, start, end = int(lens[b]), int(cu[b]), int(cu[b + 1])
        kr = gather_row(k8, tables[b], n).double() * k_scale
        vr = gather_row(v8, tables[b], n).double() * v_scale
        for i in range(start, end):
            seen = n - (end - i) + 1
            for h in range(Hq):
                out[i, h] = head_bound(q[i, h], kr[:seen, h // group], vr[:seen, h // group],
                                       scale, fp8_products=False)
    return out


def paged_case(seed, lens, hkv, d, block, k_scale, v_scale):
    """An FP8 pool for rows of `lens` tokens: (generator, k8, v8, block tables, lens) on the
    CPU. Entries quantized from float values up to ~6x past 448 x scale (clamped), in
    shuffled blocks numbered from 1 (block 0 is the tables' padding)."""
    from nanoserve_kernels.kv_quant import quantize_reference

    g = torch.Generator().manual_seed(seed)
    nb = 1 + sum(math.ceil(n / block) for n in lens) + 3
    shape = (nb, block, hkv, d)
    k8 = quantize_reference(torch.randn(shape, generator=g) * 150 * k_scale, k_scale)
    v8 = quantize_reference(torch.randn(shape, generator=g) * 150 * v_scale, v_scale)
    return g, k8, v8, random_tables(lens, nb, block, g), torch.tensor(lens, dtype=torch.int32)


def random_tables(lens, nb: int, block: int, g: torch.Generator) -> torch.Tensor:
    """Block tables [rows, width] int32 giving each row of `lens` tokens its own blocks of
    the pool's `nb`, drawn at random, never block 0; unused entries 0."""
    order = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    tables = torch.zeros((len(lens), max(math.ceil(n / block) for n in lens) + 1),
                         dtype=torch.int32)
    for row, n in enumerate(lens):
        mine, order = order[:math.ceil(n / block)], order[math.ceil(n / block):]
        tables[row, :len(mine)] = torch.tensor(mine, dtype=torch.int32)
    return tables


def decode_case(group: int, head_dim: int, block_size: int, k_scale: float, v_scale: float):
    """tests/test_fp8_kv_gpu.py's decode case (on the CPU): rows of 1, 17, block_size * 8,
    1,000 and 2,048 tokens over 2 KV heads, and bfloat16 `needle_queries`. Returns
    (q, k8, v8, block tables, lens)."""
    lens = [1, 17, block_size * 8, 1000, 2048]
    g, k8, v8, tables, lens_t = paged_case(group + head_dim, lens, 2, head_dim, block_size,
                                           k_scale, v_scale)
    q = needle_queries(k8, tables, lens, group, k_scale, g).to(torch.bfloat16)
    return q, k8, v8, tables, lens_t


def needle_queries(k8, tables, lens, group: int, k_scale: float, generator: torch.Generator,
                   margin: float = 3.0, score_spread: float = 5.0) -> torch.Tensor:
    """Queries [B, Hkv * group, D] float32 (CPU) pointed at one key each (a needle), so that
    its score leads the row's next best by `margin`: the head's output is then mostly that
    token's value, and reading it wrongly, or not at all, shows far above the rounding
    bound. Even heads point at one of the row's last 16 tokens, odd heads anywhere, on top
    of a random part whose scores spread over about `score_spread` nats (so the rest of the
    weight, too, sits on few tokens: the more tokens share it evenly, the more their e4m3
    roundings add up, and the looser the bound). A key that another key outscores along
    its own direction cannot be a needle; a head whose span has none keeps its random
    query."""
    k8, tables = k8.cpu(), tables.cpu()
    D = k8.shape[3]
    scale = D ** -0.5
    keys = k8.float().pow(2).mean().sqrt() * k_scale  # the keys' RMS entry
    q = torch.randn((len(lens), k8.shape[2] * group, D), generator=generator)
    q *= score_spread / float(keys)  # scale * q.k then spreads over about score_spread
    for r, n in enumerate(int(x) for x in lens):
        kr = gather_row(k8, tables[r], n).float() * k_scale
        for h in range(q.shape[1]):
            k = kr[:, h // group]
            span = range(max(0, n - 16), n) if h % 2 == 0 else range(n)
            # keys that lead every other key along their own direction
            own = (k[span.start:span.stop] * k[span.start:span.stop]).sum(1)
            cross = k[span.start:span.stop] @ k.T  # [span, n]
            cross[torch.arange(len(span)), torch.arange(span.start, span.stop)] = -math.inf
            able = (cross.amax(1) < own).nonzero().flatten().tolist()
            if not able:
                continue
            pos = span.start + able[int(torch.randint(0, len(able), (1,), generator=generator))]
            unit = k[pos] / k[pos].norm()
            base, beta = q[r, h].clone(), 0.0
            for _ in range(100):
                s = scale * (k @ (base + beta * unit))
                s_pos = float(s[pos])
                s[pos] = -math.inf
                lead = s_pos - float(s.max()) if n > 1 else margin
                if lead >= margin:
                    break
                beta += (margin - lead) / (scale * float(k[pos].norm())) + 1e-3
            q[r, h] = base + beta * unit
    return q


def emulate_fp8_decode(q, k8, v8, tables, lens, scale, k_scale, v_scale, *,
                       partition: int = 256, block_n: int = 128, drop: int = 0,
                       drop_after: int = 512, one_term: bool = False,
                       f16: bool = False) -> torch.Tensor:
    """The decode kernel's FP8 tensor-core path in PyTorch on the CPU: each query head split
    into two e4m3 terms (`_split_query`), scores from e4m3 products summed in float32, an
    online softmax over `block_n`-token steps within `partition`-token splits, each step's
    probabilities rounded to e4m3 for p·v (the sum l of the unrounded ones), the splits
    combined by their log-sum-exp, the output rounded to bfloat16. `drop`: a broken kernel
    that leaves out the last `drop` tokens of rows longer than `drop_after`; `one_term`: one
    that keeps only the query's first e4m3 term; `f16`: the "f16" form instead (the query
    exact, probabilities rounded to float16). Returns [B, Hq, D] float64."""
    e4m3 = torch.float8_e4m3fn
    log2e = 1.4426950408889634
    B, Hq, D = q.shape
    hkv = k8.shape[2]
    group = Hq // hkv
    qk_scale = torch.tensor(scale * log2e * k_scale, dtype=torch.float32)
    out = torch.empty(B, Hq, D, dtype=torch.float64)
    for r in range(B):
        n = int(lens[r])
        n -= drop if n > drop_after else 0
        kr = gather_row(k8, tables[r], n).float()
        vr = gather_row(v8, tables[r], n).float()
        for kh in range(hkv):
            qf = q[r, kh * group:(kh + 1) * group].float()  # [G, D]
            amax = qf.abs().amax(1)
            s_hi = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
            hi = (qf / s_hi[:, None]).to(e4m3).float()
            rest = qf - hi * s_hi[:, None]
            r_max = rest.abs().amax(1)
            s_lo = torch.where(r_max > 0, r_max / 448.0, torch.ones_like(r_max))
            lo = (rest / s_lo[:, None]).to(e4m3).float() * (not one_term)
            if f16:  # float16 at a power-of-two scale holds a bfloat16 query exactly
                hi, s_hi, lo = qf, torch.ones_like(s_hi), torch.zeros_like(lo)
            p_format = torch.float16 if f16 else e4m3
            outs, lses = [], []
            for p0 in range(0, n, partition):
                m = torch.full((group,), -math.inf)
                l_sum = torch.zeros(group)
                acc = torch.zeros(group, D)
                for t0 in range(p0, min(p0 + partition, n), block_n):
                    t1 = min(t0 + block_n, p0 + partition, n)
                    k, v = kr[t0:t1, kh], vr[t0:t1, kh]
                    s = ((hi @ k.T) * (s_hi[:, None] * qk_scale)
                         + (lo @ k.T) * (s_lo[:, None] * qk_scale))
                    m_new = torch.maximum(m, s.amax(1))
                    alpha = torch.exp2(m - m_new)
                    p = torch.exp2(s - m_new[:, None])
                    l_sum = l_sum * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p.to(p_format).float() @ v
                    m = m_new
                outs.append(acc / l_sum[:, None] * v_scale)
                lses.append(m + torch.log2(l_sum))
            lse = torch.stack(lses, 1)  # [G, S]
            weights = torch.exp2(lse - lse.amax(1, keepdim=True))
            o = (torch.stack(outs, 1) * weights[:, :, None]).sum(1) / weights.sum(1)[:, None]
            out[r, kh * group:(kh + 1) * group] = o.to(torch.bfloat16).double()
    return out
