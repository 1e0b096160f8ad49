"""The FP8 KV cache on a GPU of compute capability 8.9 or newer (the H200): each kernel
reading or writing an FP8 pool against its PyTorch reference, and the engine with
`kv_cache_dtype="fp8"` against the same engine with its bfloat16 cache.

Skipped cleanly without Triton, without CUDA, or below sm_89. Tolerances:
- stores (store_kv, rotary_store): bit for bit (values; +0 and -0 alike) with the
  reference's quantization (torch's float32 -> e4m3 conversion);
- attention over an FP8 pool against the reference in float64 on the same inputs: within
  `attention_bounds.head_bound` at every element, the error that the kernel's own
  roundings can make there (tests/attention_bounds.py derives it from the formats: the
  probabilities in e4m3 on the decode kernel's FP8 tensor-core path, or in bfloat16; the
  query in two e4m3 terms; float32 sums; a bfloat16 output). The decode queries point at
  one token each (a needle), for even heads one of the row's last 16, and their scores
  spread so that few tokens hold the weight: a kernel that reads a token wrongly, or skips
  it, is then far outside the bound. The FP8 tensor-core path does not run under the
  interpreter; tests/test_fp8_kv.py holds the same bound against a PyTorch emulation of
  its arithmetic on these cases (measured: the emulation within 0.62 of it; a kernel
  dropping the last 16 tokens 30x and more outside it, one splitting the query into one
  e4m3 term instead of two up to 2.2x outside), and
  `test_triton_casts_round_to_nearest_even` checks the bound's premise about the casts.
  On these rows the bound is 0.4-6% of a row's largest output on the FP8 path (up to 24%
  within the 100-token window, which leaves most needles out and spreads the weight over
  many tokens, whose e4m3 roundings add up) and under 1% with bfloat16 probabilities;
- the engine, FP8 against bfloat16 cache, same tokens fed to both (teacher forcing):
  logits within 10% of the logits' spread at every position and within 2% on average,
  the same argmax on at least 90% of positions; free-running greedy tokens equal on at
  least 60% of positions (a row that diverges once continues from other tokens, and this
  random model's top logits are close together: the float32 analogue on the CPU measured
  logits within 3.4% (max) and 0.5% (mean) of the spread, every teacher-forced argmax
  equal, and 82% of free-running tokens equal);
- the engine over an FP8 pool in float32, Triton kernels against the references forced
  (`NANOSERVE_KERNELS=reference`): the same greedy tokens on every row.

What the attention tests catch (GPU-only mutations of
`nanoserve_kernels/paged_attention.py` in `tests/mutations.py`, skipped without a GPU):
- a decode kernel that leaves out the last 16 cached tokens of rows longer than 512;
- the query split into one e4m3 term instead of two (`_split_query`'s `lo` dropped).
- the "f16" form's widening of V's words with its even and odd columns swapped. The decode
  test runs both forms (`fp8_form`): "f16" within its own bound (float16
  probabilities, an exact query), and "e4m3", the default until "f16" is timed here.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 needs compute capability 8.9 or newer", allow_module_level=True)

import triton.language as tl  # noqa: E402
from attention_bounds import (  # noqa: E402
    decode_bound,
    decode_case,
    paged_case,
    prefill_bound,
    uses_f16_form,
    uses_fp8_products,
)

from nanoserve_kernels.kv_quant import FP8_DTYPE  # noqa: E402
from nanoserve_kernels.kv_store import store_kv, store_kv_reference  # noqa: E402
from nanoserve_kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
)
from nanoserve_kernels.paged_prefill import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)
from nanoserve_kernels.rotary_store import rotary_store, rotary_store_reference  # noqa: E402

DEVICE = "cuda"
SCALES = [(1.0, 1.0), (0.37, 2.5)]


def fp8_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8_DTYPE and torch.equal(a.float(), b.float())


def assert_within_bound(actual, exact, bound, what=""):
    """|actual - exact| <= bound at every element (float64, on the CPU); the message names
    the worst element and each row's worst share of its bound."""
    err = (actual.double().cpu() - exact.double().cpu()).abs()
    share = err / bound
    worst = int(share.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), share.shape))
    rows = [round(float(x), 3) for x in share.flatten(1).amax(1)]
    assert float(share.max()) <= 1.0, (
        f"{what}: error {float(err.flatten()[worst]):.4g} at {index} is "
        f"{float(share.max()):.2f}x its bound {float(bound.flatten()[worst]):.4g} "
        f"(exact {float(exact.double().flatten()[worst].cpu()):.4g}); per row: {rows}")


# --- kernels against references ---------------------------------------------------------------


@triton.jit
def _cast_kernel(x_ptr, y8_ptr, y16_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y8_ptr + i, x.to(tl.float8e4nv), mask=i < n)
    tl.store(y16_ptr + i, x.to(tl.bfloat16), mask=i < n)


def test_triton_casts_round_to_nearest_even():
    """The attention bound's premise: the kernels' casts of float32 probabilities (in
    [0, 1]) to e4m3 and to bfloat16 round to nearest, ties to even, as torch's do: random
    values, every midpoint between neighbouring e4m3 values, and values below 2^-10."""
    grid8 = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448
    grid8 = grid8[grid8 <= 1.0]
    mids = (grid8[1:] + grid8[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(1 << 20, generator=g), torch.rand(4096, generator=g) * 2**-9,
                   mids, mids.nextafter(torch.zeros_like(mids)), grid8]).to(DEVICE)
    y8 = torch.empty(x.shape, dtype=FP8_DTYPE, device=DEVICE)
    y16 = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y8, y16, x.numel(), BLOCK=1024)
    assert torch.equal(y8.view(torch.uint8), x.to(FP8_DTYPE).view(torch.uint8))
    assert torch.equal(y16.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


DECODE_SHAPES = [(1, 64, 16), (4, 128, 16), (8, 64, 32), (2, 16, 16)]


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("group,head_dim,block_size", DECODE_SHAPES)
def test_fp8_decode_kernel_matches_reference(group, head_dim, block_size, k_scale, v_scale):
    q, k8, v8, tables, lens = decode_case(group, head_dim, block_size, k_scale, v_scale)
    scale, scales = head_dim ** -0.5, {"k_scale": k_scale, "v_scale": v_scale}
    bounds = {}  # (window, FP8 products, float16 products) -> bound
    qd, k8d, v8d, tablesd, lensd = (x.to(DEVICE) for x in (q, k8, v8, tables, lens))
    # both forms: "f16" (float16 products; head_dim 16: entries converted to bfloat16) and
    # "e4m3" (FP8 products; head_dim 16 and 16-token steps: converted to bfloat16)
    for form in ("f16", "e4m3"):
        for kwargs in ({}, {"num_splits": 1}, {"num_splits": 6}, {"even_splits": True},
                       {"window": 100}, {"block_n": 16}):
            window, block_n = kwargs.get("window"), kwargs.get("block_n", 128)
            fp8 = form == "e4m3" and uses_fp8_products(head_dim, block_n)
            f16 = form == "f16" and uses_f16_form(head_dim, block_n)
            if (window, fp8, f16) not in bounds:
                bounds[window, fp8, f16] = decode_bound(
                    q, k8, v8, tables, lens, scale, k_scale, v_scale, fp8_products=fp8,
                    f16_products=f16, window=window)
            exact = paged_decode_attention_reference(qd.double(), k8d, v8d, tablesd, lensd,
                                                     scale, window=window, **scales)
            out = paged_decode_attention(qd, k8d, v8d, tablesd, lensd, scale, **kwargs,
                                         fp8_form=form, **scales)
            assert out.dtype == torch.bfloat16
            assert_within_bound(out, exact, bounds[window, fp8, f16], f"{form} {kwargs}")


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128)])
def test_fp8_paged_prefill_kernel_matches_reference(group, head_dim, k_scale, v_scale):
    cached, new = [0, 16, 37, 300], [70, 33, 1, 130]
    lens = [c + n for c, n in zip(cached, new)]
    g, k8, v8, tables, lens_t = paged_case(7 * group, lens, 2, head_dim, 16, k_scale, v_scale)
    q = (torch.randn((sum(new), 2 * group, head_dim), generator=g) / 40).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    scale, scales = head_dim ** -0.5, {"k_scale": k_scale, "v_scale": v_scale}
    bound = prefill_bound(q, k8, v8, tables, cu, lens_t, scale, k_scale, v_scale)
    qd, k8d, v8d, tablesd, cud, lensd = (x.to(DEVICE) for x in (q, k8, v8, tables, cu, lens_t))
    args = (k8d, v8d, tablesd, cud, lensd, max(new), scale)
    exact = paged_prefill_attention_reference(qd.double(), *args, **scales)
    out = paged_prefill_attention(qd, *args, **scales)
    assert_within_bound(out, exact, bound)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_stores_match_references(src_dtype):
    g = torch.Generator().manual_seed(3)
    n, hq, hkv, d, nb, block = 300, 8, 2, 128, 40, 16
    qkv = (torch.randn(n, hq + 2 * hkv, d, generator=g) * 100).to(DEVICE, src_dtype)
    cos, sin = (torch.randn(n, d, generator=g).to(DEVICE, src_dtype) for _ in range(2))
    slots = torch.randperm(nb * block, generator=g)[:n].to(DEVICE)
    slots[::7] = -1
    scales = {"k_scale": 0.37, "v_scale": 2.5}
    caches = [torch.zeros((nb, block, hkv, d), dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    k, v = qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    store_kv_reference(k, v, caches[0], caches[1], slots, **scales)
    store_kv(k, v, caches[2], caches[3], slots, **scales)
    assert fp8_equal(caches[2], caches[0]) and fp8_equal(caches[3], caches[1])
    if src_dtype == torch.float32:  # rotary in float32 equals its reference only up to FMAs
        return
    for c in caches:
        c.zero_()
    want = rotary_store_reference(qkv, cos, sin, caches[0], caches[1], slots, hq, **scales)
    got = rotary_store(qkv, cos, sin, caches[2], caches[3], slots, hq, **scales)
    # the rotation's products may fuse (FMA) differently from the reference's: the rotated
    # queries within one rounding of src_dtype, the stored codes equal almost everywhere
    torch.testing.assert_close(got, want, rtol=2 ** -6, atol=float(want.abs().max()) * 2 ** -7)
    for ours, theirs, s in ((caches[2], caches[0], 0.37), (caches[3], caches[1], 2.5)):
        same = (ours.view(torch.uint8) == theirs.view(torch.uint8)).float().mean().item()
        assert same >= 0.98, same  # measured 0.988 (bf16)
        # one e4m3 step of the value, or a rounding of the rotation's inputs (values near
        # zero come from cancellation, whose error scales with the largest operands)
        want_f = theirs.float() * s
        torch.testing.assert_close(ours.float() * s, want_f, rtol=0.13,
                                   atol=float(want_f.abs().max()) * 2 ** -7)


# --- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """save_tiny_byte_llama with its q and k projections scaled 3x (its attention is then not
    nearly uniform, so the cache's precision shows in its logits), and KV scales for layer 0
    in the checkpoint (vLLM's names); layer 1 has none."""
    from safetensors.torch import load_file, save_file

    from nanoserve.testing import save_tiny_byte_llama

    folder = save_tiny_byte_llama(tmp_path_factory.mktemp("fp8-kv"))
    (file,) = folder.glob("*.safetensors")
    sd = load_file(str(file))
    for name in sd:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            sd[name] = sd[name] * 3
    sd["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    sd["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(sd, str(file), metadata={"format": "pt"})
    return folder


def make_llm(model_dir, kv_cache_dtype, **kwargs):
    from nanoserve.llm import LLM

    return LLM(str(model_dir), kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=64 << 20, **kwargs)


def prompts_with_shared_prefix(seed, n=24):
    rng = random.Random(seed)
    prefix = [rng.randrange(0, 256) for _ in range(40)]
    return [prefix[:rng.choice((0, 20, 40))] + [rng.randrange(0, 256)
                                               for _ in range(rng.randint(1, 60))]
            for _ in range(n)]


def teacher_forced_logits(model, pool, prompts, feed=None, steps=24):
    """Logits [steps + 1, B, V]: a padded prefill, then decode steps through a
    BatchedPagedKVCache on `pool`, each fed `feed[s]` (else its own argmax)."""
    from nanoserve.cache.pool import BatchedPagedKVCache
    from nanoserve.model.attention import AttentionMetadata

    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.long, device=DEVICE)
    valid = torch.zeros(B, T, dtype=torch.bool, device=DEVICE)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p, device=DEVICE)
        valid[i, :len(p)] = True
    cache = BatchedPagedKVCache(pool, B)
    lens = valid.sum(1)
    pos = torch.arange(T, device=DEVICE).expand(B, T)
    fed, out = [], []
    with torch.no_grad():
        logits = model(ids, pos, cache, AttentionMetadata.prefill(valid))
        out.append(logits[torch.arange(B, device=DEVICE), lens - 1])
        for s in range(steps if feed is None else len(feed)):
            tok = out[-1].argmax(-1) if feed is None else feed[s]
            fed.append(tok)
            out.append(model(tok[:, None], (lens + s)[:, None], cache,
                             AttentionMetadata.decode())[:, 0])
    cache.free_all()
    return torch.stack(out), fed


def test_engine_fp8_pool_twice_the_tokens_and_checkpoint_scales(model_dir):
    import gc

    from nanoserve.llm import LLM

    bf16, fp8 = make_llm(model_dir, "auto"), make_llm(model_dir, "fp8")
    assert bf16.pool.k[0].dtype == torch.bfloat16 and fp8.pool.k[0].dtype == FP8_DTYPE
    assert fp8.pool.num_tokens == 2 * bf16.pool.num_tokens
    assert fp8.pool.k_scales == [0.5, 1.0] and fp8.pool.v_scales == [0.25, 1.0]
    del bf16, fp8
    sizes = {}
    for dtype in ("auto", "fp8"):  # sized by free memory
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(str(model_dir), kv_cache_dtype=dtype, kv_cache_fraction=0.05)
        sizes[dtype] = llm.pool.num_tokens
        del llm
    assert 1.9 <= sizes["fp8"] / sizes["auto"] <= 2.1


def test_engine_fp8_logits_close_to_the_bfloat16_cache(model_dir):
    """Same model, same tokens fed: logits over an FP8 pool against a bfloat16 pool."""
    bf16, fp8 = make_llm(model_dir, "auto"), make_llm(model_dir, "fp8")
    prompts = prompts_with_shared_prefix(1, n=16)
    ref, fed = teacher_forced_logits(bf16.model, bf16.pool, prompts)
    got, _ = teacher_forced_logits(fp8.model, fp8.pool, prompts, fed)
    spread = float(ref.float().std())
    diff = (got - ref).abs() / spread
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert diff.max() < 0.1 and diff.mean() < 0.02 and agree >= 0.9, (diff.max(), agree)


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_engine_fp8_generates_like_the_bfloat16_cache_with_prefix_hits(model_dir, scheduler):
    """Greedy rows sharing prefixes (prefix-cache hits over FP8 blocks), with captured decode
    steps (continuous) or static batches: tokens agree with the bfloat16 cache's on at least
    60% of positions; hits happen; the pool gets every block back."""
    from nanoserve.sampling.params import SamplingParams

    prompts = prompts_with_shared_prefix(2)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    runs = {}
    for dtype in ("auto", "fp8"):
        llm = make_llm(model_dir, dtype, scheduler=scheduler)
        llm.generate(prompts[:2], params)  # names the shared prefix's blocks
        runs[dtype] = (llm.generate(prompts, params), llm.last_stats)
        assert llm.pool.allocator.num_free == llm.pool.num_blocks
    (ref, _), (fp8, stats) = runs["auto"], runs["fp8"]
    assert stats.cached_tokens > 0
    same = sum(a == b for r, f in zip(ref, fp8) for a, b in zip(r.token_ids, f.token_ids))
    assert same >= 0.6 * sum(len(r.token_ids) for r in ref)


def test_engine_fp8_kernels_equal_the_references_in_float32(monkeypatch, model_dir):
    """float32 model over an FP8 pool: greedy tokens through the Triton kernels (captured
    continuous steps, fused rotary-store, paged prefill after prefix hits) equal the same
    engine with the PyTorch references forced (`NANOSERVE_KERNELS=reference`) on every
    row: both read the same e4m3 bytes, and in float32 they differ only in rounding order."""
    from nanoserve.sampling.params import SamplingParams

    prompts = prompts_with_shared_prefix(3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = []
    for forced in (False, True):
        with monkeypatch.context() as m:
            if forced:
                m.setenv("NANOSERVE_KERNELS", "reference")
            llm = make_llm(model_dir, "fp8", dtype="float32",
                           decode_step="eager" if forced else "auto")
            llm.generate(prompts[:2], params)
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
            assert llm.last_stats.cached_tokens > 0
    assert runs[0] == runs[1]
