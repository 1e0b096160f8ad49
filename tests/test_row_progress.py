"""Progress row by row: a continuous engine's group says how many of its rows have finished
while it runs, the job's workers report it for the batches they hold, and the driver's
progress bar moves as rows finish inside a batch, with a rate and an estimate of the time
left, not only when a whole batch comes back.

Model: the tiny random Llama with the default model's tokenizer. Rows asking for 1 token
finish at the first step; rows ignoring the end of sequence run to their own max_tokens."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.engine_loop import EngineLoop
from ray_jobs import run_batch_job

LIMIT_S = 300


def test_a_group_tells_its_rows_finished_step_by_step(tiny_job_model):
    """Seen between every two steps (a call on the loop's thread, queued again each time):
    after step k, the k rows asking for at most k tokens have finished, with their tokens."""
    from nanoserve.llm import LLM

    llm = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=8 << 20,
              max_batch_size=8, scheduler="continuous", decode_step="static")
    loop = EngineLoop(llm)
    prompts = [[5, 6, 7, 8 + i] for i in range(4)]
    params = [SamplingParams(max_tokens=k, ignore_eos=True) for k in (3, 1, 4, 2)]
    seen = []
    try:
        future = loop.submit(prompts, params)

        def look():
            seen.append(future.progress())
            if not future.done():
                loop.call(look)

        loop.call(look).result(timeout=LIMIT_S)
        outputs = future.result(timeout=LIMIT_S)
    finally:
        loop.close()
    assert [len(o.token_ids) for o in outputs] == [3, 1, 4, 2]
    steps = [s for s in seen if s != (0, 4, 0)]  # (looks before the group joined: nothing)
    assert steps[:3] == [(1, 4, 1), (2, 4, 1 + 2), (3, 4, 1 + 2 + 3)]
    assert future.progress() == (4, 4, 10)


@pytest.fixture
def bar_text(capsys):
    """Everything written on stderr so far (the bar's lines, `\\r`-separated)."""
    text = []

    def read():
        text.append(capsys.readouterr().err)
        return "".join(text)

    return read


def test_the_bar_moves_as_rows_finish_inside_a_batch(ray_session, tiny_job_model, tmp_path,
                                                     monkeypatch, bar_text):
    """One batch of 6 rows: 4 finish at the first step, 2 run on. The engine is held once 4
    have finished: the bar shows 4/6 with a rate and the time left while the batch is still
    out; then 6/6."""
    rows = [{"prompt": f"Row {i}", "max_tokens": 1} for i in range(4)]
    rows += [{"prompt": f"Long row {i}", "max_tokens": 24, "ignore_eos": True} for i in range(2)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hold = tmp_path / "hold"
    hold.write_text("")
    monkeypatch.setenv("NANOSERVE_FAULT_HOLD_AFTER_ROWS", f"4:{hold}")
    result = {}

    def job():
        result["summary"] = run_batch_job(path, tmp_path / "out", model=str(tiny_job_model),
                                          batch_size=8, kv_cache_bytes=32 << 20,
                                          progress=True)

    thread = threading.Thread(target=job)
    thread.start()
    try:
        deadline = time.monotonic() + LIMIT_S
        while not re.search(r" 4/6 \[", bar_text()):
            assert thread.is_alive(), bar_text()[-3000:]
            assert time.monotonic() < deadline, f"the bar never showed 4/6: {bar_text()[-3000:]}"
            time.sleep(0.1)
        assert (tmp_path / "hold.holding").exists()  # the batch is still out
        assert not list((tmp_path / "out").glob("part-*.parquet"))
    finally:
        hold.unlink()
        thread.join(LIMIT_S)
    assert result["summary"].rows == 6
    text = bar_text()
    shown = [int(n) for n in re.findall(r" (\d)/6 \[", text)]
    assert shown == sorted(shown) and shown[-1] == 6 and 4 in shown
    at_four = re.search(r" 4/6 \[(\d\d:\d\d)<(\S+), ([^\]]*)\]", text)
    assert re.fullmatch(r"\d\d:\d\d", at_four.group(2)), text  # a time left, not '?'
    rate = re.fullmatch(r" *[\d.]+(row/s|s/row), ([\d.]+) out tok/s", at_four.group(3))
    assert rate and float(rate.group(2)) > 0, text  # the finished rows' tokens count at once
