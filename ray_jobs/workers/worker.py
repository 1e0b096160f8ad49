"""Stage workers: the batch worker, one `LLM` held for the life of the process, fed whole batches.

`BatchWorker` is a plain class (usable without Ray); the job wraps it as a Ray actor
that runs shards (`ray_jobs.tasks.generate.RayBatchWorker`, `ray_jobs.workers.tasks.ShardWorker`),
one per GPU (`num_gpus=1`) or on the CPU (`num_cpus=1`) where the cluster has no GPUs.
The device is chosen inside the worker: `cuda` when Ray gave it a GPU and torch sees one,
else `cpu` (so logical GPUs on a CPU machine still work, on the CPU).

`run_batch` takes `GenerationRequest`s (token ids, images for a vision-language model, their
`SamplingParams`, and the LoRA adapter each runs under) and returns an
Arrow table in `WORKER_RESULT_SCHEMA` with one row per sample: a request asking for n
samples has n consecutive rows (`sample_index` 0..n-1), whether answered or failed; the
`logprobs` / `prompt_logprobs` columns are null unless the request asked for them. Memory
and bad constraints are handled in three layers, none of which fails the batch:
- a row that cannot fit the worker's KV pool even alone, whose structured output does not
  compile (`LLM.grammars`, compiled once per worker), or that names a LoRA adapter the
  engine was not given, becomes `error` rows at once;
- the other rows go to `LLM.generate`, which cuts them into sub-batches that fit the pool
  and halves a sub-batch the device runs out of memory on (torch.OutOfMemoryError);
- a batch that still fails as a whole is run row by row, so one bad row becomes one
  `error` row.
The table's schema metadata carries the engine's prefill counts (padding waste), its decode
row-steps and those spent on finished rows (early-finish waste), how many device
out-of-memory errors the model's forward raised (`OOM_KEY`), and the engine's counters so
far (`ENGINE_KEY`: how long it was up and busy, its decode steps and their rows), so the
driver can report them and a starved engine shows.

Testing hooks (fault injection; environment variables read by the worker process, which
the driver forwards to its actors; never set them in production):
- `NANOSERVE_FAULT_KILL_ON_TEXT=<marker>`: the worker SIGKILLs its own process, a moment
  into the batch, when a row's prompt, decoded, contains the marker (a "poison row");
- `NANOSERVE_FAULT_OOM_ABOVE_ROWS=<n>`: the model's forward raises torch.OutOfMemoryError
  on inputs of more than n rows (0: on every input);
- `NANOSERVE_FAULT_LOAD=raise|exit`: loading the model raises a ModelError (a load that
  fails: the job stops), or the process exits (a worker that dies while loading: it is
  replaced);
- `NANOSERVE_FAULT_HOLD_LOAD_WHILE_FILE=<path>`: `BatchWorker.__init__` waits, before it
  loads anything, for as long as that file exists; as it starts waiting it appends a line
  `<pid> <Ray node id>` to `<path>.holding` (a test SIGKILLs that process, or removes that
  node, certainly while the worker loads, then deletes the file);
- `NANOSERVE_FAULT_HOLD_WHILE_FILE=<path>`: a batch waits before it starts for as long as
  that file exists (a test holds shards in flight, e.g. while it removes or adds a node,
  then deletes the file; the workers of a one-machine test cluster share the file system);
- `NANOSERVE_FAULT_HOLD_AFTER_ROWS=<k>:<path>`: a continuous engine's call stops between two
  steps once k of its rows have finished, appends `<pid>` to `<path>.holding` and waits while
  that file exists (a test sees the rows finished so far, e.g. on the progress bar).

Progress: `rows_finished(thread)` tells how far the engine call a thread of the actor waits
on is (a continuous engine's rows finish one by one inside a batch), which the job's actor
reports to the driver between answers (`ray_jobs.workers.tasks.ShardWorker.progress`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from nanoserve import ENGINE, ModelError, NanoserveError, SamplingParams
from ray_jobs.preparation.lora_column import unknown_adapter
from ray_jobs.preparation.result_columns import WORKER_RESULT_SCHEMA

PREFILL_SLOTS_KEY = b"nanoserve.prefill_slots"  # rows x longest prompt, summed over sub-batches
PREFILL_TOKENS_KEY = b"nanoserve.prefill_real_tokens"
OOM_KEY = b"nanoserve.device_oom_errors"  # torch.OutOfMemoryError raised while running the batch
DECODE_ROW_STEPS_KEY = b"nanoserve.decode_row_steps"  # rows x decode steps, summed
FINISHED_ROW_STEPS_KEY = b"nanoserve.finished_row_steps"  # of those, spent on finished rows
# Prompt tokens served from the prefix cache; present only when the engine has one.
PROMPT_TOKENS_CACHED_KEY = b"nanoserve.prompt_tokens_cached"
ENGINE_KEY = b"nanoserve.engine"  # JSON: `BatchWorker.engine_counters()` at the answer

FAULT_ENV_PREFIX = "NANOSERVE_FAULT_"
FAULT_KILL_ON_TEXT = "NANOSERVE_FAULT_KILL_ON_TEXT"
FAULT_OOM_ABOVE_ROWS = "NANOSERVE_FAULT_OOM_ABOVE_ROWS"
FAULT_LOAD = "NANOSERVE_FAULT_LOAD"
FAULT_HOLD_WHILE_FILE = "NANOSERVE_FAULT_HOLD_WHILE_FILE"
FAULT_HOLD_LOAD_WHILE_FILE = "NANOSERVE_FAULT_HOLD_LOAD_WHILE_FILE"
FAULT_HOLD_AFTER_ROWS = "NANOSERVE_FAULT_HOLD_AFTER_ROWS"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]  # each image's placeholder already its token count long
    params: SamplingParams
    images: tuple[Any, ...] = ()  # `nanoserve.multimodal.image_input.ImageInput`s, in placeholder order
    lora: str | None = None  # the LoRA adapter it runs under, by name (None: the base model)

    def prompt(self) -> Any:
        """What the engine takes: the token ids, or a `MultimodalPrompt` with the images."""
        if not self.images:
            return list(self.prompt_token_ids)
        from nanoserve import MultimodalPrompt

        return MultimodalPrompt(list(self.prompt_token_ids), self.images)


def ray_gpu_ids() -> list:
    """The GPU ids Ray assigned to this process ([] outside Ray or without GPUs)."""
    try:
        import ray
    except ImportError:
        return []
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


def pick_device() -> str:
    import torch

    return "cuda" if ray_gpu_ids() and torch.cuda.is_available() else "cpu"


class BatchWorker:
    def __init__(self, model: str, dtype: str = ENGINE["dtype"].default,
                 kv_cache_fraction: float = ENGINE["kv_cache_fraction"].default,
                 device: str | None = None, num_threads: int | None = None,
                 kv_cache_bytes: int | None = ENGINE["kv_cache_bytes"].default,
                 scheduler: str = ENGINE["scheduler"].default,
                 prefix_caching: bool = ENGINE["prefix_caching"].default,
                 quantization: str | None = ENGINE["quantization"].default,
                 kv_cache_dtype: str = ENGINE["kv_cache_dtype"].default,
                 max_batch_size: int | None = ENGINE["max_running_rows"].default,
                 reasoning_parser: str | None = ENGINE["reasoning_parser"].default,
                 lora: tuple[str, ...] = ENGINE["lora"].default) -> None:
        """Load the model once. `device` None picks one (see the module docstring);
        `num_threads` caps torch's CPU threads (at most the machine's cores);
        `kv_cache_bytes` sizes the KV pool exactly (else `kv_cache_fraction` of a GPU's free
        memory, or the engine's CPU default); `scheduler`: the engine's batching, "static"
        or "continuous" (see `nanoserve.llm.LLM`); `quantization`: "fp8" or None (see there);
        `max_batch_size`: the most rows the engine decodes at once (None: its default);
        `reasoning_parser`: the engine's (thinking budgets, constraints after the think
        block); `lora`: the engine's LoRA adapters, "NAME=PATH" (a request names one)."""
        _fault_hold_load_while_file()
        t0 = time.perf_counter()
        import torch  # noqa: F401  (timed: the worker's imports)

        from nanoserve import LLM

        imports_s = time.perf_counter() - t0
        _fault_on_load()
        llm = LLM(model=model, dtype=dtype, device=device or pick_device(),
                  kv_cache_fraction=kv_cache_fraction, kv_cache_bytes=kv_cache_bytes,
                  scheduler=scheduler, enable_prefix_caching=prefix_caching,
                  quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                  max_batch_size=max_batch_size, reasoning_parser=reasoning_parser,
                  num_threads=num_threads, **({"lora": lora} if lora else {}))
        self._attach(llm)
        self.load_timings = {"imports_s": imports_s, **getattr(llm, "load_timings", {})}

    @classmethod
    def from_llm(cls, llm: Any) -> BatchWorker:
        """A worker around an already loaded `LLM`."""
        worker = cls.__new__(cls)
        worker._attach(llm)
        return worker

    def _attach(self, llm: Any) -> None:
        self.llm = llm
        self.load_timings: dict[str, float] = {}
        self._ready = time.perf_counter()
        self._static_busy_s = 0.0  # static engine: seconds inside `LLM.generate`
        self._static_steps = [0, 0]  # static engine: decode steps, rows in them
        self._ooms = _watch_model(llm.model)
        # Continuous scheduler: one running batch across calls (the actor holds several
        # shards at once, a batch each, and a later one's rows join as earlier ones finish). Static: one call at a
        # time on the engine.
        self._loop = llm.start_loop() if getattr(llm, "runner", None) is not None else None
        self._engine_lock = threading.Lock()
        self._running: dict[int, tuple[Any, int]] = {}  # by calling thread: (future, prompts)

    @property
    def oom_errors(self) -> int:
        """torch.OutOfMemoryError raised by the model's forward, over the model's life."""
        return self._ooms[0]

    def engine_counters(self) -> dict[str, float]:
        """Since the engine was ready: `up_s`, `busy_s` (of which it had rows to run),
        `decode_steps` and `decode_row_steps` (rows a step = their ratio), `preemptions`,
        and `max_rows`, the most rows it runs at once."""
        if self._loop is not None:
            counters = self._loop.counters()
        else:
            counters = {"up_s": time.perf_counter() - self._ready, "busy_s": self._static_busy_s,
                        "decode_steps": self._static_steps[0],
                        "decode_row_steps": self._static_steps[1], "preemptions": 0}
        return {**counters, "max_rows": getattr(self.llm, "max_batch_size", 0)}

    def info(self) -> dict[str, Any]:
        """Where this worker runs: Ray's GPU ids, the torch device, the host and process,
        the KV pool's size in blocks, the engine's scheduler, the most rows it runs at once,
        (continuous) how its decode steps run (`ContinuousRunner.capture_summary`), and how
        long each part of its start took (`load_s`: imports, weights, KV pool, ...)."""
        runner = getattr(self.llm, "runner", None)
        return {"gpu_ids": ray_gpu_ids(), "device": str(self.llm.device),
                "host": socket.gethostname(), "pid": os.getpid(),
                "kv_blocks": self.llm.pool.num_blocks, "block_size": self.llm.pool.block_size,
                "scheduler": getattr(self.llm, "scheduler", "static"),
                "max_rows": getattr(self.llm, "max_batch_size", None),
                "steps": runner.capture_summary() if runner is not None else None,
                "load_s": {k: round(v, 3) for k, v in self.load_timings.items()}}

    def gpu_ids(self) -> list:
        return ray_gpu_ids()

    def rows_finished(self, thread_id: int) -> tuple[int, int] | None:
        """How far the engine call that thread `thread_id` waits on is, as (its rows
        finished, their output tokens): a row asking for n samples counts once its share of
        the batch's finished samples says so. None when that thread waits on no call whose
        progress shows (a static engine's: its rows come back together)."""
        running = self._running.get(thread_id)
        if running is None:
            return None
        future, prompts = running
        finished, size, tokens = future.progress()
        return (finished * prompts // size if size else 0), tokens

    def run_batch(self, batch_rows: list[GenerationRequest]) -> pa.Table:
        _fault_hold_while_file()
        _fault_kill_on_text(self.llm.tokenizer, batch_rows)
        ooms = [0]  # device out-of-memory errors raised while running this batch
        # Per request, its samples' rows.
        results: list[list[dict[str, Any]] | None] = [self._cannot_run(r) for r in batch_rows]
        todo = [i for i, res in enumerate(results) if res is None]
        prompts = [batch_rows[i].prompt() for i in todo]
        params = [batch_rows[i].params for i in todo]
        lora = [batch_rows[i].lora for i in todo]
        stats = []
        try:
            if todo:
                per_request, st = self._generate_rows(prompts, params, ooms, lora=lora)
                stats.append(st)
                for i, rows in zip(todo, per_request, strict=True):
                    results[i] = rows
        except (NanoserveError, ValueError, RuntimeError):  # torch.OutOfMemoryError included
            for i, p, sp, name in zip(todo, prompts, params, lora):
                results[i], st = self._run_alone(p, sp, ooms, name)
                stats.append(st)
        table = pa.Table.from_pylist([row for rows in results for row in rows],
                                     schema=WORKER_RESULT_SCHEMA)
        slots = sum(getattr(s, "prefill_slots", 0) for s in stats if s is not None)
        real = sum(getattr(s, "prefill_real_tokens", 0) for s in stats if s is not None)
        steps = sum(getattr(s, "decode_row_steps", 0) for s in stats if s is not None)
        idle = sum(getattr(s, "finished_row_steps", 0) for s in stats if s is not None)
        meta = {
            PREFILL_SLOTS_KEY: str(slots).encode(), PREFILL_TOKENS_KEY: str(real).encode(),
            OOM_KEY: str(ooms[0]).encode(),
            DECODE_ROW_STEPS_KEY: str(steps).encode(), FINISHED_ROW_STEPS_KEY: str(idle).encode(),
            ENGINE_KEY: json.dumps(self.engine_counters()).encode()}
        if getattr(self.llm, "enable_prefix_caching", False):
            cached = sum(getattr(s, "cached_tokens", 0) for s in stats if s is not None)
            meta[PROMPT_TOKENS_CACHED_KEY] = str(cached).encode()
        return table.replace_schema_metadata(meta)

    def _generate_rows(self, prompts: list[list[int]], params: list[SamplingParams],
                       ooms: list[int], alone: bool = False, lora: list | None = None
                       ) -> tuple[list[list[dict[str, Any]]], Any]:
        """Result rows per request (`_generate`'s completions): a request that asks for
        choice scores runs as one scoring sequence per label and gives one row, its text
        the most likely label (`LLM.score_labels`, the base model). lora: each request's
        adapter (None: the base model)."""
        lora = lora or [None] * len(prompts)
        # a label list that is bad or does not fit after its prompt: the row's ValueError
        spans = [self.llm.label_token_ids(p.structured_outputs.choice, prompt)
                 if p.choice_scores else None for prompt, p in zip(prompts, params)]
        plain = [k for k, span in enumerate(spans) if span is None]
        done, stats = (self._generate([prompts[k] for k in plain], [params[k] for k in plain],
                                      ooms, alone=alone, lora=[lora[k] for k in plain])
                       if plain else ([], None))
        want = sum(params[k].n for k in plain)
        if len(done) != want:
            raise RuntimeError(f"the engine answered {len(done)} samples for {want} asked")
        scored = [k for k, span in enumerate(spans) if span is not None]
        probs = self._score_labels([prompts[k] for k in scored],
                                   [spans[k] for k in scored]) if scored else []
        probs_of = dict(zip(scored, probs))
        reasoning = getattr(self.llm, "reasoning_parser", None) is not None
        out, at = [], 0
        for k, (prompt, p, span) in enumerate(zip(prompts, params, spans)):
            if span is None:
                out.append([_completion_row(c, reasoning) for c in done[at:at + p.n]])
                at += p.n
            else:
                out.append([_scored_row(p.structured_outputs.choice, span, probs_of[k],
                                        len(prompt), reasoning)])
        return out, stats

    def _score_labels(self, prompts: list[list[int]], spans: list[list[list[int]]]
                      ) -> list[list[float]]:
        """Each scored request's labels' probabilities (`LLM.score_labels`): on the engine
        loop's thread between its steps (continuous), or holding the static engine's turn."""
        def run() -> list[list[float]]:
            return self.llm.score_labels(prompts, spans)

        if self._loop is not None:
            return self._loop.call(run).result()
        with self._engine_lock:
            return run()

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams],
                  ooms: list[int], alone: bool = False, lora: list | None = None
                  ) -> tuple[list[Any], Any]:
        """The engine's completions and prefill counts: through the running batch
        (continuous, packed prefills: no padding; `alone`: by itself, so a failure is its
        own) or one call at a time (static, with the engine's own stats). Adds to `ooms[0]`
        the device out-of-memory errors of this call: the static engine's (it retries
        smaller), or one when the running batch failed with one."""
        if self._loop is not None:
            import torch

            from nanoserve import BatchStats

            adapters = {"lora": lora} if lora and any(lora) else {}  # (by name: the engine's)
            future = self._loop.submit(prompts, params, alone=alone, **adapters)
            me = threading.get_ident()
            self._running[me] = (future, len(prompts))
            _fault_hold_after_rows(self._loop, future)
            try:
                done = future.result()
            except torch.OutOfMemoryError:
                ooms[0] += 1
                raise
            finally:
                self._running.pop(me, None)
            cached = sum(c.num_cached_tokens for c in done if c.sample_index == 0)  # per prompt
            n = sum(len(p) for p in prompts) - cached
            return done, BatchStats(num_rows=len(prompts), prefill_slots=n, prefill_real_tokens=n,
                                    decode_row_steps=sum(len(c.token_ids) - 1 for c in done),
                                    cached_tokens=cached)
        with self._engine_lock:  # the in-flight batches of a static engine take turns
            before = self.oom_errors
            t = time.perf_counter()
            try:
                done = self.llm.generate(prompts, params)
                stats = getattr(self.llm, "last_stats", None)
                if stats is not None:
                    self._static_steps[0] += stats.decode_steps
                    self._static_steps[1] += stats.decode_row_steps
                return done, stats
            finally:
                self._static_busy_s += time.perf_counter() - t
                ooms[0] += self.oom_errors - before

    def _cannot_run(self, r: GenerationRequest) -> list[dict[str, Any]] | None:
        """Error rows (one per sample) for a request that cannot run even alone (empty, no
        room in the model's context, a structured output that does not compile, more than
        the KV pool holds), else None: such a row never fails the rest of its batch. (The
        step count is the engine's `token_budget`, as `LLM.generate` counts it. The static
        engine runs a request's samples in one batch, so they must fit the pool together;
        the continuous one can run them one by one.)"""
        n = len(r.prompt_token_ids)
        samples = r.params.n
        if n == 0:
            return error_rows("empty prompt: a row needs at least one token", 0, samples)
        if r.images and self._loop is None:
            return error_rows("a prompt with images runs on the continuous scheduler only "
                              "(scheduler 'auto' or 'continuous')", n, samples)
        if r.images and r.params.choice_scores:
            return error_rows("choice scores are computed for prompts without images only",
                              n, samples)
        if (why := unknown_adapter(r.lora, getattr(self.llm, "lora_names", ()))) is not None:
            return error_rows(why, n, samples)
        if r.lora is not None and r.params.choice_scores:
            return error_rows("choice scores are computed on the base model only (this row "
                              f"names LoRA adapter {r.lora!r})", n, samples)
        together = samples if self._loop is None else 1
        try:  # the step count first: a prompt that fills the context is refused here
            fit = self.llm.row_fit(r.prompt_token_ids, r.params, together)
        except ValueError as e:
            return error_rows(str(e), n, samples)
        if r.params.structured_outputs is not None:
            try:
                self.llm.grammars.check(r.params.structured_outputs)
            except ValueError as e:
                return error_rows(str(e), n, samples)
        if fit.fits:
            return None
        what = f"{samples} samples of {n} prompt tokens" if together > 1 else f"{n} prompt tokens"
        return error_rows(
            f"does not fit the worker's KV cache even alone: {what} + {fit.steps} new "
            f"need {fit.blocks} blocks of {fit.block_size} tokens, the cache holds "
            f"{fit.pool_blocks}; give the cache more memory or ask for fewer tokens", n, samples)

    def _run_alone(self, prompt: list[int], params: SamplingParams,
                   ooms: list[int], lora: str | None = None) -> tuple[list[dict[str, Any]], Any]:
        import torch

        try:
            (rows,), stats = self._generate_rows([prompt], [params], ooms, alone=True,
                                                 lora=[lora])
            return rows, stats
        except torch.OutOfMemoryError as e:
            return error_rows(f"the device ran out of memory even for this row alone: "
                              f"{_first_line(str(e))}", len(prompt), params.n), None
        except (NanoserveError, ValueError, RuntimeError) as e:
            return error_rows(f"generation failed: {type(e).__name__}: {e}", len(prompt),
                              params.n), None


def _watch_model(model: Any) -> list[int]:
    """Count the torch.OutOfMemoryError the model's forward raises (`LLM.generate` answers
    each by halving its batch); returns the one-item counter. The wrappers sit on this
    model instance only, installed once; the `NANOSERVE_FAULT_OOM_ABOVE_ROWS` hook lives in
    the same place."""
    import torch

    counter = model.__dict__.get("_nanoserve_oom_errors")
    if counter is not None:
        return counter
    counter = [0]
    object.__setattr__(model, "_nanoserve_oom_errors", counter)
    limit = os.environ.get(FAULT_OOM_ABOVE_ROWS)
    for name in ("hidden_states", "compute_logits"):
        method = getattr(model, name)

        @functools.wraps(method)
        def watched(first: torch.Tensor, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            try:
                if limit is not None and first.shape[0] > int(limit):  # rows: dim 0
                    raise torch.OutOfMemoryError(
                        f"{FAULT_OOM_ABOVE_ROWS}={limit}: injected on {first.shape[0]} rows")
                return _method(first, *args, **kwargs)
            except torch.OutOfMemoryError:
                counter[0] += 1
                raise

        object.__setattr__(model, name, watched)
    return counter


def _fault_on_load() -> None:
    how = os.environ.get(FAULT_LOAD)
    if how == "raise":
        raise ModelError(f"{FAULT_LOAD}=raise: the model could not be loaded on this worker")
    if how == "exit":
        os._exit(3)


def _fault_hold_load_while_file() -> None:
    path = os.environ.get(FAULT_HOLD_LOAD_WHILE_FILE)
    if not path or not os.path.exists(path):
        return
    node = "-"
    try:
        import ray

        if ray.is_initialized():
            node = ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    with open(f"{path}.holding", "a") as f:  # one short write: lines of processes never mix
        f.write(f"{os.getpid()} {node}\n")
    while os.path.exists(path):
        time.sleep(0.05)


def _fault_kill_on_text(tokenizer: Any, rows: list[GenerationRequest]) -> None:
    marker = os.environ.get(FAULT_KILL_ON_TEXT)
    if marker and any(marker in tokenizer.decode(list(r.prompt_token_ids)) for r in rows):
        time.sleep(0.2)  # as a crash in the middle of generation would
        os.kill(os.getpid(), signal.SIGKILL)


def _fault_hold_after_rows(loop: Any, future: Any) -> None:
    """`NANOSERVE_FAULT_HOLD_AFTER_ROWS=<k>:<path>`: once k rows of this engine call have
    finished, the engine's loop appends `<pid>` to `<path>.holding` and waits, between two
    steps, while `<path>` exists (the call's other rows stay unfinished meanwhile)."""
    spec = os.environ.get(FAULT_HOLD_AFTER_ROWS)
    if not spec:
        return
    k, _, path = spec.partition(":")

    def check() -> None:  # on the loop's thread, between two steps
        if future.done():
            return
        if future.progress()[0] < int(k):
            loop.call(check)  # again after the next step
            return
        if os.path.exists(path):
            with open(f"{path}.holding", "a") as f:
                f.write(f"{os.getpid()}\n")
        while os.path.exists(path):
            time.sleep(0.05)

    loop.call(check)


def _fault_hold_while_file() -> None:
    path = os.environ.get(FAULT_HOLD_WHILE_FILE)
    while path and os.path.exists(path):
        time.sleep(0.05)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else text


def _scored_row(labels: tuple[str, ...], label_ids: list[list[int]], probs: list[float],
                num_input_tokens: int, reasoning: bool = False) -> dict[str, Any]:
    """A choice-scores request as one result row: `choice_scores` {label: probability},
    its text and tokens the most likely label's (the first of equals); under a reasoning
    parser no think block (a label is scored right after the prompt)."""
    best = max(range(len(probs)), key=lambda j: probs[j])
    return {"generated_text": labels[best], "generated_token_ids": list(label_ids[best]),
            "num_input_tokens": num_input_tokens, "num_generated_tokens": len(label_ids[best]),
            "finish_reason": "stop", "error": None, "sample_index": 0, "logprobs": None,
            "prompt_logprobs": None, "choice_scores": list(zip(labels, probs)),
            **({"reasoning": None, "num_reasoning_tokens": 0} if reasoning else {})}


def _completion_row(c: Any, reasoning: bool = False) -> dict[str, Any]:
    """A completion as a result row (`WORKER_RESULT_SCHEMA`). A sample the engine ended with
    finish_reason 'error' (its structured output allowed no next token) is an error row.
    `reasoning`: the engine ran a reasoning parser, which split the completion (its `text`
    the answer): its think block's text and tokens go in `reasoning` and
    `num_reasoning_tokens` (else both stay null)."""
    if c.finish_reason == "error":
        return error_row(c.error or "generation failed", c.num_prompt_tokens, c.sample_index)
    return {"generated_text": c.text, "generated_token_ids": list(c.token_ids),
            "num_input_tokens": c.num_prompt_tokens, "num_generated_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason, "error": None,
            "sample_index": c.sample_index,
            "logprobs": _logprob_dicts(c.logprobs),
            "prompt_logprobs": _logprob_dicts(c.prompt_logprobs), "choice_scores": None,
            **({"reasoning": c.reasoning, "num_reasoning_tokens": c.num_reasoning_tokens}
               if reasoning else {})}


def _logprob_dicts(entries: list[Any] | None) -> list[dict[str, Any]] | None:
    if entries is None:
        return None
    return entries.as_dicts() if hasattr(entries, "as_dicts") else [e.as_dict() for e in entries]


def error_row(message: str, num_input_tokens: int = 0, sample_index: int = 0) -> dict[str, Any]:
    """A failed sample's result row: no text or tokens, `finish_reason` 'error'."""
    return {"generated_text": None, "generated_token_ids": None,
            "num_input_tokens": num_input_tokens, "num_generated_tokens": 0,
            "finish_reason": "error", "error": message, "sample_index": sample_index,
            "logprobs": None, "prompt_logprobs": None, "choice_scores": None}


def error_rows(message: str, num_input_tokens: int = 0, n: int = 1) -> list[dict[str, Any]]:
    """A request that failed as a whole: one error row per sample (0..n-1)."""
    return [error_row(message, num_input_tokens, i) for i in range(n)]
