"""Stage dispatch: the job's driver, one for both tasks (generation, embedding). It moves
descriptors, never rows: it scans the input, hands shards to the Ray workers, and records
the shards whose parts are written.

    summary = run_job("prompts.jsonl", "out/", max_tokens=64)     # = run_batch_job
    summary = run_job("docs.jsonl", "vectors/", task="embed")     # = run_embed_job

Order of work (every job-level check comes before any model loads on a worker):
1. take the task's own options (`TaskKind.take_options`: `ray_jobs.tasks.generate`,
   `ray_jobs.tasks.embed`), check the job's (`JobOptions`); scan the input (files, schema,
   row count, where every `batch_size`-th JSONL row starts: a shard's first) and plan its
   columns;
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

Nothing lost, nothing duplicated: the walk over the shards, their spans, retries and
progress are `ray_jobs.dispatch.job_run`.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve import InputError, NanoserveError, resolve_model
from ray_jobs.dispatch.job_run import _fault_hold_after_parts, _JobRun
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
    hold_output_dir,
    input_identity,
    mark_complete,
    model_identity,
    open_output_dir,
    part_name,
    reopen_shards_with_errors,
)
from ray_jobs.output.openai_files import OUTPUT_NAME, OpenAIOutput, write_outputs
from ray_jobs.preparation.prepare import load_model_meta, plan_columns
from ray_jobs.report.report import JobTotals, ReportLog, report_data, write_report
from ray_jobs.report.timeline import PHASES, Timeline
from ray_jobs.tasks.classify import CLASSIFY, SCORE
from ray_jobs.tasks.embed import EMBED
from ray_jobs.tasks.generate import GENERATE
from ray_jobs.workers.options import JobOptions
from ray_jobs.workers.tasks import JobSpec, ShardRunner, TaskKind, TaskPlan

TASKS = {kind.name: kind for kind in (GENERATE, EMBED, CLASSIFY, SCORE)}  # run_job's `task`
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
    num_shards: int  # shards this run wrote
    workers: tuple[WorkerReport, ...] = ()
    worker_restarts: int = 0  # workers that died and were replaced
    device_oom_errors: int = 0  # device out-of-memory errors the engine retried smaller
    # Seconds per phase of this run, in order (see `PHASES`); they add up to wall_time_s.
    # A phase the run never reached (nothing left to compute: no Ray, no worker) is absent.
    timings: dict[str, float] = field(default_factory=dict)
    report: str | None = None  # the run's HTML report (`ray_jobs.report.report`), when it wrote one
    # Prompt tokens served from the workers' prefix caches / prompt tokens of the spans
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
    # Ctrl-C stopped the run: (shards written in all, the job's shards); None: it did not
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
            f"shards: {self.num_shards} on {len(self.workers)} worker(s); output: {self.output_dir}",
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
                         f"their shards ran again on other workers")
        if self.timings:
            lines.append("time: " + ", ".join(f"{PHASES[k]} {v:.1f} s"
                                              for k, v in self.timings.items()))
        lines += self.warnings
        if self.interrupted is not None:
            lines.append(f"interrupted: {self.interrupted[0]} of {self.interrupted[1]} "
                         f"shards are written; rerun the same command to resume")
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
    """Run the job of `nanoserve batch` (task "generate"), `nanoserve embed` ("embed"),
    `nanoserve classify` ("classify") or `nanoserve score` ("score") on INPUT into
    OUTPUT_DIR; see the module docstring. `options`: `JobOptions`'
    fields and the task's own (`EMBED_OPTIONS`, `CLASSIFY_OPTIONS`). Job-level problems raise `NanoserveError`
    (InputError, ModelError) before any worker starts; row-level problems become `error`
    rows."""
    timeline = Timeline(time.perf_counter())
    if task not in TASKS:
        raise InputError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    kind = TASKS[task]
    options = dict(options)
    own = kind.take_options(options)
    opts = JobOptions(**options)  # (checked before the scan)
    info = scan_input(input, opts.chunk_rows, opts.id_column, opts.input_format,
                      shard_rows=opts.batch_size)
    opts = dataclasses.replace(opts, prompt_column=kind.prompt_column(opts.prompt_column,
                                                                      info.schema.names))
    plan = plan_columns(info.schema, opts.prompt_column, opts.id_column)
    model_path = resolve_model(opts.model)
    config, tokenizer = (kind.load_meta or load_model_meta)(model_path)
    task_plan = kind.plan(opts, own, info, plan, model_path, config, tokenizer)
    settings = {**_job_settings(task_plan.opts, info, model_path, plan), **task_plan.settings}
    folder = OutputDir.open(output_dir)  # a local folder or an object-store prefix
    openai = OpenAIOutput.of(opts.model, settings) if task_plan.openai_output else None
    spec = JobSpec(kind.name, InputSpec.of(info, opts.chunk_rows), plan, task_plan.schema,
                   folder, task_plan.controls, task_plan.task_options, openai)
    return run_pipeline(Pipeline(task_plan.opts, info, output_dir, folder, settings, spec,
                                 ShardRunner(spec, task_plan.task), kind, task_plan), timeline)


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
    engine (`local`, for error rows made on the driver), the task (`kind`) and its plan of
    the job (`task_plan`: its actor, what the report shows, its summary fields, what it
    writes before the folder is marked complete)."""

    opts: JobOptions
    info: InputInfo
    output_dir: str | Path
    folder: OutputDir
    settings: dict[str, Any]
    spec: JobSpec
    local: ShardRunner
    kind: TaskKind
    task_plan: TaskPlan


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
    for warning in p.task_plan.warnings:  # at once: before the user waits for the job
        log(warning)
    if folder.local:  # named as the user gave it (a path, or its file:// URI's path)
        check_output_reachable(folder.path if is_uri(p.output_dir) else Path(p.output_dir))
    held = _HeldInterrupts()
    try:
        with ExitStack() as stack:
            stack.enter_context(hold_output_dir(folder))  # one job per output folder at a time
            manifest = open_output_dir(folder, p.settings, opts.overwrite)
            retry = reopen_shards_with_errors(folder, manifest) if opts.retry_errors else set()
            if retry:
                log(f"nanoserve: --retry-errors: computing again {len(retry)} shard(s) of an "
                    f"earlier run that hold error rows")
            if manifest.complete:
                held.hold()
                return _rerun_of_complete(p, manifest, timeline)

            def start_pool() -> WorkerPool:  # on the first shard that needs a worker
                timeline.mark("prepare")
                stack.enter_context(RaySession(opts.address))
                timeline.mark("ray")
                pool = WorkerPool.start(opts, timeline, actor=p.task_plan.actor,
                                        actor_kwargs={**p.task_plan.actor_kwargs,
                                                      "spec": p.spec})
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
        summary = _run_summary(run, timeline.marks["shutdown"])
        for warning in summary.warnings:
            log(warning)
        summary = dataclasses.replace(
            summary, warnings=p.task_plan.warnings + summary.warnings, **p.task_plan.summary,
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
                         warnings=p.task_plan.warnings, **p.task_plan.summary)
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
                "input": p.settings["input"], **p.task_plan.report_settings}
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
                  plan: Any = None) -> dict[str, Any]:
    """What the manifest compares on resume: everything that changes the output rows (the
    shards' rows: `batch_size`, under the manifest's older name "batching"). The output
    controls appear only when set (`n` above 1, logprobs asked, a job-wide structured
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
        "batching": {"batch_size": opts.batch_size, "max_batch_tokens": opts.max_batch_tokens},
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


def _run_summary(run: _JobRun, wall_time_s: float) -> JobSummary:
    """The summary of one pass over the shards (`run`), its counts after `wall_time_s`."""
    waste = 1 - run.padded_real / run.padded_slots if run.padded_slots else 0.0
    reasons = run.kind.finish_reasons
    return JobSummary(
        output_dir=str(run.folder), rows=run.rows, error_rows=run.error_rows,
        rows_resumed=run.rows_resumed, input_tokens=run.input_tokens,
        output_tokens=run.output_tokens, wall_time_s=wall_time_s,
        output_tokens_per_s=run.output_tokens / wall_time_s if wall_time_s > 0 else 0.0,
        padding_waste=waste, num_shards=run.num_shards,
        prefix_hit_rate=(run.cached_tokens / run.cached_prompt_tokens
                         if run.cached_prompt_tokens else 0.0)
        if run.any_prefix_cache else None,
        workers=run.pool.reports() if run.pool is not None else (),
        worker_restarts=sum(w.restarts for w in run.pool.workers) if run.pool is not None else 0,
        device_oom_errors=run.oom_errors, timings=run.timeline.timings(),
        nodes_lost=run.pool.lost_nodes() if run.pool is not None else (),
        input_rows=run.input_rows,
        finish_reasons={**dict.fromkeys(reasons, 0), **run.finish_reasons} if reasons else {},
        warnings=run._warnings(), task=run.kind.name, truncated_rows=run.truncated_rows,
        empty_answers=run.empty_answers,
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


__all__ = ["TASKS", "JobInterrupted", "JobOptions", "JobSummary", "WorkerReport", "run_batch_job",
           "run_embed_job", "run_job"]
