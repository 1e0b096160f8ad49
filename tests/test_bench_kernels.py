"""benchmarks/kernels.py on the CPU: the arguments of `--batch-scale`, its contexts and the
bytes its TB/s counts (the timing itself needs a GPU)."""

import pytest

from benchmarks.kernels import (
    BATCH_SCALE_ROWS,
    BATCH_SCALE_VARIANTS,
    batch_scale_contexts,
    kv_read_bytes,
    parse_args,
)


def test_batch_scale_arguments():
    args = parse_args(["--batch-scale"])
    assert args.batch_scale and args.rows == [256, 656, 1024] == list(BATCH_SCALE_ROWS)
    assert parse_args(["--batch-scale", "--rows", "656"]).rows == [656]
    assert not parse_args([]).batch_scale
    with pytest.raises(SystemExit):
        parse_args(["--batch-scale", "--rows", "8"])  # the error check reads 64 rows
    with pytest.raises(SystemExit):
        parse_args(["--sweep-shapes", "8x"])


def test_batch_scale_compares_the_bf16_cache_and_both_fp8_forms():
    forms = {(cache, extra.get("fp8_form")) for _, cache, extra in BATCH_SCALE_VARIANTS}
    assert {("bf16", None), ("fp8", "e4m3"), ("fp8", "f16")} <= forms
    assert BATCH_SCALE_VARIANTS[0][1] == "bf16"  # the ratios' reference comes first


def test_batch_scale_contexts_are_a_prompt_and_part_of_an_output():
    lens = batch_scale_contexts(4096)
    assert lens == batch_scale_contexts(4096)  # seeded
    assert min(lens) >= 101 and max(lens) <= 1024 + 1023 + 1
    # mean prompt 562, mean part of an output about 281: about 843 tokens
    assert 800 < sum(lens) / len(lens) < 890
    assert len(batch_scale_contexts(656)) == 656


def test_kv_read_bytes_counts_both_caches_of_each_rows_own_context():
    # rows of 3 and 5 tokens, 2 KV heads of 4: (3 + 5) tokens x 2 heads x 4 x (K and V)
    assert kv_read_bytes([3, 5], 2, 4, 2) == 8 * 2 * 4 * 2 * 2
    assert kv_read_bytes([3, 5], 2, 4, 1) * 2 == kv_read_bytes([3, 5], 2, 4, 2)
    # the 8B shape, one layer: a 1,000-token row's bfloat16 K and V, 2 x 1000 x 8 x 128 x 2
    assert kv_read_bytes([1000], 8, 128, 2) == 4_096_000
