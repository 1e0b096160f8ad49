"""The batch job's driver: read, tokenize, batch, dispatch to Ray workers, collect, write.

    summary = run_batch_job("prompts.jsonl", "out/", max_tokens=64)

Order of work (every job-level check comes before any model loads on a worker):
1. scan the input (files, schema, row count) and plan its columns;
2. resolve the model and load its tokenizer and config on the driver (cheap: no weights);
3. open the output folder: fresh, or resume an earlier run with equal settings;
4. start (or join) Ray and one `BatchWorker` actor per GPU (one CPU worker without GPUs),
   when the first batch needs a worker (a rerun with nothing left to compute starts none);
5. stream the rows: tokenize a chunk at a time, cut them into batches (`batching`), send
   each batch's token ids to the least-loaded worker (each worker holds as many batches as
   keep its engine full: `ray_jobs.pool.hold_limits`), and write each finished batch as one
   Parquet part at once;
6. when every batch is written, mark the folder complete (`_SUCCESS`).

Memory stays flat: the driver holds one input chunk, one batching window, and the rows of
the batches in flight (a few times each engine's running rows per worker, plus retries); the
manifest records done batch ids, never per-row data. Batches are cut from a window of rows
sorted by prompt length (longest first), so a part holds rows from across its window; within
a part the rows are in input order (a row's samples together, by `sample_index`). For the
whole input's order, sort by `id` when ids are positions, else join on `id`.

A row asking for n samples gives n output rows, keyed on (`id`, `sample_index`), its input
columns repeated: a worker answers one result row per sample, in order, and the driver
regroups them per input row. A row that fails as a whole gives n error rows. Parts, resume
and `--retry-errors` work per batch as before, so every (id, sample_index) is written
exactly once. Counts: `JobSummary.rows` (and the manifest's `rows_done`, the report) count
output rows; `input_rows` and `input_tokens` count each input row once. The summary counts
output rows by `finish_reason` and warns when rows with a structured output ended by length
(their text is cut, so it need not match the constraint).

Nothing lost, nothing duplicated (see `_JobRun` for the bookkeeping):
- a worker that dies is replaced and the batches it held run again; a batch that kills
  its worker every time is cut in halves until the row at fault stands alone, and that
  row alone becomes an `error` row;
- a worker that cannot load the model fails the job with one line; no wait for a worker
  is unbounded (`worker_start_timeout_s`); more workers than the cluster has GPUs (or
  CPUs) are capped, with a warning;
- a driver killed at any moment resumes on rerun: parts on disk are kept (see
  `ray_jobs.manifest`), the rest is computed, each row written exactly once;
- rows too big for a worker's KV pool are split into sub-batches by the engine, or become
  `error` rows when even one alone cannot fit; a device out-of-memory error makes the
  engine halve the batch, and the count is reported.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve.errors import InputError, NanoserveError
from nanoserve.model_store import resolve_model
from ray_jobs import openai_batch
from ray_jobs.batching import Batch, BatchLimits, make_batches
from ray_jobs.io import InputInfo, iter_chunks, scan_input
from ray_jobs.local_ray import RaySession
from ray_jobs.manifest import (
    PART_DIGEST_KEY,
    Manifest,
    adopt_part,
    hold_output_dir,
    input_identity,
    mark_complete,
    model_identity,
    open_output_dir,
    part_name,
    reopen_batches_with_errors,
)
from ray_jobs.options import JobOptions
from ray_jobs.placement import check_output_reachable
from ray_jobs.pool import WorkerPool, WorkerReport, first_line, log
from ray_jobs.prepare import (
    ColumnPlan,
    PreparedRow,
    RowPreparer,
    load_model_meta,
    output_controls,
    plan_columns,
)
from ray_jobs.report import ReportLog, piece_record, report_data, write_report
from ray_jobs.storage import OutputDir, is_uri
from ray_jobs.timeline import PHASES, Timeline
from ray_jobs.worker import (
    ENGINE_KEY,
    OOM_KEY,
    PREFILL_SLOTS_KEY,
    PREFILL_TOKENS_KEY,
    PROMPT_TOKENS_CACHED_KEY,
    GenerationRequest,
    error_rows,
)

MAX_BATCH_ATTEMPTS = 2  # deaths of its worker a batch may cause before it is cut in halves
PREFIX_KEY_TOKENS = 32  # leading prompt tokens that name a piece's prefix for dispatch
DEATH_SETTLE_TIMEOUT_S = 60.0  # wait for the other tasks of a dead actor to end


@dataclass(frozen=True)
class JobSummary:
    """What one run did. Counts cover this run; `rows_resumed` rows were written by earlier
    runs into the same folder."""

    output_dir: str
    rows: int  # output rows written: one per sample of each input row
    error_rows: int
    rows_resumed: int  # output rows
    input_tokens: int
    output_tokens: int
    wall_time_s: float
    output_tokens_per_s: float
    padding_waste: float  # padding / padded prefill rectangle, summed over batches
    num_batches: int
    workers: tuple[WorkerReport, ...] = ()
    worker_restarts: int = 0  # workers that died and were replaced
    device_oom_errors: int = 0  # device out-of-memory errors the engine retried smaller
    # Seconds per phase of this run, in order (see `PHASES`); they add up to wall_time_s.
    # A phase the run never reached (nothing left to compute: no Ray, no worker) is absent.
    timings: dict[str, float] = field(default_factory=dict)
    report: str | None = None  # the run's HTML report (`ray_jobs.report`), when it wrote one
    # Prompt tokens served from the workers' prefix caches / prompt tokens of the batches
    # whose engines have one (None: no engine had one).
    prefix_hit_rate: float | None = None
    nodes_lost: tuple[str, ...] = ()  # e.g. "node 3f2a9c1e07b4 (10.0.0.7, worker 1)"
    input_rows: int | None = None  # input rows answered by this run (None: = rows)
    # Output rows of this run by finish_reason: stop, length and error always, in that order.
    finish_reasons: dict[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # one line each, also printed on stderr by the job
    # "reasoning parser: qwen3 (auto: ...)": which parser split the rows and why (None: the
    # model has no think tags and none was asked for)
    reasoning: str | None = None

    def format(self) -> str:
        samples = (f" for {self.input_rows} input rows"
                   if self.input_rows is not None and self.input_rows != self.rows else "")
        reasons = (", ".join(f"{k} {v}" for k, v in self.finish_reasons.items())
                   if self.finish_reasons else f"{self.error_rows} error rows")
        lines = [
            f"rows: {self.rows}{samples} ({reasons})"
            + (f", {self.rows_resumed} done by an earlier run" if self.rows_resumed else ""),
            f"tokens: {self.input_tokens} input, {self.output_tokens} output",
            f"wall time: {self.wall_time_s:.1f} s, {self.output_tokens_per_s:.1f} output tokens/s",
            f"padding waste: {self.padding_waste:.1%} of the padded prefill",
            *([f"prefix cache: {self.prefix_hit_rate:.1%} of prompt tokens served from it"]
              if self.prefix_hit_rate is not None else []),
            f"batches: {self.num_batches} on {len(self.workers)} worker(s); output: {self.output_dir}",
        ]
        if self.reasoning:
            lines.append(self.reasoning)
        if (busy := busy_line(self.workers)) is not None:
            lines.append(busy)
        if self.worker_restarts or self.device_oom_errors:
            lines.append(f"recovered: {self.worker_restarts} worker restart(s), "
                         f"{self.device_oom_errors} device out-of-memory error(s)")
        if self.report:
            lines.append(f"report: {self.report}")
        if self.nodes_lost:
            lines.append(f"nodes lost: {len(self.nodes_lost)} ({'; '.join(self.nodes_lost)}); "
                         f"their batches ran again on other workers")
        if self.timings:
            lines.append("time: " + ", ".join(f"{PHASES[k]} {v:.1f} s"
                                              for k, v in self.timings.items()))
        lines += self.warnings
        return "\n".join(lines)


def busy_line(workers: tuple[WorkerReport, ...]) -> str | None:
    """How full the workers' engines were: the share of their time up that they had rows,
    and the rows a decode step ran on average against the most they run (None when no
    worker answered with its counters)."""
    up = [w for w in workers if w.busy_fraction is not None]
    if not up:
        return None
    line = f"engines: busy {sum(w.busy_s for w in up) / sum(w.up_s for w in up):.0%} of their time"
    if len(up) > 1:
        line += " (" + ", ".join(f"worker {w.index} {w.busy_fraction:.0%}" for w in up) + ")"
    steps = sum(w.decode_steps for w in up)
    if steps:
        line += (f"; {sum(w.decode_row_steps for w in up) / steps:.0f} rows a decode step on "
                 f"average, of at most {max(w.max_rows for w in up)}")
    return line


def run_batch_job(input: str | Path, output_dir: str | Path, **options: Any) -> JobSummary:
    """Run the batch job of `nanoserve batch INPUT -o OUTPUT_DIR`; see the module docstring.
    Job-level problems raise `NanoserveError` (InputError, ModelError) before any worker
    starts; row-level problems become `error` rows."""
    timeline = Timeline(time.perf_counter())
    opts = JobOptions(**options)
    info = scan_input(input, opts.chunk_rows, opts.id_column, opts.input_format)
    openai_out = openai_batch.wants_openai_output(opts.output_format, info.openai_rows)
    plan = plan_columns(info.schema, opts.prompt_column, opts.id_column)
    limits = BatchLimits(opts.batch_size, opts.max_batch_tokens,
                         opts.window_batches * opts.batch_size)
    model_path = resolve_model(opts.model)
    config, tokenizer = load_model_meta(model_path)
    eos = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids)))
    preparer = RowPreparer(plan, tokenizer, config.max_position_embeddings, config.vocab_size,
                           opts.sampling_defaults(), eos_token_ids=eos,
                           chat_template_kwargs=opts.chat_template_kwargs)
    from nanoserve.reasoning import has_think_tags, resolve_parser

    try:
        reasoning, reasoning_line = resolve_parser(opts.reasoning_parser, config.architecture,
                                                   tokenizer)
    except ValueError as e:
        raise InputError(f"--reasoning-parser: {e}") from None
    if opts.reasoning_parser in (None, "none", "auto") and not has_think_tags(tokenizer):
        reasoning_line = None  # a model that cannot think: nothing to say
    # The workers' engines run the parser picked here (budgets, constraints after thinking).
    opts = dataclasses.replace(opts, reasoning_parser=reasoning.name if reasoning else "none")
    if reasoning is None and (opts.max_thinking_tokens is not None
                              or "max_thinking_tokens" in plan.override_columns):
        raise InputError("--max-thinking-tokens / a 'max_thinking_tokens' column needs a "
                         "reasoning parser (--reasoning-parser qwen3|deepseek_r1)")
    controls = output_controls(plan, opts.sampling_defaults(), reasoning=reasoning is not None)
    plan.output_schema(controls)  # an input column that clashes is refused here
    settings = _job_settings(opts, info, model_path, limits)
    folder = OutputDir.open(output_dir)  # a local folder or an object-store prefix
    if folder.local:  # named as the user gave it (a path, or its file:// URI's path)
        check_output_reachable(folder.path if is_uri(output_dir) else Path(output_dir))
    with ExitStack() as stack:
        stack.enter_context(hold_output_dir(folder))  # one job per output folder at a time
        manifest = open_output_dir(folder, settings, opts.overwrite)
        retry = reopen_batches_with_errors(folder, manifest) if opts.retry_errors else set()
        if retry:
            log(f"nanoserve: --retry-errors: computing again {len(retry)} batch(es) of an "
                f"earlier run that hold error rows")
        if manifest.complete:
            if openai_out and not folder.exists(openai_batch.OUTPUT_NAME):
                openai_batch.write_outputs(folder, iter_chunks(info, opts.chunk_rows), plan,
                                           tokenizer, opts.model, settings)
            timeline.mark("prepare")
            return JobSummary(str(folder), 0, 0, manifest.rows_done, 0, 0,
                              timeline.marks["prepare"], 0.0, 0.0, 0, timings=timeline.timings())

        def start_pool() -> WorkerPool:  # on the first batch that needs a worker
            timeline.mark("prepare")
            stack.enter_context(RaySession(opts.address))
            timeline.mark("ray")
            pool = WorkerPool.start(opts, timeline)
            stack.callback(pool.shutdown)
            timeline.mark("workers")
            return pool

        run = _JobRun(opts, plan, folder, manifest, start_pool, info.num_rows, timeline, retry,
                      controls, reasoning)
        run.execute(make_batches(_prepared_rows(info, preparer, opts.chunk_rows), limits))
        if openai_out:  # output.jsonl / errors.jsonl from the parts, before _SUCCESS
            openai_batch.write_outputs(folder, iter_chunks(info, opts.chunk_rows), plan,
                                       tokenizer, opts.model, settings)
        mark_complete(folder, manifest)
    timeline.mark("shutdown")
    summary = dataclasses.replace(run.summary(timeline.marks["shutdown"]),
                                  reasoning=reasoning_line)
    for warning in summary.warnings:
        log(warning)
    report_settings = {"options": dataclasses.asdict(opts), "model": settings["model"],
                       "input": settings["input"]}
    try:
        path = write_report(folder, report_data(run.report, summary, report_settings,
                                                opts.batch_size))
    except Exception as e:  # the rows are written and recorded: a failed report loses nothing
        log(f"nanoserve: the job report could not be written: {type(e).__name__}: "
            f"{first_line(str(e))}")
        return summary
    return dataclasses.replace(summary, report=str(path))


def _job_settings(opts: JobOptions, info: InputInfo, model_path: Path,
                  limits: BatchLimits) -> dict[str, Any]:
    """What the manifest compares on resume: everything that changes the output rows. The
    output controls appear only when set (`n` above 1, logprobs asked, a job-wide structured
    output), and so does an FP8 KV cache, so the output of a job from before them still
    resumes."""
    sampling = opts.sampling_defaults()
    sampling["stop"] = list(sampling["stop"])
    for key in ("n", "logprobs", "prompt_logprobs", "structured_outputs"):
        value = sampling.pop(key)
        if value is not None and not (key == "n" and value == 1):
            sampling[key] = value
    so = sampling.get("structured_outputs")
    if so is not None:
        sampling["structured_outputs"] = {k: list(v) if k == "choice" else v
                                          for k in ("json", "regex", "choice")
                                          if (v := getattr(so, k)) is not None}
    return {
        "model": {"files": model_identity(model_path), "dtype": opts.dtype,
                  **({"quantization": opts.quantization} if opts.quantization else {}),
                  **({"kv_cache_dtype": opts.kv_cache_dtype}
                     if opts.kv_cache_dtype != "auto" else {})},
        "input": {"files": input_identity(info.root, info.files), "num_rows": info.num_rows},
        "sampling": sampling,
        "batching": {"batch_size": limits.batch_size, "max_batch_tokens": limits.max_batch_tokens,
                     "window_rows": limits.window_rows},
        "columns": {"prompt_column": opts.prompt_column, "id_column": opts.id_column,
                    **({"input_format": opts.input_format}
                       if opts.input_format != "auto" else {}),
                    **({"chat_template_kwargs": opts.chat_template_kwargs}
                       if opts.chat_template_kwargs else {}),
                    **({"reasoning_parser": opts.reasoning_parser}
                       if opts.reasoning_parser not in (None, "none") else {})},
    }


def _prepared_rows(info: InputInfo, preparer: RowPreparer, chunk_rows: int) -> Iterator[PreparedRow]:
    position = 0
    for chunk in iter_chunks(info, chunk_rows):
        yield from preparer.prepare(chunk, position)
        position += chunk.batch.num_rows


@dataclass
class _Pending:
    """A batch sent to the workers whose rows are not all answered yet."""

    batch: Batch
    results: list[list[dict[str, Any]] | None]  # per row, in batch order: one per sample
    left: int  # rows without a result


@dataclass
class _Piece:
    """Rows of one batch that go to a worker together: the whole batch, or, once the batch
    killed its worker MAX_BATCH_ATTEMPTS times, a half of it (then a half of that...).

    A suspect piece was in flight on a worker that died. It runs alone on an idle worker
    (nothing else is sent there until it ends), so if that worker dies, the piece did it."""

    pending: _Pending
    rows: tuple[int, ...]  # indexes into pending.batch.rows
    split: bool = False  # a part of a batch that kept killing its worker
    suspect: bool = False
    deaths: int = 0  # worker deaths blamed on this piece

    def prefix(self) -> tuple[int, ...]:
        """The leading tokens of its first row: pieces that share them go, where loads are
        equal, to the same worker, whose prefix cache then already holds them."""
        return tuple(self.pending.batch.rows[self.rows[0]].prompt_token_ids[:PREFIX_KEY_TOKENS])

    def samples(self) -> int:
        """The rows it asks of the engine: each row's n samples."""
        rows = self.pending.batch.rows
        return sum(rows[i].n for i in self.rows)

    def requests(self) -> list[GenerationRequest]:
        rows = self.pending.batch.rows
        return [GenerationRequest(rows[i].prompt_token_ids, rows[i].params) for i in self.rows]


@dataclass
class _Sent:
    piece: _Piece
    worker: int
    seq: int  # order of sending: an actor runs its tasks in that order


FINISH_REASONS = ("stop", "length", "error")  # always counted in the summary, in this order


class _JobRun:
    """One pass over the batches: admit, submit, collect, write, record.

    Bookkeeping: `queue` holds pieces waiting for a worker (retries first, in order),
    `in_flight` maps each task's ObjectRef to what was sent. `_submit` is the one place a piece is
    sent; `_collect_one` (with `_worker_died` for deaths) the one place a finished or
    failed piece is handled; `_write` the one place a part is written. A row's result is
    stored once in its batch's `_Pending`, and a batch is written once when all its rows
    have one: no row is lost or written twice, whatever dies.

    Failures:
    - the model raising on a piece (a Python exception in `run_batch`): its rows become
      `error` rows (the worker already isolates bad rows, so this is rare);
    - a worker dying (its process killed, crashed, its node lost): every piece in flight
      on it ends, and the worker is replaced. The earliest sent of those that failed was
      most likely running (an actor runs its tasks in order; the one before may have
      finished with its reply lost) and is blamed for the death; all that failed become
      suspects, which run alone from then on, so every later death is blamed exactly. A
      piece blamed MAX_BATCH_ATTEMPTS times (once, if already a split piece) is cut in
      halves; a single row blamed becomes an `error` row saying the worker died while
      processing it. The guess (earliest sent) only ever blames a piece that was not yet
      a suspect, i.e. a whole batch with no death yet, and one death is below
      MAX_BATCH_ATTEMPTS: a wrong guess never cuts a piece or makes an error row;
    - `max_deaths_in_a_row` deaths without any piece finishing on a worker between them
      stop the job (NanoserveError): workers that die on everything are not a row's fault.
    """

    def __init__(self, opts: JobOptions, plan: ColumnPlan, folder: OutputDir, manifest: Manifest,
                 start_pool: Callable[[], WorkerPool], total_rows: int,
                 timeline: Timeline, retry: set[int] = frozenset(),
                 controls: tuple[str, ...] = (), reasoning: Any = None) -> None:
        """`start_pool` is called when the first piece is sent: a rerun with nothing left
        to compute starts neither Ray nor a worker. `retry`: batch ids an earlier run wrote
        that are computed again (their parts are replaced), never adopted. `controls`: the
        output-control columns the parts have (`prepare.output_controls`)."""
        from tqdm import tqdm

        self.opts = opts
        self.reasoning = reasoning  # a nanoserve.reasoning.ReasoningParser, or None
        self.retry = retry
        self.schema = plan.output_schema(controls)
        self.input_fields = plan.passthrough_fields(controls)
        self.folder = folder
        self.manifest = manifest
        self.start_pool = start_pool
        self.pool: WorkerPool | None = None
        self.queue: deque[_Piece] = deque()
        self.in_flight: dict[Any, _Sent] = {}
        self.sent = 0
        self.deaths_in_a_row = 0
        self.rows = self.error_rows = self.rows_resumed = self.num_batches = 0
        self.input_rows = 0
        self.finish_reasons: Counter = Counter()
        self.cut_constrained: Counter = Counter()  # constrained rows ended by length, by max_tokens
        self.results_back = 0  # answers (or deaths) of pieces collected
        self.input_tokens = self.output_tokens = 0
        self.padded_slots = self.padded_real = 0
        self.cached_tokens = self.cached_prompt_tokens = 0  # batches from prefix-caching engines
        self.any_prefix_cache = False
        self.oom_errors = 0
        self.report = ReportLog()  # what the job report shows (`ray_jobs.report`)
        self.timeline = timeline
        self.t0 = time.perf_counter()
        self.bar = tqdm(total=total_rows, unit="row", file=sys.stderr, disable=not opts.progress,
                        dynamic_ncols=True, desc=self.BAR_DESCRIPTION)

    BAR_DESCRIPTION = "nanoserve batch"

    def execute(self, batches: Iterator[Batch]) -> None:
        """Hold what each live worker may take (`hold_limits`) plus the queue; take the next
        batch from `batches` only when the queue is empty and a worker has room."""
        source = iter(batches)
        more = True
        try:
            while True:
                while self.queue and (index := self._worker_for(self.queue[0])) is not None:
                    self._submit(self.queue.popleft(), index)
                if more and not self.queue and self._has_room():
                    batch = next(source, None)
                    if batch is None:
                        more = False
                    else:
                        self._admit(batch)
                    continue
                if not self.in_flight:
                    break  # every worker idle, so any piece could go: the queue is empty too
                self._collect_one()
            self.timeline.mark("prepare")  # (marked already unless no worker was needed)
            if "first_batch" in self.timeline.marks:
                if self.results_back == 1:  # the first result was the only one: one phase
                    del self.timeline.marks["first_batch"]
                self.timeline.mark("generate")
        finally:
            self.bar.close()

    def _has_room(self) -> bool:
        """Whether a new batch could be sent now (before the pool starts: yes)."""
        if self.pool is None:
            return True
        return self.pool.pick(False) is not None

    def _worker_for(self, piece: _Piece) -> int | None:
        """The worker `piece` goes to now, or None while none can take it. Starts the pool
        when the first piece is ready to go."""
        if self.pool is None:
            self.pool = self.start_pool()
        return self.pool.pick(piece.suspect, piece.prefix())

    def _admit(self, batch: Batch) -> None:
        """Skip a batch an earlier run wrote (unless it is to be retried), write an error
        batch, or queue the batch."""
        n = len(batch.rows)
        if batch.batch_id not in self.retry and (batch.batch_id in self.manifest.done or adopt_part(
                self.folder, self.manifest, batch.batch_id, batch.digest(), batch.num_samples)):
            self.rows_resumed += batch.num_samples
            self.bar.update(n)
        elif batch.is_error:
            self._write(batch, [error_rows(r.error, 0, r.n) for r in batch.rows])
        else:
            self.queue.append(_Piece(_Pending(batch, [None] * n, n), tuple(range(n))))

    def _submit(self, piece: _Piece, index: int) -> None:
        """The one place a piece is sent to a worker (`index`, from `_worker_for`)."""
        worker = self.pool.workers[index]
        ref = worker.handle.run_batch.remote(piece.requests())
        worker.in_flight += 1
        worker.rows_in_flight += piece.samples()
        worker.holds_suspect = piece.suspect
        worker.last_prefix = piece.prefix()
        self.sent += 1
        self.in_flight[ref] = _Sent(piece, index, self.sent)

    def _collect_one(self) -> None:
        """The one place a finished or failed piece is handled: wait for any piece in
        flight, then store its rows' results, or handle its worker's death."""
        import ray

        self.pool.grow()  # workers on GPUs that joined the cluster (ray_jobs.autoscale)
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=self.pool.poll_s)
        if not ready:
            return  # nothing finished within the poll: look for joining GPUs again
        sent = self._pop(ready[0])
        outcome, value = _fetch(ready[0])
        self.timeline.mark("first_batch")
        self.results_back += 1
        if outcome == "died":
            self._worker_died(sent, value)
        else:
            self._settle(sent, outcome, value)

    def _pop(self, ref: Any) -> _Sent:
        sent = self.in_flight.pop(ref)
        worker = self.pool.workers[sent.worker]
        worker.in_flight -= 1
        worker.rows_in_flight -= sent.piece.samples()
        if sent.piece.suspect:
            worker.holds_suspect = False
        return sent

    def _settle(self, sent: _Sent, outcome: str, value: Any) -> None:
        """A piece the worker answered: with a table, or with an exception it raised."""
        worker = self.pool.workers[sent.worker]
        piece = sent.piece
        rows = piece.pending.batch.rows
        if outcome == "raised":
            message = f"generation failed: {first_line(str(value.cause or value))}"
            self._answer(piece, [error_rows(message, rows[i].num_prompt_tokens, rows[i].n)
                                 for i in piece.rows])
            return
        meta = value.schema.metadata or {}
        if ENGINE_KEY in meta:  # the actor's counters so far (its answers come in any order)
            counters = json.loads(meta[ENGINE_KEY])
            if counters.get("up_s", 0) >= worker.engine.get("up_s", 0):
                worker.engine = counters
        self.padded_slots += int(meta.get(PREFILL_SLOTS_KEY, 0))
        self.padded_real += int(meta.get(PREFILL_TOKENS_KEY, 0))
        answered = _per_row(value.to_pylist(), [rows[i].n for i in piece.rows])
        if PROMPT_TOKENS_CACHED_KEY in meta:
            self.any_prefix_cache = True
            self.cached_tokens += int(meta[PROMPT_TOKENS_CACHED_KEY])
            self.cached_prompt_tokens += sum(r[0]["num_input_tokens"] or 0 for r in answered)
        ooms = int(meta.get(OOM_KEY, 0))
        if ooms:
            self.oom_errors += ooms
            log(f"nanoserve: worker {sent.worker} ran out of device memory {ooms} time(s) on "
                 f"batch {piece.pending.batch.batch_id}; the engine retried it in smaller "
                 f"sub-batches")
        worker.batches += 1
        worker.rows += len(piece.rows)
        worker.last_result_s = self.timeline.now()
        worker.result_s.append(worker.last_result_s)
        self.report.add(piece_record(piece.pending.batch.batch_id, sent.worker,
                                     worker.last_result_s, value))
        self.deaths_in_a_row = 0
        self._answer(piece, answered)

    def _worker_died(self, sent: _Sent, error: Exception) -> None:
        """Every piece in flight on the dead worker ends now: those that ran before the
        death have their results, the others failed with it. Blame the earliest sent of
        the failed ones, make them all suspects, replace the worker, send them again."""
        import ray

        index = sent.worker
        others = [ref for ref, s in self.in_flight.items() if s.worker == index]
        if others:
            ray.wait(others, num_returns=len(others), timeout=DEATH_SETTLE_TIMEOUT_S)
        failed = [sent]
        for ref in others:
            other = self._pop(ref)
            outcome, value = _fetch(ref, timeout=0)
            if outcome == "died":
                failed.append(other)
            else:
                self._settle(other, outcome, value)
        failed.sort(key=lambda s: s.seq)
        for s in failed:
            s.piece.suspect = True
        suspect = failed[0].piece
        cause = first_line(str(error))
        self.deaths_in_a_row += 1
        if self.deaths_in_a_row > self.opts.max_deaths_in_a_row:
            raise NanoserveError(
                f"workers died {self.deaths_in_a_row} times in a row without finishing a "
                f"batch (last: {cause}); the job stopped (rerun it to resume)"
            )
        batch = suspect.pending.batch
        log(f"nanoserve: worker {index} died while running batch {batch.batch_id} "
             f"({len(suspect.rows)} of its {len(batch.rows)} rows): {cause}; replacing it")
        self.pool.replace(index)
        retry = [s.piece for s in failed[1:]] + self._blame(suspect, cause)
        self.queue.extendleft(reversed(retry))

    def _blame(self, piece: _Piece, cause: str) -> list[_Piece]:
        """A piece that was running when its worker died: what to send again (itself, or
        its two halves), or nothing when it is one row, which becomes an `error` row."""
        piece.deaths += 1
        if piece.deaths < (1 if piece.split else MAX_BATCH_ATTEMPTS):
            return [piece]
        if len(piece.rows) > 1:
            half = len(piece.rows) // 2
            return [_Piece(piece.pending, piece.rows[:half], split=True, suspect=True),
                    _Piece(piece.pending, piece.rows[half:], split=True, suspect=True)]
        row = piece.pending.batch.rows[piece.rows[0]]
        self._answer(piece, [error_rows(
            f"the worker died while processing this row ({cause}); isolated after its batch "
            f"killed the worker {MAX_BATCH_ATTEMPTS} times", row.num_prompt_tokens, row.n)])
        return []

    def _answer(self, piece: _Piece, results: list[list[dict[str, Any]]]) -> None:
        """Store a piece's results (per row, its samples'); write the batch once every row
        has them."""
        pending = piece.pending
        for i, res in zip(piece.rows, results, strict=True):
            pending.results[i] = res
        pending.left -= len(piece.rows)
        if pending.left == 0:
            self._write(pending.batch, pending.results)

    def _write(self, batch: Batch, results: list[list[dict[str, Any]]]) -> None:
        """The one place a part is written (then recorded in the manifest), its rows in
        input order (the digest keeps the batch's own order, by prompt length)."""
        if self.reasoning is not None:
            results = [[split_reasoning(self.reasoning, r.prompt_token_ids, res) for res in samples]
                       for r, samples in zip(batch.rows, results)]
        order = sorted(range(len(batch.rows)), key=lambda i: batch.rows[i].position)
        in_order = dataclasses.replace(batch, rows=tuple(batch.rows[i] for i in order))
        table = self._assemble(in_order, [results[i] for i in order])
        table = table.replace_schema_metadata({PART_DIGEST_KEY: batch.digest().encode()})
        self.folder.write_parquet(part_name(batch.batch_id), table)  # visible once complete
        self.manifest.record(batch.batch_id, table.num_rows)
        self.manifest.save(self.folder)
        self._count(batch, results)
        self.report.written(batch.batch_id, [res for samples in results for res in samples])

    def _assemble(self, batch: Batch, results: list[list[dict[str, Any]]]) -> pa.Table:
        """`id`, the input columns, then the results: one output row per sample of each
        batch row (its id and input columns repeated)."""
        rows = [r for r, samples in zip(batch.rows, results) for _ in samples]
        flat = [res for samples in results for res in samples]
        arrays = [pa.array([r.id for r in rows], type=self.schema.field("id").type)]
        arrays += [pa.array([r.values[f.name] for r in rows], type=f.type)
                   for f in self.input_fields]
        result_fields = list(self.schema)[len(arrays):]
        arrays += [pa.array([res.get(f.name) for res in flat], type=f.type)
                   for f in result_fields]
        return pa.Table.from_arrays(arrays, schema=self.schema)

    def _count(self, batch: Batch, results: list[list[dict[str, Any]]]) -> None:
        n = len(batch.rows)
        flat = [res for samples in results for res in samples]
        self.rows += len(flat)
        self.input_rows += n
        self.num_batches += 1
        self.error_rows += sum(res["finish_reason"] == "error" for res in flat)
        self.finish_reasons.update(res["finish_reason"] for res in flat)
        for row, samples in zip(batch.rows, results):
            if row.params is not None and row.params.structured_outputs is not None:
                cut = sum(res["finish_reason"] == "length" for res in samples)
                if cut:
                    self.cut_constrained[row.params.max_tokens] += cut
        self.input_tokens += sum(samples[0]["num_input_tokens"] or 0 for samples in results)
        self.output_tokens += sum(res["num_generated_tokens"] or 0 for res in flat)
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(n)
        self.bar.set_postfix_str(self._rates(elapsed), refresh=False)

    def _rates(self, elapsed: float) -> str:
        """The progress bar's rates after `elapsed` seconds."""
        return f"{self.output_tokens / elapsed:.1f} out tok/s"

    def _warnings(self) -> tuple[str, ...]:
        cut = sum(self.cut_constrained.values())
        if not cut:
            return ()
        low, high = min(self.cut_constrained), max(self.cut_constrained)
        limit = f"max_tokens {low}" if low == high else f"max_tokens {low}-{high}"
        return (f"warning: {cut} constrained row(s) ended by length ({limit}): their text is "
                f"cut short and need not match its constraint (JSON schema, regex or choice); "
                f"raise --max-tokens",)

    def summary(self, wall_time_s: float) -> JobSummary:
        waste = 1 - self.padded_real / self.padded_slots if self.padded_slots else 0.0
        return JobSummary(
            output_dir=str(self.folder), rows=self.rows, error_rows=self.error_rows,
            rows_resumed=self.rows_resumed, input_tokens=self.input_tokens,
            output_tokens=self.output_tokens, wall_time_s=wall_time_s,
            output_tokens_per_s=self.output_tokens / wall_time_s if wall_time_s > 0 else 0.0,
            padding_waste=waste, num_batches=self.num_batches,
            prefix_hit_rate=(self.cached_tokens / self.cached_prompt_tokens
                             if self.cached_prompt_tokens else 0.0)
            if self.any_prefix_cache else None,
            workers=self.pool.reports() if self.pool is not None else (),
            worker_restarts=sum(w.restarts for w in self.pool.workers) if self.pool is not None else 0,
            device_oom_errors=self.oom_errors, timings=self.timeline.timings(),
            nodes_lost=self.pool.lost_nodes() if self.pool is not None else (),
            input_rows=self.input_rows,
            finish_reasons={**{k: 0 for k in FINISH_REASONS}, **self.finish_reasons},
            warnings=self._warnings(),
        )


def _per_row(table_rows: list[dict[str, Any]], samples: list[int]) -> list[list[dict[str, Any]]]:
    """A worker's result rows (one per sample, a row's samples consecutive) grouped per
    input row; a worker that answered another number of rows is a NanoserveError."""
    if len(table_rows) != sum(samples):
        raise NanoserveError(f"a worker answered {len(table_rows)} result rows for "
                             f"{sum(samples)} samples; rerun to resume")
    out, at = [], 0
    for n in samples:
        out.append(table_rows[at:at + n])
        at += n
    return out


def _fetch(ref: Any, timeout: float | None = None) -> tuple[str, Any]:
    """A task's outcome: ('ok', table), ('raised', RayTaskError) when `run_batch` raised,
    or ('died', error) when its worker died (or did not answer within `timeout`)."""
    import ray

    try:
        return "ok", ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        return "raised", e
    except ray.exceptions.RayError as e:  # actor died, unreachable, killed for memory, timeout
        return "died", e


__all__ = ["JobOptions", "JobSummary", "WorkerReport", "run_batch_job"]


def split_reasoning(parser: Any, prompt_ids: Any, res: dict[str, Any]) -> dict[str, Any]:
    """A result row with its think block split off (`nanoserve.reasoning`): `reasoning`
    (null where the output has no block), `num_reasoning_tokens`, and `generated_text` the
    answer only (empty when the block never closed: finish_reason stays as the row ended,
    'length' when it hit max_tokens while thinking). Error rows pass unchanged."""
    if res["finish_reason"] == "error" or res["generated_token_ids"] is None:
        return res
    reasoning, answer, n, _ = parser.split_text(prompt_ids, res["generated_token_ids"])
    return {**res, "generated_text": answer, "reasoning": reasoning, "num_reasoning_tokens": n}
