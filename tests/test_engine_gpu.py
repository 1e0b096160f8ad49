"""The engine on a GPU: greedy tokens through the Triton kernels equal the PyTorch
reference path (NANOSERVE_KERNELS=reference) and the dense CPU oracle. Skipped
without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.model.model import build_model
from nanoserve.static.generate import greedy_generate, greedy_generate_batch, pool_for
from nanoserve.weights.weights import load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _both_paths(monkeypatch, model, prompts, new_tokens, eos=()):
    pool = pool_for(model, prompts, new_tokens)
    kernels = greedy_generate_batch(model, prompts, new_tokens, eos, pool)
    with monkeypatch.context() as m:
        m.setenv("NANOSERVE_KERNELS", "reference")
        reference = greedy_generate_batch(model, prompts, new_tokens, eos, pool)
    return kernels, reference


def test_tiny_model_kernels_equal_reference_and_cpu(monkeypatch, tiny_model_dir):
    config, sd = load_checkpoint(tiny_model_dir)
    gpu = build_model(config, sd, torch.float32, "cuda")
    cpu = build_model(config, sd, torch.float32, "cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (1, 15, 16, 17, 40, 77, 3, 128)]
    kernels, reference = _both_paths(monkeypatch, gpu, prompts, 24)
    assert kernels == reference
    assert kernels == [greedy_generate(cpu, p, 24) for p in prompts]


def test_smollm2_kernels_equal_reference(monkeypatch, smollm2_gguf_path):
    from nanoserve.weights.tokenizer import Tokenizer

    config, sd = load_checkpoint(smollm2_gguf_path)
    tok = Tokenizer.from_path(smollm2_gguf_path)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Le chat est assis sur",
             "机器学习是", "Once upon a time,", "SELECT name FROM users WHERE",
             tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}]),
             tok.apply_chat_template([{"role": "user", "content": "Name three colours."}])]
    prompts = [tok.encode(t) for t in texts]
    eos = tuple(tok.eos_token_ids)
    model = build_model(config, sd, torch.float32, "cuda")
    kernels, reference = _both_paths(monkeypatch, model, prompts, 32, eos)
    assert kernels == reference
    # bfloat16 runs end to end and mostly agrees with float32 on the first tokens.
    bf16 = build_model(config, sd, torch.bfloat16, "cuda")
    half = greedy_generate_batch(bf16, prompts, 32, eos)
    agree = sum(h[:4] == k[:4] for h, k in zip(half, kernels))
    assert agree >= len(prompts) // 2


def _graph_static_eager(model, prompts, params, eos=(2,)):
    from nanoserve.static.generate import generate_batch

    runs = {}
    for mode in ("graph", "static", "eager"):
        outs, _ = generate_batch(model, prompts, params, eos, decode_step=mode)
        runs[mode] = [(o.token_ids, o.finish_reason) for o in outs]
    return runs


def test_cuda_graph_decode_equals_uncaptured(tiny_model_dir, caplog):
    """The captured step gives the tokens of the same step run uncaptured over the same
    fixed tensors, and (float32) of the plain eager path; no capture fell back."""
    from nanoserve.sampling.params import SamplingParams

    config, sd = load_checkpoint(tiny_model_dir)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (1, 15, 16, 17, 40, 77, 3, 128)]
    greedy = [SamplingParams(max_tokens=m, temperature=0.0) for m in (40, 9, 40, 1, 33, 40, 12, 40)]
    sampled = [SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=i, ignore_eos=True)
               for i in range(len(prompts))]
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(config, sd, dtype, "cuda")
        for params in (greedy, sampled):
            runs = _graph_static_eager(model, prompts, params)
            assert runs["graph"] == runs["static"], dtype
            if dtype == torch.float32:
                assert runs["graph"] == runs["eager"]
    assert "capture" not in caplog.text


def test_cuda_graph_decode_on_a_wide_random_model():
    """A Llama-1B-shaped layer stack (4 layers, random bf16 weights), 48 rows of mixed
    lengths: the captured step equals the uncaptured one token for token."""
    from nanoserve.model.config import ModelConfig
    from nanoserve.sampling.params import SamplingParams

    config = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(0)
    from nanoserve.weights.weights import expected_shapes

    sd = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in expected_shapes(config).items()}
    for name in sd:
        if name.endswith("norm.weight"):
            sd[name] = torch.ones_like(sd[name])
    model = build_model(config, sd, torch.bfloat16, "cuda")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(1, 300))] for _ in range(48)]
    params = [SamplingParams(max_tokens=rng.randint(1, 64), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    runs = _graph_static_eager(model, prompts, params, eos=())
    assert runs["graph"] == runs["static"]
    assert [len(ids) for ids, _ in runs["graph"]] == [p.max_tokens for p in params]


def test_continuous_batching_on_the_gpu_equals_each_row_alone(tiny_model_dir):
    """float32 on the GPU: the continuous scheduler with captured decode steps (one CUDA
    graph per batch-size bucket; rows joining and leaving, a pool small enough to preempt)
    gives each row the tokens the static path gives it alone, and every block back."""
    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.fixed_prefill import prefill_lengths
    from nanoserve.scheduling.model_runner import ContinuousRunner
    from nanoserve.scheduling.scheduler import generate_continuous
    from nanoserve.static.generate import generate_batch

    config, sd = load_checkpoint(tiny_model_dir)
    model = build_model(config, sd, torch.float32, "cuda")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.8 if i % 2 else 0.0,
                             seed=i, ignore_eos=i % 3 == 0) for i in range(24)]
    for num_blocks, max_batch in ((256, 8), (8, 24)):
        pool = KVPool(CacheShape.of(config), num_blocks, 16, torch.float32, "cuda")
        runner = ContinuousRunner(model, pool, max_batch, "graph")
        assert len(runner._graphs) == len(runner.buckets) and not runner._pf_graphs
        assert runner.prefill_tokens == 16 * num_blocks  # what the pool holds
        outs, stats = generate_continuous(model, prompts, params, (2,), pool,
                                          max_batch_size=max_batch, runner=runner)
        # each prefill length met was captured at its first prefill and replayed after
        assert runner._pf_graphs and runner.prefill_replays > 0
        assert {T for T, _ in runner._pf_graphs} <= set(prefill_lengths(runner.prefill_tokens))
        for prompt, p, out in zip(prompts, params, outs):
            (want,), _ = generate_batch(model, [prompt], [p], (2,))
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason)
        assert pool.allocator.num_free == num_blocks
        if num_blocks == 8:
            assert stats.preemptions > 0


def test_prefill_graphs_captured_at_load_give_each_row_its_tokens_alone(tiny_model_dir):
    """`capture_prefills` before any row: every length and kind is captured on padding
    alone (it writes nothing: the pool's blocks all stay free), the run captures nothing
    more, replays them, and each row gets the tokens the static path gives it alone."""
    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.fixed_prefill import prefill_lengths
    from nanoserve.scheduling.model_runner import ContinuousRunner
    from nanoserve.scheduling.scheduler import generate_continuous
    from nanoserve.static.generate import generate_batch

    config, sd = load_checkpoint(tiny_model_dir)
    model = build_model(config, sd, torch.float32, "cuda")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    prompts += [prompts[0][:40] + [7, 8, 9]]  # a prefix-cache hit: the paged kind
    params = [SamplingParams(max_tokens=rng.randint(1, 30), seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    pool = KVPool(CacheShape.of(config), 64, 16, torch.float32, "cuda")
    runner = ContinuousRunner(model, pool, 8, "graph")
    captured = runner.capture_prefills()
    lengths = prefill_lengths(runner.prefill_tokens)
    assert captured == len(runner._pf_graphs) == 2 * len(lengths)
    assert pool.allocator.num_free == 64
    before = dict(runner._pf_graphs)
    outs, _ = generate_continuous(model, prompts, params, (2,), pool, max_batch_size=8,
                                  runner=runner)
    assert runner._pf_graphs == before and runner.prefill_replays > 0
    for prompt, p, out in zip(prompts, params, outs):
        (want,), _ = generate_batch(model, [prompt], [p], (2,))
        assert out.token_ids == want.token_ids


def test_graphs_that_do_not_fit_fall_back_to_uncaptured_steps(tiny_model_dir, caplog):
    """Capture under a memory cap (the allocator's limit set just above what it holds, plus
    a margin: none, one small segment, plenty): where the graphs do not fit, the runner drops
    them with a warning that says how to leave room and runs its steps uncaptured; either
    way each row gets the tokens of the fully captured runner, and every block comes back;
    torch's own warning about the empty graph a failed capture leaves is not shown."""
    import logging
    import warnings

    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.model_runner import ContinuousRunner
    from nanoserve.scheduling.scheduler import generate_continuous

    config, sd = load_checkpoint(tiny_model_dir)
    model = build_model(config, sd, torch.float32, "cuda")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 50))] for _ in range(20)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.7 if i % 2 else 0.0,
                             seed=i) for i in range(20)]
    pool = KVPool(CacheShape.of(config), 256, 16, torch.float32, "cuda")

    def run(runner):
        outs, _ = generate_continuous(model, prompts, params, (2,), pool, max_batch_size=64,
                                      runner=runner)
        assert pool.allocator.num_free == 256
        return [(o.token_ids, o.finish_reason) for o in outs]

    full = ContinuousRunner(model, pool, 64, "graph")
    assert full.capture_error is None and len(full._graphs) == len(full.buckets)
    want = run(full)
    del full
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    fell_back = []
    for margin in (0, 2 << 20, 1 << 30):
        torch.cuda.empty_cache()
        cap = torch.cuda.memory_reserved() + margin
        caplog.clear()
        try:
            torch.cuda.set_per_process_memory_fraction(cap / total)
            with caplog.at_level(logging.WARNING, logger="nanoserve.scheduling.step_graphs"), \
                    warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                runner = ContinuousRunner(model, pool, 64, "graph")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)]
        summary = runner.capture_summary()
        if runner.capture_error is None:
            assert summary["step_mode"] == "graph"
            assert summary["graphs"] == len(runner.buckets)
            assert summary["prefill_graphs"] == 0  # captured as their lengths are met
        else:
            assert summary == {"step_mode": "static", "graphs": 0, "prefill_graphs": 0,
                               "prefill_capture_s": 0.0, "mask_graphs": 0, "graph_mib": 0.0,
                               "capture_s": 0.0, "capture_error": "out of memory"}
            assert "not captured (out of memory" in caplog.text
            assert "kv_cache_fraction" in caplog.text
            fell_back.append(margin)
        assert run(runner) == want, margin
        del runner
    assert 0 in fell_back and (1 << 30) not in fell_back


def test_a_prefill_graph_that_fails_leaves_its_prefills_uncaptured(tiny_model_dir, caplog,
                                                                   monkeypatch):
    """A prefill graph whose capture fails (here the capture raises out of memory, as when
    the memory the KV pool left is short mid-run: a real shortage cannot be made to fall
    on one capture) leaves that length uncaptured with a warning; the other lengths are
    captured and replayed, and every row gets the uncaptured runner's tokens."""
    import logging

    from nanoserve.cache.pool import CacheShape, KVPool
    from nanoserve.sampling.params import SamplingParams
    from nanoserve.scheduling.model_runner import ContinuousRunner
    from nanoserve.scheduling.scheduler import generate_continuous

    config, sd = load_checkpoint(tiny_model_dir)
    model = build_model(config, sd, torch.float32, "cuda")
    rng = random.Random(11)
    # two running rows: each later prefill is one row, of 64 tokens padded (a short prompt)
    # or 128 (a long one), so both lengths come back again and again
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(*(1, 60) if i % 2 else (65, 120)))]
               for i in range(30)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in range(30)]

    def run(mode):  # a pool each: no prefix cache carried from one run to the other
        pool = KVPool(CacheShape.of(config), 256, 16, torch.float32, "cuda")
        runner = ContinuousRunner(model, pool, 2, mode)
        if mode == "graph":
            real = runner._capture

            def capture(fn, *args, **kwargs):
                if fn == runner._prefill_forward and args[0] == 64:
                    raise torch.OutOfMemoryError("CUDA out of memory (in the test)")
                return real(fn, *args, **kwargs)

            monkeypatch.setattr(runner, "_capture", capture)
        outs, _ = generate_continuous(model, prompts, params, (2,), pool, max_batch_size=2,
                                      runner=runner)
        assert pool.allocator.num_free == 256
        return [o.token_ids for o in outs], runner

    want, _ = run("static")
    with caplog.at_level(logging.WARNING, logger="nanoserve.scheduling.step_graphs"):
        got, runner = run("graph")
    assert got == want
    assert (64, False) in runner._pf_failed and (64, False) not in runner._pf_graphs
    assert (128, False) in runner._pf_graphs and runner.prefill_replays > 0
    assert "prefill graph of 64 tokens was not captured (CUDA out of memory" in caplog.text


def test_output_controls_through_captured_continuous_steps(tmp_path):
    """float32 on the GPU: structured outputs (the masked sampling after the captured
    forward), logprobs, prompt logprobs and n samples in one continuous batch whose decode
    steps are CUDA graphs: every row equals itself alone through the static path."""
    from test_output_controls import mixed_controls_equal_rows_alone

    from nanoserve.testing import save_tiny_byte_llama

    mixed_controls_equal_rows_alone("cuda", "graph", save_tiny_byte_llama(tmp_path / "m"))


def test_greedy_constrained_rows_through_the_captured_masked_step(tmp_path):
    """float32 on the GPU: greedy constrained and plain rows in captured continuous steps:
    the masked sampling is its own graph per bucket (captured at its first use), and every
    row equals itself alone through the static path."""
    from test_output_controls import greedy_constrained_equal_rows_alone

    from nanoserve.testing import save_tiny_byte_llama

    runner = greedy_constrained_equal_rows_alone("cuda", "graph",
                                                 save_tiny_byte_llama(tmp_path / "m"))
    assert runner.capture_summary()["mask_graphs"] > 0
