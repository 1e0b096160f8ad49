"""Stage dispatch: the job's driver, one for both tasks (generation, embedding). It moves
descriptors, never rows: it scans the input, hands shards to the Ray workers, and records
the shards whose parts are written.

    summary = run_job("prompts.jsonl", "out/", max_tokens=64)     # = run_batch_job
    summary = run_job("docs.jsonl", "vectors/", task="embed")     # = run_embed_job

Order of work (every job-level check comes before any model loads on a worker):
1. take the task's own options (`TaskKind.take_options`: `ray_jobs.tasks.generate`,
   `ray_jobs.tasks.embed`), check the job's (`JobOptions`); scan the input (files, schema,
   row count, where every `batch_size`-th JSONL row starts) and plan its columns;
2. resolve the model and load its tokenizer and config on the driver (cheap: no weights);
   the task plans the rest (`TaskKind.plan`: its rows' preparer, output schema, settings,
   actor);
3. open the output folder: fresh, or resume an earlier run with equal settings;
4. start (or join) Ray and one actor per GPU (one CPU worker without GPUs), when the first
   shard needs a worker (a rerun with nothing left to compute starts none);
5. hand out the shards (`ray_jobs.input.shards`: `batch_size` consecutive rows of one file each)
   to the least-loaded worker (each holds as many as keep its engine full:
   `ray_jobs.dispatch.pool.hold_limits`); the worker reads the shard's rows, prepares them, runs
   them and writes the shard's part (`ray_jobs.workers.tasks.ShardRunner`), and answers with its
   counts; the driver then records the shard in the manifest;
6. when every shard is recorded, write the OpenAI output files where the job has them
   (`ray_jobs.output.openai_files.write_outputs`: the shards' fragments, which their workers
   wrote, joined as bytes in shard order), then mark the folder complete (`_SUCCESS`).

The scan is the one pass the driver makes over every input byte, kept on purpose: it is what
finds an unreadable file, a missing prompt column or a duplicate id before any model loads,
gives the exact row count that progress and the report divide by, and places the shards'
cut points in a JSONL file (a byte offset alone cannot say which row a shard starts at). It
parses JSONL in blocks through Arrow's JSON reader, making no Python row: the whole driver,
scan included, used 2.6 s of CPU a million rows over 10M rows (`benchmarks/driver_ceiling.py`,
benchmarks/RESULTS.md).

Progress: the bar counts input rows as they finish; for the pieces in flight the driver asks
each worker every PROGRESS_POLL_S how many of their rows its engine has finished
(`ShardWorker.progress`), so it moves inside a batch, not only when the batch comes back.

Memory stays flat: the driver holds the scan's cut points (16 bytes a shard), the id
hashes when the input has ids (8 bytes a row, `ray_jobs.input.ids`), and the descriptors of the
shards in flight; the manifest records done shard ids, never per-row data. A part holds
its shard's rows in input order, and parts are numbered in input order.

A row asking for n samples gives n output rows, keyed on (`id`, `sample_index`), its input
columns repeated: a worker answers one result row per sample, in order. A row that fails as a whole gives n error rows. Parts, resume
and `--retry-errors` work per shard, so every (id, sample_index) is written
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
  `ray_jobs.output.manifest`), the rest is computed, each row written exactly once; Ctrl-C
  stops the run with its summary and the report of the whole job (`run_pipeline`);
- rows too big for a worker's KV pool are split into sub-batches by the engine, or become
  `error` rows when even one alone cannot fit; a device out-of-memory error makes the
  engine halve the batch, and the count is reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from nanoserve.errors import InputError, NanoserveError
from nanoserve.model_store import resolve_model
from ray_jobs.dispatch.local_ray import RaySession
from ray_jobs.dispatch.placement import check_output_reachable
from ray_jobs.dispatch.pool import WorkerPool, WorkerReport, first_line, log
from ray_jobs.input.files import InputInfo
from ray_jobs.input.io import scan_input
from ray_jobs.input.shards import InputSpec, Shard, iter_shards, num_shards
from ray_jobs.input.storage import OutputDir, is_uri
from ray_jobs.output.manifest import (
    REPORT_NAME,
    SUCCESS_NAME,
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
from ray_jobs.output.openai_files import OUTPUT_NAME, OpenAIOutput, write_outputs
from ray_jobs.preparation.batching import BatchLimits
from ray_jobs.preparation.prepare import load_model_meta, plan_columns
from ray_jobs.report.report import JobTotals, ReportLog, report_data, write_report
from ray_jobs.report.timeline import PHASES, Timeline
from ray_jobs.tasks.embed import EMBED
from ray_jobs.tasks.generate import GENERATE
from ray_jobs.workers.options import JobOptions
from ray_jobs.workers.tasks import JobSpec, ShardOutcome, ShardRunner, TaskKind, TaskPlan
from ray_jobs.workers.worker import (
    ENGINE_KEY,
    OOM_KEY,
    PREFILL_SLOTS_KEY,
    PREFILL_TOKENS_KEY,
    PROMPT_TOKENS_CACHED_KEY,
)

PROGRESS_POLL_S = 1.0  # how often the driver asks its workers how far their rows are
FAULT_HOLD_AFTER_PARTS = "NANOSERVE_FAULT_HOLD_AFTER_PARTS"  # testing hook: `_fault_hold_after_parts`
MAX_BATCH_ATTEMPTS = 2  # deaths of its worker a batch may cause before it is cut in halves
PREFIX_KEY_TOKENS = 32  # leading prompt tokens that name a piece's prefix for dispatch
DEATH_SETTLE_TIMEOUT_S = 60.0  # wait for the other tasks of a dead actor to end
TASKS = {kind.name: kind for kind in (GENERATE, EMBED)}  # run_job's `task`
FRAGMENT_SHARDS_A_WORKER = 2  # committed shards a worker formats at once (`make_fragments`)


@dataclass(frozen=True)
class JobSummary:
    """What one run did, for either task (`task`: its own lines in `format`, its own
    counters). Counts cover this run; `rows_resumed` rows were written by earlier runs into
    the same folder."""

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
    report: str | None = None  # the run's HTML report (`ray_jobs.report.report`), when it wrote one
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
    task: str = "generate"  # run_job's: "generate" or "embed"
    truncated_rows: int = 0  # embedding: inputs cut to the input limit
    empty_answers: int = 0  # generation: rows that ended at 'stop' with no text
    dimensions: int | None = None  # embedding: the vectors' (None: generation)
    # Ctrl-C stopped the run: (batches written in all, the job's batches); None: it did not
    interrupted: tuple[int, int] | None = None

    def format(self) -> str:
        samples = (f" for {self.input_rows} input rows"
                   if self.input_rows is not None and self.input_rows != self.rows else "")
        reasons = (", ".join(f"{k} {v}" for k, v in self.finish_reasons.items())
                   if self.finish_reasons else f"{self.error_rows} error rows")
        if self.empty_answers:
            reasons += f"; {self.empty_answers} empty answer(s)"
        lines = [
            f"rows: {self.rows}{samples} ({reasons})"
            + (f", {self.rows_resumed} done by an earlier run" if self.rows_resumed else ""),
            *TASKS[self.task].summary_lines(self),
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
        if self.interrupted is not None:
            lines.append(f"interrupted: {self.interrupted[0]} of {self.interrupted[1]} "
                         f"batches are written; rerun the same command to resume")
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


def run_job(input: str | Path, output_dir: str | Path, task: str = "generate",
            **options: Any) -> JobSummary:
    """Run the job of `nanoserve batch` (task "generate") or `nanoserve embed` (task
    "embed") on INPUT into OUTPUT_DIR; see the module docstring. `options`: `JobOptions`'
    fields and the task's own (`EMBED_OPTIONS`). Job-level problems raise `NanoserveError`
    (InputError, ModelError) before any worker starts; row-level problems become `error`
    rows."""
    timeline = Timeline(time.perf_counter())
    if task not in TASKS:
        raise InputError(f"task must be 'generate' or 'embed', got {task!r}")
    kind = TASKS[task]
    options = dict(options)
    own = kind.take_options(options)
    opts = JobOptions(**options)
    limits = BatchLimits(opts.batch_size, opts.max_batch_tokens,
                         opts.window_batches * opts.batch_size)  # (checked before the scan)
    info = scan_input(input, opts.chunk_rows, opts.id_column, opts.input_format,
                      shard_rows=opts.batch_size)
    opts = dataclasses.replace(opts, prompt_column=kind.prompt_column(opts.prompt_column,
                                                                      info.schema.names))
    plan = plan_columns(info.schema, opts.prompt_column, opts.id_column)
    model_path = resolve_model(opts.model)
    config, tokenizer = load_model_meta(model_path)
    part = kind.plan(opts, own, info, plan, model_path, config, tokenizer)
    settings = {**_job_settings(part.opts, info, model_path, limits, plan), **part.settings}
    folder = OutputDir.open(output_dir)  # a local folder or an object-store prefix
    openai = OpenAIOutput.of(opts.model, settings) if part.openai_output else None
    spec = JobSpec(kind.name, InputSpec.of(info, opts.chunk_rows), plan, part.schema, folder,
                   part.controls, part.task_options, openai)
    return run_pipeline(Pipeline(part.opts, info, output_dir, folder, settings, spec,
                                 ShardRunner(spec, part.task), kind, part), timeline)


def run_batch_job(input: str | Path, output_dir: str | Path, **options: Any) -> JobSummary:
    """`run_job`: the batch job, generation unless `task="embed"` says otherwise."""
    return run_job(input, output_dir, **options)


def run_embed_job(input: str | Path, output_dir: str | Path, **options: Any) -> JobSummary:
    """`run_job(..., task="embed")`: a vector per row (`ray_jobs.tasks.embed`)."""
    return run_job(input, output_dir, task="embed", **options)


@dataclass
class Pipeline:
    """One job as the walk (`run_pipeline`) needs it: the scanned input, the output folder
    and the settings its manifest compares, the spec the workers get, the walk without an
    engine (`local`, for error rows made on the driver), the task (`kind`) and its part of
    the job (`part`: its actor, what the report shows, its summary fields, what it writes
    before the folder is marked complete)."""

    opts: JobOptions
    info: InputInfo
    output_dir: str | Path
    folder: OutputDir
    settings: dict[str, Any]
    spec: JobSpec
    local: ShardRunner
    kind: TaskKind
    part: TaskPlan


def run_pipeline(p: Pipeline, timeline: Timeline) -> JobSummary:
    """The job's walk, the same for every task: hold and open the output folder (fresh, or
    resumed with equal settings), hand the shards out, mark it complete, write the report.
    Ray and the workers start when the first shard needs one.

    Ctrl-C (KeyboardInterrupt) once the folder is open stops the walk; the workers and a
    private Ray are stopped, the lock let go, and the run's summary and the report of the
    whole job are made all the same, with further Ctrl-Cs held back meanwhile
    (`_HeldInterrupts`); then `JobInterrupted` carries the summary. Once every part is
    recorded, a Ctrl-C no longer stops anything: the folder is marked complete first."""
    opts, folder = p.opts, p.folder
    for warning in p.part.warnings:  # at once: before the user waits for the job
        log(warning)
    if folder.local:  # named as the user gave it (a path, or its file:// URI's path)
        check_output_reachable(folder.path if is_uri(p.output_dir) else Path(p.output_dir))
    held = _HeldInterrupts()
    try:
        with ExitStack() as stack:
            stack.enter_context(hold_output_dir(folder))  # one job per output folder at a time
            manifest = open_output_dir(folder, p.settings, opts.overwrite)
            retry = reopen_batches_with_errors(folder, manifest) if opts.retry_errors else set()
            if retry:
                log(f"nanoserve: --retry-errors: computing again {len(retry)} batch(es) of an "
                    f"earlier run that hold error rows")
            if manifest.complete:
                held.hold()
                return _rerun_of_complete(p, manifest, timeline)

            def start_pool() -> WorkerPool:  # on the first shard that needs a worker
                timeline.mark("prepare")
                stack.enter_context(RaySession(opts.address))
                timeline.mark("ray")
                pool = WorkerPool.start(opts, timeline, actor=p.part.actor,
                                        actor_kwargs={**p.part.actor_kwargs, "spec": p.spec})
                stack.callback(pool.shutdown)
                timeline.mark("workers")
                return pool

            run = _JobRun(opts, folder, manifest, start_pool, p.info.num_rows, timeline, retry,
                          p.local, p.kind)
            try:
                run.execute(iter_shards(p.info))
                _fault_hold_after_parts("last")
            except KeyboardInterrupt:
                held.hold(caught=True)
            else:
                held.hold()
            # Complete: the walk ended, or Ctrl-C came after every part was recorded.
            if not held.caught or len(manifest.done) == num_shards(p.info):
                if p.spec.openai is not None:
                    write_outputs(folder, iter_shards(p.info),
                                  lambda shards: make_fragments(shards, run.pool, p.local))
                mark_complete(folder, manifest)
            else:
                log("nanoserve: interrupted: stopping the workers; the summary and the report "
                    "follow")
        # (the workers, a private Ray and the lock are let go: with Ctrl-C held back)
        timeline.mark("shutdown")
        summary = run.summary(timeline.marks["shutdown"])
        for warning in summary.warnings:
            log(warning)
        summary = dataclasses.replace(
            summary, warnings=p.part.warnings + summary.warnings, **p.part.summary,
            interrupted=None if manifest.complete else (len(manifest.done),
                                                        num_shards(p.info)))
        summary = _with_report(p, summary, run.report, manifest, run.written)
    finally:  # (a Ctrl-C before the folder was open ends the job at once: nothing was done)
        held.release()
    if summary.interrupted is not None:
        raise JobInterrupted(summary)
    if held.caught:
        log("nanoserve: Ctrl-C came after the last part was written: the job was completed "
            "first")
    return summary


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the job before its last part; `summary` is the run's (its report is
    written, the lock let go): the caller prints it, then ends as on any Ctrl-C."""

    def __init__(self, summary: JobSummary) -> None:
        super().__init__("interrupted")
        self.summary = summary


class _HeldInterrupts:
    """Ctrl-C (SIGINT) noted instead of raised, from `hold()` to `release()`, while the job
    stops its workers, lets the folder go and writes its summary and report (a second Ctrl-C
    would otherwise cut them short). Only the main thread can hold it; elsewhere (a job run
    from another thread) nothing is held. `caught`: a Ctrl-C came (or `hold(caught=True)`
    says one did)."""

    def __init__(self) -> None:
        self.caught = False
        self._previous: Any = None
        self._held = False

    def hold(self, caught: bool = False) -> None:
        self.caught = self.caught or caught
        if self._held or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGINT, self._note)
        self._held = True

    def _note(self, signum: int, frame: Any) -> None:
        log("nanoserve: Ctrl-C held back until the folder, the summary and the report are "
            "written (a moment)")
        self.caught = True

    def release(self) -> None:
        if self._held:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None
                          else signal.default_int_handler)
            self._held = False


def _rerun_of_complete(p: Pipeline, manifest: Manifest, timeline: Timeline) -> JobSummary:
    """A rerun that finds every part recorded: it starts neither Ray nor a worker; it writes
    what an earlier run stopped before writing (the OpenAI files, `_SUCCESS`, the report)."""
    folder = p.folder
    if p.spec.openai is not None and not folder.exists(OUTPUT_NAME):  # (removed since)
        write_outputs(folder, iter_shards(p.info),
                      lambda shards: make_fragments(shards, None, p.local))
    if not folder.exists(SUCCESS_NAME):  # stopped between the manifest and `_SUCCESS`
        mark_complete(folder, manifest)
    timeline.mark("prepare")
    summary = JobSummary(str(folder), 0, 0, manifest.rows_done, 0, 0,
                         timeline.marks["prepare"], 0.0, 0.0, 0,
                         timings=timeline.timings(), task=p.kind.name,
                         warnings=p.part.warnings, **p.part.summary)
    if folder.exists(REPORT_NAME):  # the earlier run's report is kept
        return summary
    return _with_report(p, summary, ReportLog(), manifest, set())


def _with_report(p: Pipeline, summary: JobSummary, report: ReportLog, manifest: Manifest,
                 written: set[int]) -> JobSummary:
    """Write the job's report: this run's `report` log and `summary`, and the whole job (the
    parts of earlier runs, those recorded and not `written` by this run, read back); the
    summary with its path. A report that cannot be written loses nothing (the rows are
    written and recorded): one line says so."""
    job = JobTotals(num_shards(p.info))
    job.add_run(report, summary)
    settings = {"options": dataclasses.asdict(p.opts), "model": p.settings["model"],
                "input": p.settings["input"], **p.part.report_settings}
    try:
        for shard_id in sorted(manifest.done - written):
            job.add_part(p.folder, part_name(shard_id))
        path = write_report(p.folder, report_data(report, summary, settings,
                                                  p.opts.batch_size, job))
    except Exception as e:
        log(f"nanoserve: the job report could not be written: {type(e).__name__}: "
            f"{first_line(str(e))}")
        return summary
    return dataclasses.replace(summary, report=str(path))


def _job_settings(opts: JobOptions, info: InputInfo, model_path: Path,
                  limits: BatchLimits, plan: Any = None) -> dict[str, Any]:
    """What the manifest compares on resume: everything that changes the output rows. The
    output controls appear only when set (`n` above 1, logprobs asked, a job-wide structured
    output), and so do an FP8 KV cache and an `image` column read as the rows' images
    (`plan.image_column`: a run from before images were read passed it through), so the
    output of a job from before them still resumes."""
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
                       if opts.reasoning_parser not in (None, "none") else {}),
                    **({"image_column": plan.image_column}
                       if plan is not None and plan.image_column else {})},
    }


@dataclass
class _Pending:
    """A shard sent to the workers whose rows are not all answered yet."""

    shard: Shard
    left: int  # rows without an answer
    tables: dict[int, pa.Table] = field(default_factory=dict)  # pieces' rows, by first row


@dataclass
class _Piece:
    """Rows [rows[0], rows[1]) of one shard that go to a worker together: the whole shard
    (its worker writes the part), or, once the shard killed its worker MAX_BATCH_ATTEMPTS
    times, a half of it (then a half of that...), whose rows come back to the driver, which
    writes the shard's part when every piece is answered.

    A suspect piece was in flight on a worker that died. It runs alone on an idle worker
    (nothing else is sent there until it ends), so if that worker dies, the piece did it."""

    pending: _Pending
    rows: tuple[int, int]
    split: bool = False  # a part of a shard that kept killing its worker
    suspect: bool = False
    deaths: int = 0  # worker deaths blamed on this piece

    def size(self) -> int:
        return self.rows[1] - self.rows[0]

    def prefix(self) -> tuple[int, ...]:
        """No tokens on the driver: pieces go to the least-loaded worker."""
        return ()

    def samples(self) -> int:
        return self.size()


@dataclass
class _Sent:
    piece: _Piece
    worker: int
    seq: int  # order of sending: an actor runs its tasks in that order


class _JobRun:
    """One pass over the shards: admit, submit, collect, record.

    Bookkeeping: `queue` holds pieces waiting for a worker (retries first, in order),
    `in_flight` maps each task's ObjectRef to what was sent. `_submit` is the one place a
    piece is sent; `_collect_one` (with `_worker_died` for deaths) the one place a finished
    or failed piece is handled; `_write` the one place a shard's part is recorded in the
    manifest (written by its worker, or here from its pieces). A shard is recorded once,
    when all its rows are answered: no row is lost or written twice, whatever dies (a
    worker that wrote a part and died before answering wrote it under the shard's name:
    the shard's next run replaces it whole).

    Failures:
    - the task raising on a piece (a Python exception in `run_shard`): its rows become
      `error` rows, made here (`local`: the same walk without an engine); an input that
      became unreadable since the scan stops the job (InputError);
    - a worker dying (its process killed, crashed, its node lost): every piece in flight
      on it ends, and the worker is replaced. The earliest sent of those that failed was
      most likely running (an actor runs its tasks in order; the one before may have
      finished with its reply lost) and is blamed for the death; all that failed become
      suspects, which run alone from then on, so every later death is blamed exactly. A
      piece blamed MAX_BATCH_ATTEMPTS times (once, if already a split piece) is cut in
      halves; a single row blamed becomes an `error` row saying the worker died while
      processing it. The guess (earliest sent) only ever blames a piece that was not yet
      a suspect, i.e. a whole shard with no death yet, and one death is below
      MAX_BATCH_ATTEMPTS: a wrong guess never cuts a piece or makes an error row;
    - `max_deaths_in_a_row` deaths without any piece finishing on a worker between them
      stop the job (NanoserveError): workers that die on everything are not a row's fault.
    """

    def __init__(self, opts: JobOptions, folder: OutputDir, manifest: Manifest,
                 start_pool: Callable[[], WorkerPool], total_rows: int,
                 timeline: Timeline, retry: set[int], local: ShardRunner, kind: TaskKind) -> None:
        """`start_pool` is called when the first piece is sent: a rerun with nothing left
        to compute starts neither Ray nor a worker. `retry`: shard ids an earlier run wrote
        that are computed again (their parts are replaced), never adopted. `local`: the
        shard walk without an engine, for error rows made here. `kind`: the task (its
        progress rates, its summary's finish reasons)."""
        self.opts = opts
        self.kind = kind
        self.retry = retry
        self.local = local
        self.folder = folder
        self.manifest = manifest
        self.start_pool = start_pool
        self.pool: WorkerPool | None = None
        self.queue: deque[_Piece] = deque()
        self.in_flight: dict[Any, _Sent] = {}
        self.sent = 0
        self.deaths_in_a_row = 0
        self.rows = self.error_rows = self.num_batches = 0
        self.rows_resumed = manifest.rows_done  # output rows earlier runs wrote and kept
        self.written: set[int] = set()  # shard ids whose parts this run recorded
        self.input_rows = 0
        self.truncated_rows = 0
        self.finish_reasons: Counter = Counter()
        self.cut_constrained: Counter = Counter()  # constrained rows ended by length, by max_tokens
        self.empty_answers = 0  # rows that ended at 'stop' with no text
        self.results_back = 0  # answers (or deaths) of pieces collected
        self.input_tokens = self.output_tokens = 0
        self.padded_slots = self.padded_real = 0
        self.cached_tokens = self.cached_prompt_tokens = 0  # pieces from prefix-caching engines
        self.any_prefix_cache = False
        self.oom_errors = 0
        self.report = ReportLog()  # what the job report shows (`ray_jobs.report.report`)
        self.timeline = timeline
        self.t0 = time.perf_counter()
        # The bar (`opts.progress`), shown from when the workers are ready, so that its clock,
        # rate and time left are the generation's, not Ray's start and the model's load: input
        # rows answered (`bar_rows`: pieces back, shards resumed) plus, for the pieces in
        # flight, the rows their workers' engines have finished so far (`partial`, and their
        # output tokens, by the piece's ref), asked every PROGRESS_POLL_S.
        self.total_rows = total_rows
        self.bar: Any = None
        self.bar_rows = 0
        self.partial: dict[Any, int] = {}
        self.partial_tokens: dict[Any, int] = {}
        self.progress_asks: dict[Any, int] = {}  # `progress` calls sent: ref -> worker
        self.next_ask = 0.0

    def execute(self, shards: Iterator[Shard]) -> None:
        """Hold what each live worker may take (`hold_limits`) plus the queue; take the next
        shard from `shards` only when the queue is empty and a worker has room."""
        source = iter(shards)
        more = True
        try:
            while True:
                while self.queue and (index := self._worker_for(self.queue[0])) is not None:
                    self._submit(self.queue.popleft(), index)
                if more and not self.queue and self._has_room():
                    shard = next(source, None)
                    if shard is None:
                        more = False
                    else:
                        self._admit(shard)
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
            if self.bar is not None:
                self.bar.close()

    def _has_room(self) -> bool:
        """Whether a new shard could be sent now (before the pool starts: yes)."""
        if self.pool is None:
            return True
        return self.pool.pick(False) is not None

    def _worker_for(self, piece: _Piece) -> int | None:
        """The worker `piece` goes to now, or None while none can take it. Starts the pool
        when the first piece is ready to go."""
        if self.pool is None:
            self.pool = self.start_pool()
            self._open_bar()
        return self.pool.pick(piece.suspect, piece.prefix())

    def _open_bar(self) -> None:
        """The progress bar, from now (the workers are ready), starting at the rows resumed."""
        if not self.opts.progress:
            return
        from tqdm import tqdm

        self.t0 = time.perf_counter()
        self.bar = tqdm(total=self.total_rows, initial=self.bar_rows, unit="row",
                        file=sys.stderr, dynamic_ncols=True,
                        desc=f"nanoserve {self.kind.command}")

    def _admit(self, shard: Shard) -> None:
        """Skip a shard an earlier run wrote (unless it is to be retried), or queue it."""
        if shard.shard_id not in self.retry:
            before = self.manifest.rows_done
            if shard.shard_id in self.manifest.done or adopt_part(
                    self.folder, self.manifest, shard.shard_id, shard.digest(),
                    beside=self.local.beside_part(shard.shard_id)):
                self.rows_resumed += self.manifest.rows_done - before
                self.bar_rows += shard.num_rows
                self._show()
                return
        self.queue.append(_Piece(_Pending(shard, shard.num_rows), (0, shard.num_rows)))

    def _submit(self, piece: _Piece, index: int) -> None:
        """The one place a piece is sent to a worker (`index`, from `_worker_for`)."""
        worker = self.pool.workers[index]
        shard = piece.pending.shard
        whole = not piece.split
        ref = worker.handle.run_shard.remote(shard, None if whole else piece.rows, whole)
        worker.in_flight += 1
        worker.rows_in_flight += piece.samples()
        worker.holds_suspect = piece.suspect
        worker.last_prefix = piece.prefix()
        self.sent += 1
        self.in_flight[ref] = _Sent(piece, index, self.sent)

    def _collect_one(self) -> None:
        """The one place a finished or failed piece is handled: wait for any piece in
        flight, then count and record its rows, or handle its worker's death."""
        import ray

        self.pool.grow()  # workers on GPUs that joined the cluster (ray_jobs.dispatch.autoscale)
        timeout = self.pool.poll_s
        if self.bar is not None:  # wake to ask the workers how far their rows are
            timeout = PROGRESS_POLL_S if timeout is None else min(timeout, PROGRESS_POLL_S)
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=timeout)
        self._ask_progress()
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
        self.partial.pop(ref, None)
        self.partial_tokens.pop(ref, None)
        worker = self.pool.workers[sent.worker]
        worker.in_flight -= 1
        worker.rows_in_flight -= sent.piece.samples()
        if sent.piece.suspect:
            worker.holds_suspect = False
        return sent

    def _settle(self, sent: _Sent, outcome: str, value: Any) -> None:
        """A piece the worker answered: with its `ShardOutcome`, or with an exception."""
        worker = self.pool.workers[sent.worker]
        piece = sent.piece
        if outcome == "raised":
            cause = value.cause if isinstance(value.cause, Exception) else None
            if isinstance(cause, InputError):
                raise cause
            message = f"{self.local.task.verb} failed: {first_line(str(cause or value))}"
            self._answer(piece, self.local.run(piece.pending.shard, piece.rows, write=False,
                                               error=message))
            return
        meta = value.meta
        if ENGINE_KEY in meta:  # the actor's counters so far (its answers come in any order)
            counters = json.loads(meta[ENGINE_KEY])
            if counters.get("up_s", 0) >= worker.engine.get("up_s", 0):
                worker.engine = counters
        self.padded_slots += int(meta.get(PREFILL_SLOTS_KEY, 0))
        self.padded_real += int(meta.get(PREFILL_TOKENS_KEY, 0))
        if PROMPT_TOKENS_CACHED_KEY in meta:
            self.any_prefix_cache = True
            self.cached_tokens += int(meta[PROMPT_TOKENS_CACHED_KEY])
            self.cached_prompt_tokens += value.answered_prompt_tokens
        ooms = int(meta.get(OOM_KEY, 0))
        if ooms:
            self.oom_errors += ooms
            log(f"nanoserve: worker {sent.worker} ran out of device memory {ooms} time(s) on "
                f"batch {piece.pending.shard.shard_id}; the engine retried it in smaller "
                f"sub-batches")
        worker.batches += 1
        worker.rows += piece.size()
        worker.last_result_s = self.timeline.now()
        worker.result_s.append(worker.last_result_s)
        if value.record is not None:
            self.report.add(dataclasses.replace(value.record, worker=sent.worker,
                                                finished_s=worker.last_result_s))
        self.deaths_in_a_row = 0
        self._answer(piece, value)

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
        shard = suspect.pending.shard
        log(f"nanoserve: worker {index} died while running batch {shard.shard_id} "
            f"({suspect.size()} of its {shard.num_rows} rows): {cause}; replacing it")
        self.pool.replace(index)
        retry = [s.piece for s in failed[1:]] + self._blame(suspect, cause)
        self.queue.extendleft(reversed(retry))

    def _blame(self, piece: _Piece, cause: str) -> list[_Piece]:
        """A piece that was running when its worker died: what to send again (itself, or
        its two halves), or nothing when it is one row, which becomes an `error` row."""
        piece.deaths += 1
        if piece.deaths < (1 if piece.split else MAX_BATCH_ATTEMPTS):
            return [piece]
        lo, hi = piece.rows
        if hi - lo > 1:
            mid = lo + (hi - lo) // 2
            return [_Piece(piece.pending, (lo, mid), split=True, suspect=True),
                    _Piece(piece.pending, (mid, hi), split=True, suspect=True)]
        message = (f"the worker died while processing this row ({cause}); isolated after its "
                   f"batch killed the worker {MAX_BATCH_ATTEMPTS} times")
        self._answer(piece, self.local.run(piece.pending.shard, piece.rows, write=False,
                                           error=message))
        return []

    def _answer(self, piece: _Piece, outcome: ShardOutcome) -> None:
        """Count a piece's rows; record its shard once every row is answered (the worker
        wrote the part of a whole shard; the pieces of a cut one are joined here)."""
        pending = piece.pending
        self._count(outcome)
        pending.left -= piece.size()
        if outcome.table is not None:
            pending.tables[piece.rows[0]] = outcome.table
        if pending.left == 0:
            self._write(pending.shard, pending.tables)

    def _write(self, shard: Shard, tables: dict[int, pa.Table]) -> None:
        """The one place a shard's part is recorded in the manifest: written by its worker
        (`tables` empty), or written here first from its pieces' rows, in input order (with
        its OpenAI fragments, in a job that has them: `ShardRunner.commit`)."""
        if tables:
            table = pa.concat_tables([tables[k] for k in sorted(tables)])
            self.local.commit(shard, table)
            rows = table.num_rows
        else:
            rows = self.folder.parquet_num_rows(part_name(shard.shard_id))
        self.manifest.record(shard.shard_id, rows)
        self.manifest.save(self.folder)
        self.num_batches += 1
        self.written.add(shard.shard_id)
        _fault_hold_after_parts(len(self.written))

    def _count(self, out: ShardOutcome) -> None:
        self.rows += out.rows
        self.input_rows += out.input_rows
        self.error_rows += out.error_rows
        self.finish_reasons.update(out.finish_reasons)
        self.cut_constrained.update(out.cut_constrained)
        self.empty_answers += out.empty_answers
        self.input_tokens += out.input_tokens
        self.output_tokens += out.output_tokens
        self.truncated_rows += out.truncated
        self.report.written_rows(out.rows, out.errors)
        self.bar_rows += out.input_rows
        self._show()

    def _ask_progress(self) -> None:
        """With the bar on: read the workers' answers to `progress` (`ShardWorker.progress`)
        that are back, and ask each worker with pieces in flight again every
        PROGRESS_POLL_S. A worker that died answers nothing: its pieces count when they
        come back from another."""
        if self.bar is None or self.pool is None:
            return
        import ray

        if self.progress_asks:
            ready, _ = ray.wait(list(self.progress_asks), num_returns=len(self.progress_asks),
                                timeout=0)
            pieces = {(s.worker, s.piece.pending.shard.shard_id, *s.piece.rows): ref
                      for ref, s in self.in_flight.items()}
            for ask in ready:
                worker = self.progress_asks.pop(ask)
                try:
                    answer = ray.get(ask)
                except ray.exceptions.RayError:
                    continue
                for shard_id, lo, hi, rows, tokens in answer:
                    ref = pieces.get((worker, shard_id, lo, hi))
                    if ref is not None:  # (not back yet: its rows still count here)
                        self.partial[ref] = min(rows, hi - lo)
                        self.partial_tokens[ref] = tokens
        now = time.perf_counter()
        if now >= self.next_ask:
            self.next_ask = now + PROGRESS_POLL_S
            asked = set(self.progress_asks.values())
            for index, w in enumerate(self.pool.workers):
                if w.alive and w.in_flight and w.handle is not None and index not in asked:
                    self.progress_asks[w.handle.progress.remote()] = index
        self._show()

    def _show(self) -> None:
        """Move the bar to the rows answered so far (never back: a dead worker's finished
        rows are counted again when they come back) and show the rates."""
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        shown = SimpleNamespace(
            kind=self.kind, output_tokens=self.output_tokens + sum(self.partial_tokens.values()),
            input_rows=self.input_rows + sum(self.partial.values()),
            input_tokens=self.input_tokens)
        self.bar.set_postfix_str(_JobRun._rates(shown, elapsed), refresh=False)
        rows = self.bar_rows + sum(self.partial.values())
        if rows > self.bar.n:
            self.bar.update(rows - self.bar.n)  # (tqdm's rate and time left follow the rows)
        else:
            self.bar.refresh()  # the time since the start moves on

    def _rates(self, elapsed: float) -> str:
        """The progress bar's rates after `elapsed` seconds (the task's), from the counts
        `self` has (the run's, or those shown: the pieces in flight included)."""
        return self.kind.progress(self, elapsed)

    def _warnings(self) -> tuple[str, ...]:
        out = []
        if cut := sum(self.cut_constrained.values()):
            low, high = min(self.cut_constrained), max(self.cut_constrained)
            limit = f"max_tokens {low}" if low == high else f"max_tokens {low}-{high}"
            out.append(f"warning: {cut} constrained row(s) ended by length ({limit}): their "
                       f"text is cut short and need not match its constraint (JSON schema, "
                       f"regex or choice); raise --max-tokens")
        if self.empty_answers:
            out.append(f"warning: {self.empty_answers} row(s) ended with an empty answer "
                       f"(finish_reason 'stop', generated_text ''): the model ended them at "
                       f"once, as a chat model given a raw 'prompt' often does (give it "
                       f"'messages')")
        return tuple(out)

    def summary(self, wall_time_s: float) -> JobSummary:
        waste = 1 - self.padded_real / self.padded_slots if self.padded_slots else 0.0
        reasons = self.kind.finish_reasons
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
            finish_reasons={**dict.fromkeys(reasons, 0), **self.finish_reasons} if reasons else {},
            warnings=self._warnings(), task=self.kind.name, truncated_rows=self.truncated_rows,
            empty_answers=self.empty_answers,
        )


def make_fragments(shards: list[Shard], pool: WorkerPool | None, local: ShardRunner) -> None:
    """The OpenAI fragments of committed shards that lack them (a folder an earlier version
    wrote), each made from the shard's part by `ShardRunner.write_fragments`: on the live
    workers, a few shards each at a time, or here when no worker runs."""
    workers = [w.handle for w in pool.workers if w.alive] if pool is not None else []
    if not workers:
        for shard in shards:
            local.write_fragments(shard)
        return
    import ray

    step = FRAGMENT_SHARDS_A_WORKER * len(workers)
    for at in range(0, len(shards), step):
        refs = [workers[i % len(workers)].write_fragments.remote(shard)
                for i, shard in enumerate(shards[at:at + step])]
        try:
            ray.get(refs)
        except ray.exceptions.RayError as e:
            raise NanoserveError(f"a worker failed while writing the OpenAI output lines of "
                                 f"committed shards ({first_line(str(e))}); the job stopped "
                                 f"(rerun it to resume)") from None


def _fault_hold_after_parts(at: int | str) -> None:
    """Testing hook `NANOSERVE_FAULT_HOLD_AFTER_PARTS=<k>:<path>`: once this run has recorded
    its k-th part (`at`, or "last": once the walk has recorded every part of the job), the
    driver appends its pid to `<path>.holding` and waits while `<path>` exists (a test sends
    Ctrl-C at that moment)."""
    spec = os.environ.get(FAULT_HOLD_AFTER_PARTS)
    if not spec:
        return
    k, _, path = spec.partition(":")
    if k != str(at) or not os.path.exists(path):
        return
    with open(f"{path}.holding", "a") as f:
        f.write(f"{os.getpid()}\n")
    while os.path.exists(path):
        time.sleep(0.05)


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


__all__ = ["TASKS", "JobInterrupted", "JobOptions", "JobSummary", "WorkerReport", "run_batch_job",
           "run_embed_job", "run_job"]

