"""The decode step over fixed tensors (what a CUDA graph replays), held to the plain
decode path on the CPU: the same tokens, the same finish reasons, every block returned.
The captured graph itself is held to the same oracle in tests/test_engine_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.cache.pool import BatchedPagedKVCache, CacheShape, KVPool
from nanoserve.model.attention import AttentionMetadata
from nanoserve.sampling.params import SamplingParams
from nanoserve.static.cuda_graph import DecodeStep, graphs_wanted, make_decode_step
from nanoserve.static.generate import generate_batch, pool_for


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(n)] for n in lengths]


def _run(model, prompts, params, mode, pool=None, eos=(2,)):
    outs, stats = generate_batch(model, prompts, params, eos, pool, decode_step=mode)
    return [(o.token_ids, o.finish_reason) for o in outs], stats


@pytest.mark.parametrize("block_size", [16, 4])
def test_static_step_equals_eager_greedy(tiny_model, block_size):
    # Mixed lengths: 1, a block multiple, one past it; rows stop at EOS or at their caps.
    prompts = _prompts(0, (1, 15, 16, 17, 40, 3))
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (30, 7, 30, 1, 19, 30)]
    pool = pool_for(tiny_model, prompts, 30, block_size)
    eager, eager_stats = _run(tiny_model, prompts, params, "eager", pool)
    assert pool.allocator.num_free == pool.num_blocks
    static, static_stats = _run(tiny_model, prompts, params, "static", pool)
    assert static == eager
    assert pool.allocator.num_free == pool.num_blocks  # every block returned
    assert static_stats == eager_stats


def test_static_step_equals_eager_sampled(tiny_model):
    prompts = _prompts(1, (5, 33, 12, 64))
    params = [SamplingParams(max_tokens=20, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in ((0.8, 0, 1.0, 1), (1.2, 5, 1.0, 2), (0.0, 0, 1.0, None), (1.0, 0, 0.7, 3))]
    eager, _ = _run(tiny_model, prompts, params, "eager")
    static, _ = _run(tiny_model, prompts, params, "static")
    assert static == eager


def test_static_step_on_exact_fit_pool(tiny_model):
    # The pool holds exactly the batch's peak: the static tables must not need a block more.
    prompts = _prompts(2, (16, 31, 2))
    params = [SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)] * 3
    pool = pool_for(tiny_model, prompts, 17)
    eager, _ = _run(tiny_model, prompts, params, "eager", pool)
    static, _ = _run(tiny_model, prompts, params, "static", pool)
    assert static == eager
    assert all(len(ids) == 17 for ids, _ in static)


def test_decode_step_refills_inputs_in_place(tiny_model):
    """Each call reserves one slot per row and rewrites the same tensors (no new ones)."""
    config = tiny_model.config
    pool = KVPool(CacheShape.of(config), 16, block_size=4)
    cache = BatchedPagedKVCache(pool, 2)
    prompts = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    valid = torch.tensor([[True, True, True, False], [True] * 4])
    tiny_model.hidden_states(prompts, torch.arange(4).expand(2, 4), cache,
                             AttentionMetadata.prefill(valid))
    step = DecodeStep(tiny_model, cache, max_blocks=3, capture=False)
    tensors = (step.ids, step.positions, cache._write_slots, cache._block_tables, cache._context_lens)
    ptrs = [t.data_ptr() for t in tensors]
    step([20, 21])
    step([22, 23])
    assert [t.data_ptr() for t in tensors] == ptrs
    assert cache.seq_lens == [5, 6]
    assert step.positions[:, 0].tolist() == [4, 5]
    assert cache._context_lens.tolist() == [5, 6]
    assert cache._write_slots.tolist() == [cache.tables[0].slot(4), cache.tables[1].slot(5)]
    assert cache._block_tables[1, :2].tolist() == cache.tables[1].blocks
    cache.check_integrity()
    cache.free_all()
    assert pool.allocator.num_free == pool.num_blocks


def test_static_tensors_guard_their_contract(tiny_model):
    pool = KVPool(CacheShape.of(tiny_model.config), 8, block_size=4)
    cache = BatchedPagedKVCache(pool, 1)
    tiny_model.hidden_states(torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5)[None], cache,
                             AttentionMetadata.prefill(torch.ones(1, 5, dtype=torch.bool)))
    with pytest.raises(ValueError, match="below"):
        cache.use_static_step_tensors(max_blocks=1)  # the row already holds 2 blocks
    cache.use_static_step_tensors(max_blocks=2)
    k = torch.zeros(1, 2, 2, 16)
    with pytest.raises(ValueError, match="decode steps only"):
        cache.write(0, k, k, None)
    cache.begin_decode_step()  # 6 tokens: still 2 blocks
    cache.begin_decode_step()
    cache.begin_decode_step()  # 8 tokens
    with pytest.raises(RuntimeError, match="static block tables hold 2"):
        cache.begin_decode_step()  # a 9th token needs a third block
    cache.free_all()
    assert pool.allocator.num_free == pool.num_blocks


def test_modes_and_the_auto_rule(tiny_model, monkeypatch):
    prompts = _prompts(3, (4,))
    params = [SamplingParams(max_tokens=4)]
    with pytest.raises(ValueError, match="decode_step"):
        generate_batch(tiny_model, prompts, params, decode_step="fast")
    with pytest.raises(ValueError, match="CUDA"):
        generate_batch(tiny_model, prompts, params, decode_step="graph")
    assert not graphs_wanted(torch.device("cpu"), 100)
    with pytest.raises(ValueError, match="decode_step"):
        make_decode_step(tiny_model, None, 1, "fast")
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert graphs_wanted(cuda, 100) and not graphs_wanted(cuda, 2)
        monkeypatch.setenv("NANOSERVE_CUDA_GRAPH", "0")
        assert not graphs_wanted(cuda, 100)


def test_pipelined_greedy_rows_stopping_early_equal_eager(tiny_model):
    """All-greedy batches queue step t+1 before reading step t. Make rows stop at EOS at
    different steps (EOS = tokens they are known to produce) and every row finish well
    before the cap: tokens, finish reasons and waste counts equal the plain loop's, and
    the extra step queued past the end leaks no block."""
    prompts = _prompts(4, (3, 18, 9, 33, 1))
    params = [SamplingParams(max_tokens=40, temperature=0.0)] * len(prompts)
    free_run, _ = _run(tiny_model, prompts, params, "eager", eos=())
    eos = tuple(sorted({ids[k] for (ids, _), k in zip(free_run, (2, 5, 9, 1, 7))}))
    pool = pool_for(tiny_model, prompts, 40)
    eager, eager_stats = _run(tiny_model, prompts, params, "eager", pool, eos=eos)
    assert any(reason == "stop" for _, reason in eager)
    static, static_stats = _run(tiny_model, prompts, params, "static", pool, eos=eos)
    assert static == eager and static_stats == eager_stats
    assert pool.allocator.num_free == pool.num_blocks


def test_feedback_step_queues_at_most_two(tiny_model):
    pool = KVPool(CacheShape.of(tiny_model.config), 16, block_size=4)
    cache = BatchedPagedKVCache(pool, 1)
    tiny_model.hidden_states(torch.tensor([[5, 6, 7]]), torch.arange(3)[None], cache,
                             AttentionMetadata.prefill(torch.ones(1, 3, dtype=torch.bool)))
    step = DecodeStep(tiny_model, cache, max_blocks=4, capture=False, feedback=True)
    with pytest.raises(RuntimeError, match="start/launch"):
        step([9])
    step.start([9])
    step.launch()
    step.launch()
    with pytest.raises(RuntimeError, match="third"):
        step.launch()
    first, second = step.read_tokens(), step.read_tokens()
    assert step.unread == 0 and cache.seq_lens == [5]
    # The second step's input was the first step's argmax, at the next position.
    assert step.ids[:, 0].tolist() == second and len(first) == 1
    with pytest.raises(RuntimeError, match="no queued"):
        step.read_tokens()
    cache.free_all()
