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
