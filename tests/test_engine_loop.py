"""nanoserve.scheduling.engine_loop: one continuous batch across callers (what keeps a batch worker
full between the driver's batches), and the batch worker over it.

Oracle: each row run alone through the static path (`generate_batch` with one row).
"""

from __future__ import annotations

import threading

import pytest

from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduling.engine_loop import EngineLoop
from nanoserve.static.generate import generate_batch


@pytest.fixture(scope="module")
def cont_llm(tiny_job_model):
    from nanoserve.llm import LLM

    return LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=8 << 20,
               max_batch_size=8, scheduler="continuous", decode_step="static")


def rows(n, seed):
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(2, 30))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(2, 12), temperature=rng.choice((0.0, 0.8)),
                             seed=seed * 100 + i, ignore_eos=True) for i in range(n)]
    return prompts, params


def alone(llm, prompt, p):
    (out,), _ = generate_batch(llm.model, [prompt], [p], llm.eos_token_ids)
    return out.token_ids


def test_a_second_group_joins_the_running_batch(cont_llm):
    """Two groups submitted back to back: some decode step runs rows of both (the second
    group's rows joined as the first's finished), and every row equals itself alone."""
    steps: list[set[int]] = []
    loop = EngineLoop(cont_llm)
    original = loop.sched.runner.decode

    def watch(slots, *args, **kwargs):
        steps.append({id(r.group) for r in loop.sched.running if r.slot in slots})
        return original(slots, *args, **kwargs)

    cont_llm.runner.decode = watch
    try:
        (p1, s1), (p2, s2) = rows(6, 1), rows(6, 2)
        f1 = loop.submit(p1, s1)
        f2 = loop.submit(p2, s2)
        got1, got2 = f1.result(timeout=300), f2.result(timeout=300)
    finally:
        del cont_llm.runner.decode
        loop.close()
    assert any(len(groups) == 2 for groups in steps)
    for prompts, params, got in ((p1, s1, got1), (p2, s2, got2)):
        assert [o.token_ids for o in got] == [alone(cont_llm, p, s) for p, s in zip(prompts, params)]
    assert cont_llm.pool.allocator.num_free == cont_llm.pool.num_blocks


def test_a_failing_step_fails_the_groups_in_it_and_the_loop_goes_on(cont_llm, monkeypatch):
    loop = EngineLoop(cont_llm)
    calls = []
    original = type(cont_llm.model).hidden_states

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device fell over")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(cont_llm.model), "hidden_states", failing)
    try:
        prompts, params = rows(4, 3)
        with pytest.raises(RuntimeError, match="fell over"):
            loop.submit(prompts, params).result(timeout=300)
        assert cont_llm.pool.allocator.num_free == cont_llm.pool.num_blocks
        got = loop.submit(prompts, params, alone=True).result(timeout=300)
    finally:
        loop.close()
    assert [o.token_ids for o in got] == [alone(cont_llm, p, s) for p, s in zip(prompts, params)]


def test_batch_worker_runs_two_batches_at_once(cont_llm):
    """The actor's two in-flight batches, as two threads calling `run_batch`: each table
    equals its rows alone, in order."""
    from ray_jobs.workers.worker import BatchWorker, GenerationRequest

    worker = BatchWorker.from_llm(cont_llm)
    batches = [rows(5, 4), rows(7, 5)]
    tables: dict[int, object] = {}

    def run(i):
        prompts, params = batches[i]
        tables[i] = worker.run_batch([GenerationRequest(tuple(p), s)
                                      for p, s in zip(prompts, params)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    worker._loop.close()
    for i, (prompts, params) in enumerate(batches):
        got = tables[i].column("generated_token_ids").to_pylist()
        assert got == [alone(cont_llm, p, s) for p, s in zip(prompts, params)]


def test_max_batch_size_caps_the_rows_a_step_decodes(tiny_job_model):
    """LLM(max_batch_size=3) over 7 rows: no decode step carries more than 3 rows, some
    carry 3, every row equals itself alone; 0, -1, 2.5 and True are refused before loading."""
    from nanoserve.errors import NanoserveError
    from nanoserve.llm import LLM

    for bad in (0, -1, 2.5, True):
        with pytest.raises(NanoserveError, match=r"max_batch_size .* must be an int >= 1"):
            LLM(model="/nonexistent/model", device="cpu", max_batch_size=bad)
    llm = LLM(model=str(tiny_job_model), device="cpu", kv_cache_bytes=8 << 20,
              max_batch_size=3, scheduler="continuous", decode_step="static")
    sizes: list[int] = []
    original = llm.runner.decode

    def watch(slots, *args, **kwargs):
        sizes.append(len(slots))
        return original(slots, *args, **kwargs)

    llm.runner.decode = watch
    prompts, params = rows(7, 5)
    try:
        outs = llm.generate(prompts, params)
    finally:
        del llm.runner.decode
    assert max(sizes) == 3, sizes
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == alone(llm, prompt, p)


def test_generate_flag_max_running_rows(tiny_job_model, capsys):
    """`nanoserve generate --max-running-rows`: below 1 refused in one line (exit 2); 1 runs
    two prompts one at a time to the same texts as the default."""
    from nanoserve_cli import main as nanoserve_main

    assert nanoserve_main(["generate", "--max-running-rows", "0", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --max-running-rows must be an int >= 1, got 0"], err
    texts = []
    for extra in ([], ["--max-running-rows", "1"]):
        rc = nanoserve_main(["generate", "--model", str(tiny_job_model), "--device", "cpu",
                             "--max-tokens", "6", *extra, "one two", "three four five"])
        assert rc == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
