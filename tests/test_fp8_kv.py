"""The FP8 KV cache on the CPU: the number format, the references reading an FP8 pool, the
pool itself, the engine's steps over it, and where it is refused.

Oracles:
- e4m3 rounding: every stored value is within half a unit in the last place of x / scale
  (relative 2^-4 in the normal range, absolute 2^-10 below it), or clamped at 448;
- attention over an FP8 pool equals attention over a float pool holding the dequantized
  values (the read dequantizes, nothing else changes), and differs from attention over
  the original float pool by no more than the bound e4m3's precision implies
  (`e4m3_attention_bound`);
- the engine over an FP8 pool against the same engine over a float32 pool: logits step by
  step with the same tokens fed to both, and greedy tokens.
The Triton kernels on FP8 pools are held to these references in tests/test_kernels.py
(interpreter) and tests/test_fp8_kv_gpu.py (H200), there within the bound that
tests/attention_bounds.py derives from the kernels' number formats; its FP8 tensor-core
path never runs on the CPU, so here that bound meets an emulation of its arithmetic.

What these tests catch (mutations in `tests/mutations.py`):
- a decode step that reads the FP8 pool without its layer's scales
  (`nanoserve/cache/step_cache.py`): `test_continuous_batching_over_an_fp8_pool` at scales
  other than 1 (at 1.0 a missing scale changes nothing).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from nanoserve.cache.pool import BatchedPagedKVCache, CacheShape, KVPool
from nanoserve.errors import ModelError, NanoserveError
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve_kernels.cpu_attention import decode_attention_cpu
from nanoserve_kernels.kv_quant import E4M3_MAX, FP8_DTYPE, dequantize_reference, quantize_reference
from nanoserve_kernels.kv_store import store_kv_reference
from nanoserve_kernels.paged_attention import paged_decode_attention_reference
from nanoserve_kernels.paged_prefill import paged_prefill_attention_reference

ULP_HALF = 2.0**-4  # e4m3: 3 mantissa bits, so rounding is within 2^-4 of the value
SUBNORMAL_HALF = 2.0**-10  # below 2^-6 the spacing is 2^-9


# --- the number format ------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_quantization_error_is_within_half_an_e4m3_ulp(scale):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 40, torch.randn(5000, generator=g) * 1e-2,
                   torch.tensor([0.0, 447.9, -448.0])]) * scale
    back = dequantize_reference(quantize_reference(x, scale), scale, torch.float64)
    err = (back - x.double()).abs()
    bound = ULP_HALF * x.double().abs() + SUBNORMAL_HALF * scale
    inside = x.abs() <= E4M3_MAX * scale
    assert bool((err[inside] <= bound[inside] * (1 + 1e-6)).all())
    assert torch.equal(back[~inside].abs(), torch.full_like(back[~inside], E4M3_MAX * scale))


def test_every_e4m3_code_survives_a_round_trip():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = ~codes.float().isnan()
    assert int(finite.sum()) == 254
    again = quantize_reference(codes.float()[finite], 1.0)
    assert torch.equal(again.float(), codes[finite].float())


# --- the references reading an FP8 pool ---------------------------------------------------------


def _decode_case(seed, lens, hkv=2, group=3, d=32, block=8, k_scale=0.05, v_scale=0.2):
    """Random float caches (keys up to ~200 x k_scale, a few past 448 x k_scale: clamped),
    their FP8 copies, queries of unit size and shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    nb = 1 + sum(math.ceil(n / block) for n in lens)
    shape = (nb, block, hkv, d)
    k = torch.randn(shape, generator=g) * 60 * k_scale
    v = torch.randn(shape, generator=g) * 60 * v_scale
    q = torch.randn((len(lens), hkv * group, d), generator=g) / 40
    from attention_bounds import random_tables

    tables = random_tables(lens, nb, block, g)
    k8, v8 = quantize_reference(k, k_scale), quantize_reference(v, v_scale)
    return q, k, v, k8, v8, tables, torch.tensor(lens, dtype=torch.int32)


def test_reading_an_fp8_pool_is_reading_its_dequantized_values():
    ks, vs = 0.05, 0.2
    q, _, _, k8, v8, tables, lens = _decode_case(1, [1, 8, 21, 40], k_scale=ks, v_scale=vs)
    kd, vd = (dequantize_reference(c, s, torch.float32) for c, s in ((k8, ks), (v8, vs)))
    want = paged_decode_attention_reference(q, kd, vd, tables, lens, 0.17)
    got = paged_decode_attention_reference(q, k8, v8, tables, lens, 0.17, k_scale=ks, v_scale=vs)
    cpu = decode_attention_cpu(q, k8, v8, tables, lens, 0.17, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cpu, want, atol=1e-5, rtol=1e-5)
    # the paged prefill of each row's last 5 tokens over the same pool
    cu = torch.tensor([0, *torch.cumsum(torch.clamp(lens, max=5), 0).tolist()], dtype=torch.int32)
    qp = torch.randn((int(cu[-1]), q.shape[1], q.shape[2]), generator=torch.Generator()
                     .manual_seed(2)) / 40
    args = (qp, k8, v8, tables, cu, lens, 5, 0.17)
    got = paged_prefill_attention_reference(*args, k_scale=ks, v_scale=vs)
    want = paged_prefill_attention_reference(qp, kd, vd, *args[3:])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def e4m3_attention_bound(q, k, v, scale, k_scale, v_scale):
    """How far attention can move when its keys and values are stored in e4m3: q [M, D] over
    k, v [T, D] (float, the original values) -> [M, D]. With the score error of query m
    bounded by eps_m = scale * sum_d |q_md| (2^-4 |k_td| + 2^-10 k_scale) (worst key t),
    the softmax weights move by at most e^(2 eps_m) - 1 in L1, and each value by at most
    2^-4 |v_td| + 2^-10 v_scale, so
        |o' - o|_md <= max_t(2^-4 |v_td| + 2^-10 v_scale) + (e^(2 eps_m) - 1) max_t |v_td|."""
    dk = ULP_HALF * k.abs() + SUBNORMAL_HALF * k_scale  # [T, D]
    eps = (scale * q.abs() @ dk.T).max(dim=1).values  # [M]
    dv = (ULP_HALF * v.abs() + SUBNORMAL_HALF * v_scale).max(dim=0).values  # [D]
    return dv[None, :] + torch.expm1(2 * eps)[:, None] * v.abs().max(dim=0).values[None, :]


def test_decode_over_an_fp8_pool_stays_within_e4m3s_bound():
    ks, vs, scale = 0.05, 0.2, 0.17
    q, k, v, k8, v8, tables, lens = _decode_case(3, [1, 8, 21, 40], k_scale=ks, v_scale=vs)
    exact = paged_decode_attention_reference(q, k, v, tables, lens, scale)
    fp8 = paged_decode_attention_reference(q, k8, v8, tables, lens, scale, k_scale=ks,
                                           v_scale=vs)
    group = q.shape[1] // k.shape[2]
    worst = 0.0
    for row, n in enumerate(lens.tolist()):
        t = torch.arange(n)
        blocks = tables[row].long()[t // k.shape[1]]
        kr, vr = k[blocks, t % k.shape[1]], v[blocks, t % k.shape[1]]  # [n, Hkv, D]
        clamp_free = bool((kr.abs() <= E4M3_MAX * ks).all() and (vr.abs() <= E4M3_MAX * vs).all())
        for h in range(q.shape[1]):
            kh, vh = kr[:, h // group], vr[:, h // group]
            bound = e4m3_attention_bound(q[row, h][None], kh, vh, scale, ks, vs)[0]
            err = (fp8[row, h] - exact[row, h]).abs()
            if clamp_free:
                assert bool((err <= bound * (1 + 1e-5) + 1e-7).all()), (row, h)
            worst = max(worst, float((err / bound).max()))
    assert worst < 1  # the worst head's error, as a share of its bound (typically ~0.1)


def test_paged_prefill_over_an_fp8_pool_stays_within_e4m3s_bound():
    ks, vs, scale = 0.05, 0.2, 0.17
    q, k, v, k8, v8, tables, lens = _decode_case(4, [12, 30], k_scale=ks, v_scale=vs)
    new = [4, 9]  # each row's last tokens are new; each sees its causal prefix
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    qp = torch.randn((13, q.shape[1], q.shape[2]), generator=torch.Generator().manual_seed(5)) / 40
    args = (qp, None, None, tables, cu, lens, 9, scale)
    exact = paged_prefill_attention_reference(qp, k, v, *args[3:])
    fp8 = paged_prefill_attention_reference(qp, k8, v8, *args[3:], k_scale=ks, v_scale=vs)
    group = q.shape[1] // k.shape[2]
    for row, (n, ctx) in enumerate(zip(new, lens.tolist())):
        t = torch.arange(ctx)
        blocks = tables[row].long()[t // k.shape[1]]
        kr, vr = k[blocks, t % k.shape[1]], v[blocks, t % k.shape[1]]
        for j in range(n):
            pos, tok = ctx - n + j, int(cu[row]) + j
            for h in range(q.shape[1]):
                kh, vh = kr[:pos + 1, h // group], vr[:pos + 1, h // group]
                bound = e4m3_attention_bound(qp[tok, h][None], kh, vh, scale, ks, vs)[0]
                assert bool(((fp8[tok, h] - exact[tok, h]).abs() <= bound * (1 + 1e-5)).all())


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 64, 16), (4, 128, 16), (8, 64, 32)])
def test_gpu_decode_bound_holds_for_an_emulation_of_the_fp8_kernel(group, head_dim, block_size,
                                                                   k_scale, v_scale, f16):
    """tests/test_fp8_kv_gpu.py holds the decode kernel's FP8 tensor-core path (query in two
    e4m3 terms, e4m3 probabilities; off under the interpreter) to `decode_bound` on these
    cases. The same bound against a PyTorch emulation of that arithmetic: the emulation,
    with splits of 128, 256 and 4,096 tokens, within it everywhere (measured: at most 0.62
    of it); a kernel leaving out the last 16 tokens of the 1,000- and 2,048-token rows
    outside it on both (measured: 30x and more). `f16`: the same for the "f16" form (exact
    query, float16 probabilities) against its own, tighter bound."""
    from attention_bounds import decode_bound, decode_case, emulate_fp8_decode

    q, k8, v8, tables, lens = decode_case(group, head_dim, block_size, k_scale, v_scale)
    scale, scales = head_dim ** -0.5, {"k_scale": k_scale, "v_scale": v_scale}
    exact = paged_decode_attention_reference(q.double(), k8, v8, tables, lens, scale, **scales)
    bound = decode_bound(q, k8, v8, tables, lens, scale, k_scale, v_scale,
                         fp8_products=not f16, f16_products=f16)
    args = (q, k8, v8, tables, lens, scale, k_scale, v_scale)
    for partition in (128, 256, 4096):
        share = (emulate_fp8_decode(*args, partition=partition, f16=f16) - exact).abs() / bound
        assert float(share.max()) <= 1.0, (partition, share.flatten(1).amax(1))
    dropped = (emulate_fp8_decode(*args, drop=16, f16=f16) - exact).abs() / bound
    long_rows = (lens > 512).nonzero().flatten()
    assert len(long_rows) == 2 and bool((dropped[long_rows].flatten(1).amax(1) > 1).all())


def test_store_quantizes_into_an_fp8_pool_and_checks_its_scales():
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(5, 2, 16, generator=g) * 3, torch.randn(5, 2, 16, generator=g)
    kc, vc = (torch.zeros(4, 4, 2, 16, dtype=FP8_DTYPE) for _ in range(2))
    slots = torch.tensor([3, -1, 9, 0, 15])
    store_kv_reference(k, v, kc, vc, slots, k_scale=0.5, v_scale=0.25)
    keep = slots >= 0
    assert torch.equal(kc.view(16, 2, 16)[slots[keep]].float(),
                       quantize_reference(k[keep], 0.5).float())
    assert torch.equal(vc.view(16, 2, 16)[slots[keep]].float(),
                       quantize_reference(v[keep], 0.25).float())
    assert int((kc.view(16, -1).float() != 0).any(1).sum()) == 4  # slot -1: nothing stored
    with pytest.raises(ValueError, match="takes no scales"):
        store_kv_reference(k, v, kc.float(), vc.float(), slots, k_scale=0.5)
    with pytest.raises(ValueError, match="positive"):
        store_kv_reference(k, v, kc, vc, slots, v_scale=0.0)
    with pytest.raises(ValueError, match="differ in dtype"):
        store_kv_reference(k, v, kc, vc.float(), slots)


# --- the pool ----------------------------------------------------------------------------------


def test_an_fp8_pool_holds_twice_the_tokens_of_a_bfloat16_one():
    shape = CacheShape(num_layers=4, num_kv_heads=2, head_dim=64)
    assert shape.bytes_per_token(FP8_DTYPE) * 2 == shape.bytes_per_token(torch.bfloat16)
    size = 1 << 20
    bf16 = KVPool.for_memory(shape, size, 16, torch.bfloat16)
    fp8 = KVPool.for_memory(shape, size, 16, FP8_DTYPE)
    assert fp8.num_tokens == 2 * bf16.num_tokens == 2 * 16 * (size // (16 * 2048))
    assert fp8.k[0].dtype == FP8_DTYPE and fp8.k[0].element_size() == 1
    assert sum(t.nbytes for t in fp8.k + fp8.v) == sum(t.nbytes for t in bf16.k + bf16.v)


def test_pool_scales_copies_and_checks():
    shape = CacheShape(num_layers=2, num_kv_heads=1, head_dim=8)
    pool = KVPool(shape, 4, 2, FP8_DTYPE, k_scales=[0.5, 2.0], v_scales=[1.0, 0.125])
    assert pool.scales(1) == {"k_scale": 2.0, "v_scale": 0.125}
    for t in pool.k + pool.v:
        t.view(torch.uint8)[1] = torch.arange(16, dtype=torch.uint8).view(2, 1, 8)
    pool.copy_blocks([(1, 3)])  # a forked sample's last block
    assert all(torch.equal(t[3].view(torch.uint8), t[1].view(torch.uint8)) for t in pool.k + pool.v)
    with pytest.raises(ValueError, match="2 layers"):
        KVPool(shape, 4, 2, FP8_DTYPE, k_scales=[1.0])
    with pytest.raises(ValueError, match="takes no scales"):
        KVPool(shape, 4, 2, torch.float32, k_scales=[1.0, 2.0])


# --- the engine's steps over an FP8 pool ------------------------------------------------------


def _teacher_forced_logits(model, pool, prompts, steps):
    """Logits [steps + 1, B, V] of a padded prefill and `steps` decode steps through a
    BatchedPagedKVCache on `pool`, feeding each step the argmax of `steps` given (a list of
    token lists per step) or, when None, its own argmax; returns (logits, tokens fed)."""
    from nanoserve.model.attention import AttentionMetadata

    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], valid[i, :len(p)] = torch.tensor(p), True
    cache = BatchedPagedKVCache(pool, B)
    pos = torch.arange(T).expand(B, T)
    lens = valid.sum(1)
    with torch.no_grad():
        logits = model(ids, pos, cache, AttentionMetadata.prefill(valid))
        out = [logits[torch.arange(B), lens - 1]]
        fed = []
        for s in range(len(steps) if steps is not None else 6):
            tok = steps[s] if steps is not None else out[-1].argmax(-1)
            fed.append(tok)
            step = model(tok[:, None], (lens + s)[:, None], cache, AttentionMetadata.decode())
            out.append(step[:, 0])
    cache.free_all()
    return torch.stack(out), fed


def test_fp8_pool_logits_stay_close_to_the_float_pools(attentive_model):
    """The same tokens through a float32 pool and an FP8 pool (scales 1.0, and 0.25 / 0.5):
    every step's logits within 10% of the logits' spread (on average within 2%), and the
    same argmax on at least 90% of (row, step) pairs. (Measured: at most 6%, on average 1%,
    argmax agreeing on 95%; the tiny model's keys are small, many in e4m3's subnormal range
    at scale 1.0.)"""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (5, 17, 30)]
    shape = CacheShape.of(attentive_model.config)
    ref, fed = _teacher_forced_logits(attentive_model, KVPool(shape, 32, 8), prompts, None)
    spread = float(ref.std())
    layers = shape.num_layers
    for ks, vs in ((1.0, 1.0), (0.25, 0.5)):
        pool = KVPool(shape, 32, 8, FP8_DTYPE, k_scales=[ks] * layers, v_scales=[vs] * layers)
        got, _ = _teacher_forced_logits(attentive_model, pool, prompts, fed)
        assert torch.equal(got[0], ref[0])  # the prefill attends to its own, unquantized K/V
        diff = (got - ref).abs() / spread
        agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        assert diff.max() < 0.1 and diff.mean() < 0.02 and agree >= 0.9, (ks, vs, diff, agree)


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 0.5)])
@pytest.mark.parametrize("prefix_len", [0, 24])
def test_continuous_batching_over_an_fp8_pool(attentive_model, prefix_len, k_scale, v_scale):
    """Greedy rows (some sharing a 24-token prefix: prefix-cache hits over FP8 blocks)
    through the continuous scheduler on an FP8 pool (unit scales, and K / V scales that are
    not: every store and read must apply its layer's) and on a float32 pool: at least 90%
    of all tokens equal position by position; hits happen; every block comes back."""
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(3, 128) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, 128) for _ in range(rng.randint(1, 12))]
               for _ in range(8)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 8
    shape = CacheShape.of(attentive_model.config)
    runs = {}
    for dtype in (torch.float32, FP8_DTYPE):
        scales = ({} if dtype == torch.float32 else
                  {"k_scales": [k_scale] * shape.num_layers,
                   "v_scales": [v_scale] * shape.num_layers})
        pool = KVPool(shape, 96, 8, dtype, **scales)
        runs[dtype] = generate_continuous(attentive_model, prompts, params, (), pool,
                                          max_batch_size=3)
        assert pool.allocator.num_free == pool.num_blocks
    (ref, _), (fp8, stats) = runs[torch.float32], runs[FP8_DTYPE]
    same = sum(a == b for r, f in zip(ref, fp8) for a, b in zip(r.token_ids, f.token_ids))
    assert same >= 0.9 * sum(len(r.token_ids) for r in ref)
    assert (stats.cached_tokens > 0) == (prefix_len > 0)


# --- where the engine refuses it, and the checkpoint's scales --------------------------------


def test_the_engine_refuses_fp8_on_the_cpu_in_one_line(tiny_model_dir):
    from nanoserve.llm import LLM

    with pytest.raises(NanoserveError) as e:
        LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="fp8")
    assert "compute capability 8.9" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(NanoserveError, match="auto, fp8, fp8_e4m3"):
        LLM(str(tiny_model_dir), device="cpu", kv_cache_dtype="int8")


def test_kv_scales_are_read_from_the_checkpoints_names(tmp_path):
    from safetensors.torch import save_file

    from nanoserve.cache.kv_cache_dtype import read_kv_scales

    p = "model.layers.{}.self_attn."
    save_file({p.format(0) + "k_scale": torch.tensor(0.5), p.format(0) + "v_scale": torch.tensor([0.25]),
               p.format(1) + "k_proj.output_scale": torch.tensor([2.0]),
               p.format(1) + "v_proj.output_scale": torch.tensor([0.1, 0.3]),  # per head: max
               p.format(2) + "kv_scale": torch.tensor(4.0),
               p.format(3) + "attn.k_scale": torch.tensor(0.75),
               p.format(4) + "k_proj.k_scale": torch.tensor(1.5),
               p.format(4) + "v_proj.v_scale": torch.tensor(2.5),
               p.format(5) + "k_proj.weight": torch.ones(2, 2)}, str(tmp_path / "a.safetensors"))
    k, v, found = read_kv_scales(tmp_path, 6)
    assert k == [0.5, 2.0, 4.0, 0.75, 1.5, 1.0]
    assert [round(x, 6) for x in v] == [0.25, 0.3, 4.0, 1.0, 2.5, 1.0]
    assert found == 5
    assert read_kv_scales(tmp_path / "a.safetensors", 6)[2] == 0  # not a folder: none
    save_file({p.format(0) + "k_scale": torch.tensor(-1.0)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ModelError, match="positive"):
        read_kv_scales(tmp_path, 6)


@pytest.fixture(scope="module")
def attentive_model(tiny_model_dir):
    """The tiny model with q and k scaled up 3x (tests/test_scheduler.py's sharp model takes
    12x): its attention is no longer nearly uniform, so a change in the cached keys and
    values shows in its logits and tokens."""
    from nanoserve.model.model import build_model
    from nanoserve.weights.weights import load_checkpoint

    config, sd = load_checkpoint(tiny_model_dir)
    for name in sd:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            sd[name] = sd[name] * 3
    return build_model(config, sd)


def test_flags_and_job_options_carry_the_kv_cache_dtype(tmp_path):
    from nanoserve_cli import build_parser
    from ray_jobs.workers.options import JobOptions

    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    args = parser.parse_args(["batch", "in.jsonl", "-o", str(tmp_path), "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    assert parser.parse_args(["batch", "in.jsonl", "-o", str(tmp_path)]).kv_cache_dtype == "auto"
    assert JobOptions(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(NanoserveError, match="kv_cache_dtype"):
        JobOptions(kv_cache_dtype="int8")


def test_a_checkpoint_with_kv_scales_still_loads(tiny_model_dir, tmp_path):
    """The scale tensors are not model weights: the checkpoint loads as without them."""
    import shutil

    from safetensors.torch import load_file, save_file

    from nanoserve.weights.weights import load_checkpoint

    folder = tmp_path / "with-scales"
    shutil.copytree(tiny_model_dir, folder)
    (file,) = folder.glob("*.safetensors")
    sd = load_file(str(file))
    sd["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    sd["model.layers.1.self_attn.v_scale"] = torch.tensor(2.0)
    save_file(sd, str(file), metadata={"format": "pt"})
    _, got = load_checkpoint(folder)
    _, want = load_checkpoint(tiny_model_dir)
    assert got.keys() == want.keys()
    from nanoserve.cache.kv_cache_dtype import read_kv_scales

    assert read_kv_scales(folder, 2) == ([0.5, 1.0], [1.0, 2.0], 2)
