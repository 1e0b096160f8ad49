"""The running-row limit's default and the captured steps' buckets up to it."""

import pytest

from nanoserve.scheduling.model_runner import decode_buckets
from nanoserve.scheduling.running_rows import (
    CPU_DEFAULT_ROWS,
    MAX_DEFAULT_ROWS,
    ROW_TOKENS,
    default_max_rows,
)


@pytest.mark.parametrize("pool_tokens, want", [
    (954_000, 1024),  # an 8B model's bf16 pool on an H200: capped
    (159_424, 288),  # the 70B shape's pool: 311 rows of 512 tokens, down to a multiple of 32
    (10_000, 256),  # a small pool: never below the old fixed default
])
def test_gpu_default_is_what_the_pool_holds_within_bounds(pool_tokens, want):
    assert default_max_rows(pool_tokens, on_gpu=True) == want
    assert want == max(CPU_DEFAULT_ROWS, min(MAX_DEFAULT_ROWS, pool_tokens // ROW_TOKENS // 32 * 32))


def test_cpu_default_is_fixed():
    assert default_max_rows(10**9, on_gpu=False) == CPU_DEFAULT_ROWS == 256


@pytest.mark.parametrize("max_rows", [1, 5, 16, 100, 256, 257, 300, 1000, 1024])
def test_every_row_count_has_a_bucket_and_padding_stays_small(max_rows):
    buckets = decode_buckets(max_rows)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_rows
    for n in range(1, max_rows + 1):
        b = next(x for x in buckets if x >= n)
        # at most 15 padding rows up to 256, 31 above (or up to 2x for 1-8 rows)
        assert b - n <= (n if n <= 8 else 15 if b <= 256 else 31)


def test_llm_on_the_cpu_runs_256_rows_by_default(tiny_job_model):
    from nanoserve.llm import LLM

    llm = LLM(str(tiny_job_model), device="cpu")
    assert llm.max_batch_size == 256 and llm.runner.max_batch_size == 256
    assert LLM(str(tiny_job_model), device="cpu", max_batch_size=7).runner.max_batch_size == 7
