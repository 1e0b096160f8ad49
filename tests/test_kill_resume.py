"""A job over one JSONL file on 4 CPU workers through a SIGKILLed worker and a SIGKILLed
driver, then the same command again (`benchmarks/kill_resume.py`, the 1M-row run's script,
at 400 rows in 40 shards): every row in the output once, each equal to `LLM.generate` on
its prompt alone; no part written before the driver's kill written again."""

from __future__ import annotations

import json

import pyarrow.dataset as ds

from benchmarks.kill_resume import run, table
from nanoserve.testing import assert_rows_match_engine


def test_a_worker_and_then_the_driver_killed_and_the_job_run_again(tiny_job_model, tiny_llm,
                                                                   tmp_path):
    result = run(rows=400, workers=4, batch_size=10, model=str(tiny_job_model), work=tmp_path)
    assert result.replaced, "the first run did not replace the killed worker"
    assert result.parts_at_worker_kill < result.parts_at_driver_kill < result.shards
    assert (result.missing, result.repeated, result.rewritten) == (0, 0, 0), table(result)
    assert "done by an earlier run" in result.rerun_log
    prompts = [json.loads(line)["prompt"]
               for line in (tmp_path / "in.jsonl").read_text().splitlines()]
    rows = ds.dataset(tmp_path / "out", format="parquet").to_table().to_pylist()
    assert_rows_match_engine(tiny_llm, prompts, rows, max_tokens=1)
