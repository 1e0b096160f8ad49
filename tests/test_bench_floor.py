"""benchmarks/floor.py: the serial floor's arithmetic, against sums worked by hand."""

import pytest

from benchmarks.floor import serial_floor


def test_serial_floor_counts_each_decode_step_and_its_contexts():
    # row 0: 1 output token (the prefill's), no decode step; row 1: 3 tokens, steps 1 and 2
    # with contexts 3 + 1 and 3 + 2; row 2: 2 tokens, step 1 with context 5 + 1.
    floor = serial_floor([2, 3, 5], [1, 3, 2], kv_bytes_per_token=10.0,
                         step_gemm_s=lambda rows: 0.5 * rows, read_bytes_per_s=100.0,
                         prefill_s=7.0)
    assert floor.steps == 2
    assert floor.gemm_s == pytest.approx(0.5 * 2 + 0.5 * 1)  # step 1: 2 rows, step 2: 1 row
    assert floor.kv_bytes == pytest.approx((4 + 6 + 5) * 10.0)
    assert floor.kv_s == pytest.approx(150.0 / 100.0)
    assert floor.total_s == pytest.approx(7.0 + 1.5 + 1.5)


def test_serial_floor_of_prefill_only_rows_is_the_prefill():
    floor = serial_floor([4, 4], [1, 1], 1.0, lambda rows: 1.0, 1.0, prefill_s=2.0)
    assert (floor.steps, floor.gemm_s, floor.kv_s, floor.total_s) == (0, 0.0, 0.0, 2.0)


def test_roofline_floor_takes_the_slower_of_the_weights_read_and_the_flops():
    from benchmarks.floor import roofline_floor

    # 1 layer, hidden 4, 2 heads of 2 (1 KV head), intermediate 8, vocabulary 10:
    # q/k/v 8x4, o 4x4, gate/up 16x4, down 4x8 = 144 parameters; LM head 40.
    config = {"hidden_size": 4, "intermediate_size": 8, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 2, "num_hidden_layers": 1, "vocab_size": 10}
    peaks = {"bf16": 1000.0, "fp8": 2000.0}
    # prompts 3 and 4 tokens; outputs 2 and 3: step 1 has 2 rows (contexts 4, 5), step 2 one (6)
    f = roofline_floor(config, "fp8", [3, 4], [2, 3], read_bytes_per_s=100.0, peak_flops=peaks)
    weights_s = (144 * 1 + 40 * 2) / 100.0  # 2.24 s: FP8 projections, bf16 LM head
    flops_2_rows = 2 * 2 * (144 / 2000.0 + 40 / 1000.0)  # 0.448 s
    assert flops_2_rows < weights_s
    assert f.gemm_s == pytest.approx(2 * weights_s)
    assert f.prefill_s == pytest.approx(2 * 144 * 7 / 2000.0)
    assert f.kv_bytes == pytest.approx((4 + 5 + 6) * 1 * 2 * 1 * 2 * 2)  # layers x K,V x heads x d x 2 B
    # with a slow enough peak the FLOPs decide
    slow = roofline_floor(config, "bf16", [3, 4], [2, 3], 100.0, {"bf16": 10.0, "fp8": 10.0})
    assert slow.gemm_s == pytest.approx(2 * 2 * (144 + 40) / 10.0 + 2 * 1 * (144 + 40) / 10.0)


def test_running_set_bounded_by_rows_and_by_the_pool():
    # prompts 2, 3, 5; outputs 3, 2, 2 (2, 1 and 1 decode steps). At most 2 running: rows 0
    # and 1 step once (contexts 3 + 4), row 1 ends, row 2 joins: step 2 reads 4 + 6.
    two = serial_floor([2, 3, 5], [3, 2, 2], 1.0, lambda rows: float(rows), 1.0, 0.0,
                       max_running=2)
    assert (two.steps, two.max_rows, two.kv_bytes, two.gemm_s) == (2, 2, 17.0, 4.0)
    assert two.overlap_decode_s == pytest.approx(7.0 + 10.0)  # K/V reads longer each step
    # A pool of 6 tokens: row 1 (3 + 1) does not fit beside row 0's 3, then 4; rows run alone.
    small = serial_floor([2, 3, 5], [3, 2, 2], 1.0, lambda rows: float(rows), 1.0, 0.0,
                         max_running=2, pool_tokens=6)
    assert (small.steps, small.max_rows, small.kv_bytes) == (4, 1, 3.0 + 4.0 + 4.0 + 6.0)
    # Unbounded, it is the one-batch floor.
    one = serial_floor([2, 3, 5], [3, 2, 2], 1.0, lambda rows: float(rows), 1.0, 0.0)
    assert (one.steps, one.max_rows, one.kv_bytes) == (2, 3, 3.0 + 4.0 + 6.0 + 4.0)


def test_experts_touched_equals_a_routing_simulation():
    """The expected distinct experts of r rows that each pick k of E at random, against a
    count over simulated routings; every expert at a few hundred rows."""
    import random

    from benchmarks.floor import experts_touched

    rng = random.Random(0)
    for rows, experts, k in ((1, 128, 8), (4, 8, 2), (16, 128, 8), (64, 128, 8)):
        trials = [len({e for _ in range(rows) for e in rng.sample(range(experts), k)})
                  for _ in range(2000)]
        assert experts_touched(rows, experts, k) == pytest.approx(sum(trials) / 2000, rel=0.02)
    assert experts_touched(1, 128, 8) == pytest.approx(8)
    assert experts_touched(512, 128, 8) == pytest.approx(128)


def test_moe_roofline_reads_the_experts_touched_and_computes_the_active_ones():
    from benchmarks.floor import moe_roofline_floor

    # 1 layer, hidden 4, 2 heads of 2 (1 KV head): q/k/v 8x4 + o 4x4 = 48 attention
    # parameters; 4 experts of inner 2, each 3 * 4 * 2 = 24 parameters, 2 a token; LM head 40.
    config = {"hidden_size": 4, "moe_intermediate_size": 2, "intermediate_size": 99,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2,
              "num_hidden_layers": 1, "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2}
    peaks = {"bf16": 1000.0, "fp8": 2000.0}
    # one row (prompt 3, output 3): two decode steps of one row, touching 2 experts each
    f = moe_roofline_floor(config, "bf16", [3], [3], read_bytes_per_s=100.0, peak_flops=peaks)
    weights_s = ((48 + 2 * 24) * 2 + 40 * 2) / 100.0
    assert f.gemm_s == pytest.approx(2 * weights_s)
    assert f.prefill_s == pytest.approx(2 * (48 + 2 * 24) * 3 / 1000.0)
    # compute-bound: a tiny bandwidth's opposite, and the FLOPs of the active experts only
    g = moe_roofline_floor(config, "fp8", [3], [2], read_bytes_per_s=1e12, peak_flops=peaks)
    assert g.gemm_s == pytest.approx(2 * 1 * ((48 + 2 * 24) / 2000.0 + 40 / 1000.0))
