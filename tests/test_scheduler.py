"""nanoserve.scheduling.scheduler: continuous batching held to each row run alone.

Oracle: the same row through the static path alone (`generate_batch` with one row), which
other tests hold to the dense path and to transformers. Every test also checks that the
pool gets every block back.
"""

from __future__ import annotations

import random

import pytest

from nanoserve.cache.pool import CacheShape, KVPool
from nanoserve.errors import CacheFullError
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.model_runner import ContinuousRunner
from nanoserve.scheduling.scheduler import generate_continuous
from nanoserve.static.generate import generate_batch, greedy_generate


def make_pool(model, num_blocks, block_size=16):
    return KVPool(CacheShape.of(model.config), num_blocks, block_size, model.dtype, model.device)


def mixed_rows(seed, n, sampled=False):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = []
    for i in range(n):
        if sampled:
            params.append(SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.9,
                                         top_k=rng.choice((0, 20)), top_p=rng.choice((1.0, 0.9)),
                                         seed=1000 + i))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(1, 20)))
    return prompts, params


def alone(model, prompt, p, eos):
    (out,), _ = generate_batch(model, [prompt], [p], eos)
    return out


def assert_free(pool):
    assert pool.allocator.num_free == pool.num_blocks


@pytest.mark.parametrize("sampled", [False, True])
def test_rows_equal_each_row_alone_as_rows_come_and_go(tiny_model, sampled):
    """16 rows, at most 3 running: rows are admitted as others finish (EOS = token 2 ends
    some early), and each row's tokens and finish reason are the ones it gets alone."""
    prompts, params = mixed_rows(7, 16, sampled)
    eos = (2,)
    pool = make_pool(tiny_model, 64)
    outs, stats = generate_continuous(tiny_model, prompts, params, eos, pool, max_batch_size=3)
    for prompt, p, out in zip(prompts, params, outs):
        want = alone(tiny_model, prompt, p, eos)
        assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
    # The first token comes from the prefill, every other from one decode step of a live
    # row; a row that stops on EOS is known to have stopped one step late (at most one
    # dropped step each), a row that stops on length never is.
    assert stats.decode_row_steps - stats.finished_row_steps == sum(
        len(o.token_ids) - 1 for o in outs)
    assert stats.finished_row_steps <= sum(o.finish_reason == "stop" for o in outs)
    assert stats.preemptions == 0
    assert stats.num_rows == 16 and stats.prefill_real_tokens == sum(map(len, prompts))
    assert_free(pool)


def test_greedy_equals_the_dense_oracle(tiny_model):
    prompts, _ = mixed_rows(3, 6)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 6
    outs, _ = generate_continuous(tiny_model, prompts, params, max_batch_size=4)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_generate(tiny_model, prompt, 12)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_dry_pool_preempts_and_recomputes_without_changing_tokens(tiny_model, sampled):
    """A pool of 12 blocks of 4 tokens for 8 rows that grow to 8-11 blocks each: rows are
    preempted (blocks freed, sent back to the queue) and recomputed later; every row still
    gets exactly its tokens alone, sampled rows included (their generators are never
    rewound)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(6, 14))] for _ in range(8)]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                             seed=50 + i) for i in range(8)]
    pool = make_pool(tiny_model, 12, block_size=4)
    outs, stats = generate_continuous(tiny_model, prompts, params, (), pool, max_batch_size=8)
    assert stats.preemptions > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(tiny_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_prefill_token_budget_admits_fewer_rows_at_a_time(tiny_model):
    prompts = [[5 + i] * 30 for i in range(6)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 6
    pool = make_pool(tiny_model, 64)
    outs, stats = generate_continuous(tiny_model, prompts, params, (), pool,
                                      max_prefill_tokens=60)  # two 30-token prompts at a time
    assert stats.prefill_slots == 6 * 30  # no padding: same lengths, 3 prefills of 2 rows
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(tiny_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_a_running_batch_takes_new_rows_in_groups(tiny_model, monkeypatch):
    """With 32 row slots (ADMIT_SHARE 16: groups of 2) and rows that finish one per step,
    no admission after the first takes fewer than two rows unless fewer wait; every row is
    still the one it is alone."""
    from nanoserve.scheduling import scheduler as sched_mod
    monkeypatch.setattr(sched_mod, "ADMIT_SHARE", 16)
    rng = random.Random(9)
    n = 48
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    params = [SamplingParams(max_tokens=2 + i, ignore_eos=True) for i in range(n)]  # one by one
    sizes: list[int] = []
    real_prefill = ContinuousRunner.prefill

    def counting(self, tokens, *args, **kwargs):
        sizes.append(len(tokens))
        return real_prefill(self, tokens, *args, **kwargs)

    monkeypatch.setattr(ContinuousRunner, "prefill", counting)
    pool = make_pool(tiny_model, 512, block_size=4)
    outs, stats = generate_continuous(tiny_model, prompts, params, (), pool, max_batch_size=32)
    assert sizes[0] == 32 and sum(sizes) == n and stats.preemptions == 0
    waiting = n - 32
    for size in sizes[1:]:
        assert size >= min(2, waiting), sizes
        waiting -= size
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(tiny_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_rows_that_end_by_the_dozen_join_in_larger_groups(tiny_model, monkeypatch):
    """With 32 row slots (ADMIT_SHARE 16: groups of at least 2, ADMIT_FULL_SHARE 2: at once
    from 16, ADMIT_WAIT_STEPS 3) and rows that end after 2-12 tokens (several each step),
    an admission of fewer than 16 rows (fewer waiting aside) comes only after 3 decode steps
    since the one before; every row is still the one it is alone."""
    from nanoserve.scheduling import scheduler as sched_mod
    monkeypatch.setattr(sched_mod, "ADMIT_SHARE", 16)
    monkeypatch.setattr(sched_mod, "ADMIT_FULL_SHARE", 2)
    monkeypatch.setattr(sched_mod, "ADMIT_WAIT_STEPS", 3)
    rng = random.Random(11)
    n = 120
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in range(n)]
    events: list[tuple[str, int]] = []
    real_prefill, real_decode = ContinuousRunner.prefill, ContinuousRunner.decode

    def prefill(self, tokens, *args, **kwargs):
        events.append(("prefill", len(tokens)))
        return real_prefill(self, tokens, *args, **kwargs)

    def decode(self, slots, *args, **kwargs):
        events.append(("decode", len(slots)))
        return real_decode(self, slots, *args, **kwargs)

    monkeypatch.setattr(ContinuousRunner, "prefill", prefill)
    monkeypatch.setattr(ContinuousRunner, "decode", decode)
    pool = make_pool(tiny_model, 512, block_size=4)
    outs, stats = generate_continuous(tiny_model, prompts, params, (), pool, max_batch_size=32)
    sizes = [k for e, k in events if e == "prefill"]
    assert sizes[0] == 32 and sum(sizes) == n and stats.preemptions == 0
    waiting, steps, small = n - 32, 0, 0
    for e, k in events[1:]:
        if e == "decode":
            steps += 1
            continue
        if k < min(16, waiting):
            assert k >= min(2, waiting) and steps >= 3, events
            small += 1
        waiting -= k
        steps = 0
    assert small and len(sizes) < n // 8  # the waiting rule was used; few, large prefills
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(tiny_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_no_prompts_no_work(tiny_model):
    outs, stats = generate_continuous(tiny_model, [], [])
    assert outs == [] and stats.num_rows == 0 and stats.decode_row_steps == 0


def test_a_row_too_big_for_the_pool_alone_is_refused_before_anything_runs(tiny_model):
    pool = make_pool(tiny_model, 4, block_size=4)  # 16 tokens
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
    with pytest.raises(CacheFullError, match="prompt 1 .* needs 5 KV blocks"):  # 10 + 8 - 1
        generate_continuous(tiny_model, [[5, 6], [7] * 10], params, (), pool)
    assert_free(pool)


def test_rows_that_exactly_fill_the_pool_alone_still_run(tiny_model):
    """Peak = prompt + max_tokens - 1 tokens (the last token is never written): a row of
    16 + 1 tokens needs exactly one block of 16, and a pool of one block serves it."""
    pool = make_pool(tiny_model, 1)
    params = [SamplingParams(max_tokens=1, ignore_eos=True),
              SamplingParams(max_tokens=9, ignore_eos=True)]
    prompts = [[5] * 16, [6] * 8]
    outs, _ = generate_continuous(tiny_model, prompts, params, (), pool)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(tiny_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_a_pool_held_elsewhere_is_an_error_not_a_hang(tiny_model):
    pool = make_pool(tiny_model, 4, block_size=4)
    held = pool.allocator.allocate(3)  # another user of the pool holds 3 of the 4 blocks
    with pytest.raises(CacheFullError, match="prompt 0 cannot start: .* 1 of 4 blocks free"):
        generate_continuous(tiny_model, [[5] * 8], [SamplingParams(max_tokens=2)], (), pool)
    pool.allocator.free(held)
    assert_free(pool)


def test_every_block_comes_back_when_the_model_raises_mid_run(tiny_model, monkeypatch):
    prompts, params = mixed_rows(9, 8)
    pool = make_pool(tiny_model, 64)
    original = type(tiny_model).hidden_states
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("device fell over")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tiny_model), "hidden_states", failing)
    with pytest.raises(RuntimeError, match="fell over"):
        generate_continuous(tiny_model, prompts, params, (2,), pool, max_batch_size=3)
    assert_free(pool)


# --- the bucketed fixed-tensor step (what a CUDA graph replays) against the eager step -----


def run_mode(model, prompts, params, eos, pool, mode, max_batch_size):
    from nanoserve.scheduling.model_runner import ContinuousRunner

    runner = ContinuousRunner(model, pool, max_batch_size, mode)
    return generate_continuous(model, prompts, params, eos, pool, max_batch_size=max_batch_size,
                               runner=runner)


@pytest.mark.parametrize("sampled", [False, True])
def test_bucketed_static_step_equals_eager_step(tiny_model, sampled):
    """Rows joining, finishing on EOS and on length, and (a pool of 20 blocks of 4) being
    preempted: the padded, bucketed step over fixed tensors gives every row the tokens and
    finish reason of the eager step, and the same stats; both equal each row alone."""
    prompts, params = mixed_rows(21, 12, sampled)
    params = [SamplingParams(max_tokens=p.max_tokens + 10, temperature=p.temperature,
                             top_k=p.top_k, top_p=p.top_p, seed=p.seed) for p in params]
    eos = (2, 7)
    results = {}
    for mode in ("eager", "static"):
        pool = make_pool(tiny_model, 20, block_size=4)
        results[mode] = run_mode(tiny_model, prompts, params, eos, pool, mode, 5)
        assert_free(pool)
    (eager, es), (static, ss) = results["eager"], results["static"]
    assert [(o.token_ids, o.finish_reason) for o in static] == [
        (o.token_ids, o.finish_reason) for o in eager]
    assert ss == es and ss.preemptions > 0
    for prompt, p, out in zip(prompts, params, static):
        assert out.token_ids == alone(tiny_model, prompt, p, eos).token_ids


def test_padding_rows_of_a_bucket_touch_no_row(tiny_model):
    """3 rows run in the bucket of 4: the padding row stores nothing (its slot is -1). The
    pools start filled with a sentinel; afterwards the slots the eager run never wrote
    still hold it in the bucketed run, and the written ones hold the same K/V (up to the
    rounding of a 4-row matmul against a 3-row one)."""
    import torch

    prompts, _ = mixed_rows(4, 3)
    params = [SamplingParams(max_tokens=9, ignore_eos=True)] * 3
    pools = {}
    for mode in ("eager", "static"):
        pool = make_pool(tiny_model, 64, block_size=4)
        for t in pool.k + pool.v:
            t.fill_(7.0)
        run_mode(tiny_model, prompts, params, (), pool, mode, 4)
        pools[mode] = pool
    for layer in range(tiny_model.config.num_hidden_layers):
        for got, want in ((pools["static"].k[layer], pools["eager"].k[layer]),
                          (pools["static"].v[layer], pools["eager"].v[layer])):
            untouched = want == 7.0
            assert untouched.any()
            assert torch.equal(got == 7.0, untouched)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --- through LLM and the batch job -----------------------------------------------------------

TEXTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time",
         "SELECT name FROM", "Hello", "Les fleurs du", "The quick brown fox jumps over the"]


def test_llm_continuous_equals_llm_static(tiny_job_model):
    """Same completions (tokens, text, finish reason, stop strings cut) as the static
    scheduler over text prompts, with at most one decode step spent on a row that stopped
    (the step queued before its stop was read)."""
    from nanoserve.llm import LLM

    llm = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=32 << 20,
              max_batch_size=3, scheduler="continuous")
    static = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=32 << 20,
                 scheduler="static")
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(max_tokens=4 + 3 * i, stop=["e"] if i % 3 == 0 else [],
                             temperature=0.7 if i % 2 else 0.0, seed=i) for i in range(len(TEXTS))]
    got = llm.generate(prompts, params)
    want = static.generate(prompts, params)
    assert [(g.token_ids, g.text, g.finish_reason) for g in got] == [
        (w.token_ids, w.text, w.finish_reason) for w in want]
    stopped = sum(g.finish_reason == "stop" for g in got)
    assert llm.last_stats.finished_row_steps <= stopped
    assert static.last_stats.finished_row_steps > stopped


def test_llm_takes_text_prompts_as_their_encoded_ids(tiny_job_model):
    """A text prompt is the tokenizer's encoding of it (BOS rule included); a bare string in
    place of the list is refused with a message, not split into characters."""
    from nanoserve.llm import LLM

    llm = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=8 << 20)
    params = SamplingParams(max_tokens=5)
    by_text = llm.generate(TEXTS[:3], params)
    by_ids = llm.generate([llm.tokenizer.encode(t) for t in TEXTS[:3]], params)
    assert [c.token_ids for c in by_text] == [c.token_ids for c in by_ids]
    with pytest.raises(TypeError, match="list of prompts"):
        llm.generate(TEXTS[0], params)


def test_batch_job_with_the_continuous_scheduler(ray_session, tiny_job_model, tiny_llm,
                                                 tmp_path):
    import json

    import pyarrow.dataset as ds

    from ray_jobs import run_batch_job

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    summary = run_batch_job(path, tmp_path / "out", model=str(tiny_job_model), max_tokens=5,
                            batch_size=4, kv_cache_bytes=32 << 20, progress=False,
                            scheduler="continuous")
    assert summary.rows == len(TEXTS) and summary.error_rows == 0
    rows = sorted(ds.dataset(tmp_path / "out").to_table().to_pylist(), key=lambda r: r["id"])
    want = tiny_llm.generate([tiny_llm.tokenizer.encode(t) for t in TEXTS],
                             SamplingParams(max_tokens=5))
    assert [r["generated_token_ids"] for r in rows] == [w.token_ids for w in want]


def test_batch_job_reports_the_prefix_hit_rate(ray_session, tiny_job_model, tiny_llm, tmp_path):
    """Rows behind one long system text: the workers' prefix caches serve part of their
    prompts; the summary (and its printed form) says how much, the rows equal the engine's,
    and with --no-prefix-caching nothing is served from a cache."""
    import json

    import pyarrow.dataset as ds

    from ray_jobs import run_batch_job

    system = "You are a careful assistant. Answer in one short sentence. " * 6
    texts = [system + t for t in TEXTS]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    rates = {}
    for caching in (True, False):
        out = tmp_path / f"out-{caching}"
        summary = run_batch_job(path, out, model=str(tiny_job_model), max_tokens=4,
                                batch_size=3, kv_cache_bytes=32 << 20, progress=False,
                                scheduler="continuous", prefix_caching=caching)
        rates[caching] = summary.prefix_hit_rate
        rows = sorted(ds.dataset(out).to_table().to_pylist(), key=lambda r: r["id"])
        want = tiny_llm.generate([tiny_llm.tokenizer.encode(t) for t in texts],
                                 SamplingParams(max_tokens=4))
        assert [r["generated_token_ids"] for r in rows] == [w.token_ids for w in want]
        assert ("prefix cache: " in summary.format()) == caching
    assert rates[True] > 0.3 and rates[False] is None  # None: no engine had a prefix cache


def test_unknown_scheduler_is_refused():
    from nanoserve.errors import NanoserveError
    from ray_jobs.dispatch.driver import JobOptions

    with pytest.raises(NanoserveError, match="unknown scheduler 'fifo'"):
        JobOptions(scheduler="fifo")


# --- prefix caching ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp_model(tiny_model_dir):
    """The tiny model with its q and k projections scaled up: its attention is sharp, so a
    token at a wrong position or a wrong cached key changes the output (the plain tiny
    model's attention is nearly uniform, and its greedy tokens barely depend on either)."""
    from nanoserve.model.model import build_model
    from nanoserve.weights.weights import load_checkpoint

    config, sd = load_checkpoint(tiny_model_dir)
    for name in sd:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            sd[name] = sd[name] * 12
    return build_model(config, sd)


def shared_prefix_rows(prefix_len, n, seed, sampled=False, suffix=(1, 20)):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 128) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, 128) for _ in range(rng.randint(*suffix))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(2, 10), temperature=0.8 if sampled else 0.0,
                             seed=300 + i, ignore_eos=True) for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("prefix_len,sampled", [(0, False), (4, False), (9, True), (24, False),
                                                (40, True)])
def test_prefix_caching_gives_the_tokens_of_no_caching(sharp_model, prefix_len, sampled):
    """Rows sharing no block (prefix 0 or shorter than a block of 8), one block, several
    blocks, and prompts that end exactly on a block boundary (suffix 0 after 24 or 40
    tokens: the last block is prefilled again, never shared): each row's tokens with
    caching equal its tokens without; hits happen where a full block is shared; every
    block comes back."""
    prompts, params = shared_prefix_rows(prefix_len, 10, prefix_len, sampled,
                                         suffix=(0, 12) if prefix_len % 8 == 0 else (1, 12))
    runs = {}
    for caching in (False, True):
        pool = make_pool(sharp_model, 128, block_size=8)
        runs[caching] = generate_continuous(sharp_model, prompts, params, (), pool,
                                            max_batch_size=3, prefix_caching=caching)
        assert pool.allocator.num_free == pool.num_blocks
    (off, off_stats), (on, on_stats) = runs[False], runs[True]
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert off_stats.cached_tokens == 0
    if prefix_len >= 8:
        assert on_stats.cached_tokens >= 8 * (len(prompts) - 3) * (prefix_len // 8 - 1)
        assert on_stats.prefill_real_tokens < off_stats.prefill_real_tokens
    else:
        assert on_stats.cached_tokens == 0
    assert on_stats.cached_tokens + on_stats.prefill_real_tokens == sum(map(len, prompts))
    assert [o.num_cached_tokens for o in on][0] == 0  # the first row finds nothing


def test_prefix_caching_with_preemption_keeps_tokens_and_blocks(sharp_model):
    prompts, params = shared_prefix_rows(16, 8, 2)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, seed=i) for i in range(8)]
    pool = make_pool(sharp_model, 24, block_size=4)
    outs, stats = generate_continuous(sharp_model, prompts, params, (), pool, max_batch_size=8)
    assert stats.preemptions > 0 and stats.cached_tokens > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(sharp_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_a_corrupted_cached_block_changes_the_rows_that_reuse_it(sharp_model):
    """The cache is really read: overwrite the K/V of the shared prefix's cached blocks
    between two calls over one pool, and the second call's rows (which reuse those blocks)
    come out different from the first's, while with caching off they do not."""
    import torch

    prompts, params = shared_prefix_rows(32, 4, 6)
    params = [SamplingParams(max_tokens=8, ignore_eos=True)] * 4
    for caching in (True, False):
        pool = make_pool(sharp_model, 64, block_size=8)
        first, _ = generate_continuous(sharp_model, prompts, params, (), pool,
                                       prefix_caching=caching)
        for t in pool.k + pool.v:
            t.copy_(torch.randn_like(t))
        second, stats = generate_continuous(sharp_model, prompts, params, (), pool,
                                            prefix_caching=caching)
        same = [a.token_ids == b.token_ids for a, b in zip(first, second)]
        if caching:
            assert stats.cached_tokens > 0 and not all(same)
        else:
            assert all(same)


@pytest.mark.parametrize("sampled", [False, True])
def test_static_batches_reuse_blocks_an_earlier_batch_named(sharp_model, sampled):
    """The static path: a second batch on the pool starts from the prefix blocks the first
    batch named (freed, kept in the cached-free LRU) and prefills the rest packed over
    them; its tokens equal its tokens without caching, and every block comes back."""
    prompts, params = shared_prefix_rows(24, 8, 9, sampled)
    first, second = (prompts[:4], params[:4]), (prompts[4:], params[4:])
    pool = make_pool(sharp_model, 64, block_size=8)
    generate_batch(sharp_model, *first, (), pool, prefix_caching=True)
    got, stats = generate_batch(sharp_model, *second, (), pool, prefix_caching=True)
    want, plain = generate_batch(sharp_model, *second, (), make_pool(sharp_model, 64, 8))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats.cached_tokens == 4 * 24  # 24 shared tokens: three full blocks of 8 per row
    assert stats.prefill_real_tokens == plain.prefill_real_tokens - stats.cached_tokens
    assert [o.num_cached_tokens for o in got] == [24] * 4
    assert_free(pool)


def test_llm_static_scheduler_with_and_without_prefix_caching(tiny_job_model):
    from nanoserve.llm import LLM

    prompts, params = shared_prefix_rows(40, 9, 10, sampled=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=8 << 20,
                  max_batch_size=3, scheduler="static", enable_prefix_caching=caching)
        outs[caching] = llm.generate(prompts, params)
        hit = llm.last_stats.prefix_hit_rate
        assert (hit > 0) == caching
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]


def test_rows_a_preemption_ends_leave_the_queue_to_the_next_step(tiny_model):
    """A step whose admission found the pool full, then whose preemption check read the
    queued steps and saw the last running rows end (stop tokens), has nothing running and
    rows waiting: the next step admits them (it used to raise CacheFullError with the
    whole pool free). Every row equals itself run alone; every block comes back."""
    rng = random.Random(321)  # a configuration that reaches that step
    n = rng.randint(3, 8)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(4, 30))] for _ in range(n)]
    stops = rng.sample(range(3, 128), rng.randint(30, 100))
    params = [SamplingParams(max_tokens=rng.randint(4, 30), stop_token_ids=stops,
                             temperature=0.8, seed=i) for i in range(n)]
    need = max(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts, params))
    pool = make_pool(tiny_model, need + rng.randint(0, 1), block_size=4)
    outs, _ = generate_continuous(tiny_model, prompts, params, (), pool,
                                  max_batch_size=rng.randint(2, 6))
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(tiny_model, prompt, p, ()).token_ids
    assert_free(pool)


def test_prefill_length_rounds_up_to_few_shapes():
    from nanoserve.scheduling.fixed_prefill import prefill_length

    got = [prefill_length(n) for n in range(1, 9000)]
    assert all(n <= g < n + 256 for n, g in zip(range(1, 9000), got))
    assert got == sorted(got) and prefill_length(1024) == 1024 and prefill_length(1025) == 1152
    assert prefill_length(4097) == 4352 and all(g % 64 == 0 for g in got)
    # the documented rule: n rounded up to a multiple of 64 up to 1,024 tokens, of 128 up to
    # 4,096, of 256 beyond; so up to the default budget of 8,192 tokens the shapes are those
    # multiples and no others (56 of them, the number the docs quote)
    for n, g in zip(range(1, 9000), got):
        step = 64 if n <= 1024 else 128 if n <= 4096 else 256
        assert g % step == 0 and g - step < n <= g, (n, g)
    assert set(got[:8192]) == (set(range(64, 1025, 64)) | set(range(1152, 4097, 128))
                               | set(range(4352, 8193, 256)))


def test_prefill_lengths_lists_each_padded_length_once():
    from nanoserve.scheduling.fixed_prefill import prefill_length, prefill_lengths

    assert prefill_lengths(8192) == sorted({prefill_length(n) for n in range(1, 8193)})
    assert prefill_lengths(200) == [64, 128, 192] and prefill_lengths(0) == []


def test_padded_prefills_give_the_tokens_and_writes_of_unpadded_ones(sharp_model):
    """Packed prefills padded to `prefill_length` (a padding row after the real ones, as on a
    GPU), eagerly and from the fixed tensors a graph captures ("static": the same code
    uncaptured, with the work tables), against unpadded ones, on the model whose
    attention is sharp: rows over a shared prefix (prefills after cached blocks, the paged
    path, and prefills within their own tokens), sampled rows, a row asking for
    prompt logprobs and one asking for 3 samples: the same tokens, logprobs and stats, and
    the padding stores nothing (pools filled with a sentinel keep it where the unpadded
    run left it)."""
    import torch

    prompts, params = shared_prefix_rows(20, 9, 5, sampled=True, suffix=(1, 13))
    params[2] = SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    params[5] = SamplingParams(max_tokens=5, temperature=0.7, seed=9, n=3, ignore_eos=True)
    runs, pools, kinds = {}, {}, []
    for mode, pad in (("eager", False), ("eager", True), ("static", None)):
        pool = make_pool(sharp_model, 128, block_size=8)
        for t in pool.k + pool.v:
            t.fill_(7.0)
        runner = ContinuousRunner(sharp_model, pool, 3, mode, pad_prefills=pad)
        if mode == "static":
            assert runner.prefill_tokens == 1024  # the pool's 128 blocks of 8
            real = runner._prefill_forward

            def forward(T, paged, real=real):
                kinds.append(paged)
                return real(T, paged)
            runner._prefill_forward = forward
        runs[mode, pad] = generate_continuous(sharp_model, prompts, params, (), pool,
                                              max_batch_size=3, runner=runner)
        pools[mode, pad] = pool
        assert pool.allocator.num_free == pool.num_blocks
    assert set(kinds) == {False, True}  # fixed prefills of both kinds ran
    plain, plain_stats = runs["eager", False]
    for key in (("eager", True), ("static", None)):
        padded, padded_stats = runs[key]
        assert [o.token_ids for o in padded] == [o.token_ids for o in plain]
        assert padded_stats == plain_stats and plain_stats.cached_tokens > 0
        for a, b in zip(padded, plain):
            for x, y in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
                assert (x is None) == (y is None)
                if x is not None:
                    assert [t.token_id for t in x] == [t.token_id for t in y]
                    assert [t.logprob for t in x] == pytest.approx([t.logprob for t in y],
                                                                   abs=1e-5)
        for got, want in zip(pools[key].k + pools[key].v,
                             pools["eager", False].k + pools["eager", False].v):
            assert torch.equal(got == 7.0, want == 7.0)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # another GEMM's rounding


def test_padding_that_its_table_cannot_hold_is_left_out(tiny_model):
    """Tables of 2 blocks of 4 tokens, rows over a shared first block (later prefills
    attend to cached blocks through their tables): a padding row longer than a table holds
    is left out (the prefill runs unpadded; from the fixed tensors: eagerly), and the tokens
    equal the unpadded runner's."""
    rng = random.Random(3)
    prefix = [5, 6, 7, 8]
    prompts = [prefix + [rng.randrange(3, 128) for _ in range(rng.randint(1, 3))]
               for _ in range(120)]
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * len(prompts)
    outs = []
    for mode, pad in (("eager", False), ("eager", True), ("static", None)):
        pool = make_pool(tiny_model, 400, block_size=4)
        runner = ContinuousRunner(tiny_model, pool, 40, mode, max_blocks_per_row=2,
                                  pad_prefills=pad)
        got, stats = generate_continuous(tiny_model, prompts, params, (), pool,
                                         max_batch_size=40, runner=runner)
        assert stats.cached_tokens > 0
        outs.append([o.token_ids for o in got])
        assert_free(pool)
    assert outs[0] == outs[1] == outs[2]
