"""Stage workers: a shard's walk on the worker that holds the engine, and what a task of
the job (generation, `ray_jobs.tasks.generate`; embedding, `ray_jobs.tasks.embed`) plugs
into it and into the driver.

    read (ray_jobs.input.shards.read_shard) -> prepare (the task's preparer: images read and
    decoded, tokenize, chat template, constraints) -> run (the task's engine call) ->
    assemble (`id`, the input columns, the task's result columns, in input order) -> write
    the part (the job's OutputDir, local or object storage; in a job with OpenAI output
    files, the shard's lines of them first, `commit`)

`ShardRunner.run` is that walk; it returns the shard's counts (`ShardOutcome`), a few
hundred bytes whatever its rows, and the table itself only when asked (a span, a half of a
shard that was cut after killing its workers: the driver joins the spans and writes the
part). The driver runs the same walk without an engine (`error=`) to make the `error` rows
of a row isolated as a worker killer: the rows are read again there, a shard at a time. The
Ray Data processor (`ray_jobs.data_processor`) answers a dataset's batch with the same
`answer_rows`.

A task says only what differs, on the worker (its plug-in: `GenerateTask`, `EmbedTask`):
how rows are prepared, how the prepared rows are cut into the engine's batches and run, and
what a row's result columns hold
(its error rows included); and on the driver (`TaskKind`, `TaskPlan`): its own options, its
output schema and manifest settings, its actor, its progress and summary lines. Everything
else (reading, ids, error rows never sent to the engine, input order, counts, the report's
record, the part and its digest; the driver's walk, `ray_jobs.dispatch.driver.run_pipeline`) is the
job's, once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from nanoserve import NanoserveError, first_line
from ray_jobs.input.shards import InputSpec, Shard, read_shard
from ray_jobs.input.storage import OutputDir
from ray_jobs.output.manifest import BESIDE_DIGEST_KEY, PART_DIGEST_KEY, beside_digest, part_name
from ray_jobs.output.openai_files import (
    OpenAIOutput,
    TokenText,
    format_shard,
    fragment_names,
    part_columns,
)
from ray_jobs.preparation.prepare import ColumnPlan

if TYPE_CHECKING:
    from ray_jobs.workers.options import JobOptions


@dataclass(frozen=True)
class JobSpec:
    """What every worker needs to run any shard of the job, sent once when its actor
    starts: the input, the column plan, the output schema and folder, the task's own
    options (`task_options`: generation's sampling defaults, chat-template options and
    batch-token limit, the reasoning parser being its engine's; embedding's limit,
    instruction, truncation and vector dtype), and
    for a job that writes OpenAI output files what their lines need (`openai`)."""

    task: str  # "generate", "embed", "classify" or "score"
    input: InputSpec
    plan: ColumnPlan
    schema: pa.Schema  # the parts' schema: id, input columns, the task's result columns
    folder: OutputDir
    controls: tuple[str, ...] = ()
    task_options: dict[str, Any] = field(default_factory=dict)
    openai: OpenAIOutput | None = None  # None: the job writes no OpenAI output files


@dataclass
class ShardOutcome:
    """What a worker answers for a span: a shard, or a half of one (`rows`)."""

    shard_id: int
    rows: int = 0  # output rows: one per sample
    input_rows: int = 0
    error_rows: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    truncated: int = 0  # embedding: inputs cut to the limit
    finish_reasons: Counter = field(default_factory=Counter)
    cut_constrained: Counter = field(default_factory=Counter)  # by max_tokens
    empty_answers: int = 0  # generation: rows that ended at 'stop' with no text
    errors: list[str] = field(default_factory=list)  # each error row's message
    meta: dict[bytes, bytes] = field(default_factory=dict)  # the engine's (ray_jobs.workers.worker keys)
    record: Any = None  # the report's `SpanRecord` (None: nothing went to the engine)
    answered_prompt_tokens: int = 0  # prompt tokens of the rows the engine answered
    table: pa.Table | None = None  # the rows, when not written by the worker


@dataclass(frozen=True)
class TaskPlan:
    """A task's part of one job, planned on the driver once the input is scanned and the
    model's config and tokenizer are read (`TaskKind.plan`)."""

    opts: JobOptions  # the job's options as the workers get them
    schema: pa.Schema  # the parts' schema: id, input columns, the task's result columns
    task: Any  # the task plug-in for the driver's own walk (its error rows)
    actor: type  # the job's actor class (a `ShardWorker`)
    controls: tuple[str, ...] = ()  # generation's output controls (`prepare.output_controls`)
    task_options: dict[str, Any] = field(default_factory=dict)  # `JobSpec.task_options`
    actor_kwargs: dict[str, Any] = field(default_factory=dict)  # beside the job's worker options
    settings: dict[str, Any] = field(default_factory=dict)  # the manifest's, beside the job's
    report_settings: dict[str, Any] = field(default_factory=dict)  # the report's, beside the job's
    summary: dict[str, Any] = field(default_factory=dict)  # `JobSummary` fields the task sets
    # one line each, printed before the job starts and kept in the summary: what the job
    # would otherwise ignore silently (a misspelt per-row column, unread template options)
    warnings: tuple[str, ...] = ()
    # generation's OpenAI output files (`ray_jobs.output.openai_files`): each shard's lines written
    # with its part, joined by the driver at the end
    openai_output: bool = False


@dataclass(frozen=True)
class TaskKind:
    """A task as the job's driver sees it (`ray_jobs.dispatch.driver.run_job` calls these in this
    order): `take_options(options)` pops the task's own options from the job's keyword
    arguments, checks them and sets its defaults of the job's (the prefill-only tasks'
    shards are larger); `prompt_column(given, names)` the input column to read when none is given
    (before any column is planned); `plan(opts, own, info, plan, model_path, config,
    tokenizer)` the rest, a `TaskPlan`. `progress(run, elapsed)`: the progress bar's rates
    from the run's counts; `summary_lines(summary)`: what the summary says between its rows
    line and its shards line."""

    name: str  # `run_job(task=...)`: "generate", "embed", "classify" or "score"
    command: str  # its `nanoserve` subcommand (the progress bar's name)
    # the finish reasons the summary counts, always, in this order (none: the task's output
    # has no finish_reason column)
    finish_reasons: tuple[str, ...]
    take_options: Callable[[dict[str, Any]], dict[str, Any]]
    prompt_column: Callable[[str | None, list[str]], str | None]
    plan: Callable[..., TaskPlan]
    progress: Callable[[Any, float], str]
    summary_lines: Callable[[Any], list[str]]
    # the model's config and tokenizer from its path (None: a decoder's,
    # `ray_jobs.preparation.prepare.load_model_meta`; the encoder tasks read their own)
    load_meta: Callable[[Any], tuple[Any, Any]] | None = None


def prefill_progress(run: Any, elapsed: float) -> str:
    """The progress bar's rates of a task without generation (embed, classify, score) after
    `elapsed` seconds: rows and input tokens a second."""
    return (f"{run.input_rows / elapsed:.1f} rows/s, "
            f"{run.input_tokens / elapsed:.1f} input tok/s")


def prefill_summary_lines(s: Any, tokens_line: str) -> list[str]:
    """The summary's lines of a task without generation (`JobSummary.format`): the rows cut
    to the input limit, `tokens_line` (the task's own), the wall time with its rates."""
    rate = s.rows / s.wall_time_s if s.wall_time_s > 0 else 0.0
    tok = s.input_tokens / s.wall_time_s if s.wall_time_s > 0 else 0.0
    return [f"truncated: {s.truncated_rows} row(s) cut to the input limit", tokens_line,
            f"wall time: {s.wall_time_s:.1f} s, {rate:.1f} rows/s, {tok:.1f} tokens/s"]


def answer_rows(task: Any, rows: list[Any], error: str | None = None
                ) -> tuple[list[list[dict[str, Any]]], pa.Table | None, list[int]]:
    """Each prepared row's results (a row's samples), in input order: error rows for the
    rows that failed preparation (never sent to the engine) and, with `error`, for every
    row; the others run by the task's engine in its batches (`task.batches`: one call
    each). Returns (results, the engine's joined table or None, the indices of the rows the
    engine answered)."""
    results: list[list[dict[str, Any]] | None] = [None] * len(rows)
    todo = []
    for i, r in enumerate(rows):
        if r.error is not None:
            results[i] = task.error_results(r.error, r)
        elif error is not None:
            results[i] = task.error_results(error, r)
        else:
            todo.append(i)
    if not todo:
        return results, None, []
    run_rows = [rows[i] for i in todo]
    batches = task.batches(run_rows)
    order = [i for b in batches for i in b]
    table = join_tables([task.engine(task.requests([run_rows[i] for i in b]))
                         for b in batches])
    todo, run_rows = [todo[i] for i in order], [run_rows[i] for i in order]
    for i, res in zip(todo, task.results(table, run_rows), strict=True):
        results[i] = res
    return results, table, todo


class ShardRunner:
    """A shard's walk (see the module docstring) for one job and one task instance."""

    def __init__(self, spec: JobSpec, task: Any) -> None:
        self.spec = spec
        self.task = task
        self.input_fields = spec.plan.passthrough_fields(spec.controls)
        self._token: TokenText | None = None  # token texts for logprobs, cached per runner

    def run(self, shard: Shard, rows: tuple[int, int] | None = None, write: bool = True,
            error: str | None = None) -> ShardOutcome:
        """Read, prepare and run the shard's rows [rows[0], rows[1]) (None: all), then
        write its part (`write`) or return the table. `error`: run nothing, every row
        becomes an error row with that message (the driver's isolated rows; their images
        are not read)."""
        prepared = self._prepare(shard, rows, read_images=error is None)
        out = ShardOutcome(shard.shard_id)
        results, table, answered = answer_rows(self.task, prepared, error)
        if table is not None:
            out.meta = dict(table.schema.metadata or {})
            from ray_jobs.workers.span import span_record

            out.record = span_record(shard.shard_id, 0, 0.0, table)
            out.answered_prompt_tokens = sum(results[i][0]["num_input_tokens"] or 0
                                             for i in answered)
        table = self._assemble(prepared, results)
        self._count(out, prepared, results)
        if write:
            self.commit(shard, table)
        else:
            out.table = table
        return out

    def commit(self, shard: Shard, table: pa.Table) -> None:
        """Write the shard's part: in a job with OpenAI output files, its fragments first
        (`write_fragments`), then the part, whose footer names the shard and the
        fragments' bytes (`ray_jobs.output.manifest.adopt_part`): a part in the folder has its
        fragments beside it, written from the same rows."""
        beside = self.write_fragments(shard, table) if self.spec.openai is not None else None
        self.spec.folder.write_parquet(part_name(shard.shard_id),
                                       with_digest(table, shard, beside))

    def write_fragments(self, shard: Shard, table: pa.Table | None = None) -> str:
        """Write the shard's lines of output.jsonl and of errors.jsonl
        (`ray_jobs.output.openai_files.format_shard`) beside its part, from its rows `table`, or
        else from its part read back (a shard committed without them, by an earlier
        version). Returns their digest (`ray_jobs.output.manifest.beside_digest`)."""
        if table is None:
            table = self.spec.folder.read_parquet(
                part_name(shard.shard_id), part_columns(self.spec.schema.names, self.spec.plan))
        if self._token is None:
            self._token = TokenText(self.task.preparer.tokenizer)
        blobs = format_shard(table, shard.first_position, self.spec.plan, self.spec.openai,
                             self._token)
        for name, data in zip(fragment_names(shard.shard_id), blobs, strict=True):
            self.spec.folder.write_bytes(name, data)
        return beside_digest(list(blobs))

    def beside_part(self, shard_id: int) -> tuple[str, ...]:
        """The files committed with the shard's part: its OpenAI fragments (none in a job
        without OpenAI output files)."""
        return fragment_names(shard_id) if self.spec.openai is not None else ()

    def _prepare(self, shard: Shard, rows: tuple[int, int] | None,
                 read_images: bool = True) -> list[Any]:
        prepared, position = [], shard.first_position
        lo, hi = rows if rows is not None else (0, shard.num_rows)
        for chunk in read_shard(self.spec.input, shard):
            n = chunk.batch.num_rows
            at = position - shard.first_position  # the chunk's first row within the shard
            if at + n > lo and at < hi:
                a, b = max(lo - at, 0), min(hi - at, n)
                keep = chunk if (a, b) == (0, n) else _slice_chunk(chunk, a, b)
                prepared += self.task.preparer.prepare(keep, position + a, read_images)
            position += n
        if len(prepared) != hi - lo:
            raise NanoserveError(f"shard {shard.shard_id} read {len(prepared)} rows, expected "
                                 f"{hi - lo}: the input changed since the job scanned it")
        return prepared

    def _assemble(self, rows: list[Any], results: list[list[dict[str, Any]]]) -> pa.Table:
        """`id`, the input columns, then the results: one output row per sample of each row
        (its id and input columns repeated), in input order."""
        schema = self.spec.schema
        repeated = [r for r, samples in zip(rows, results) for _ in samples]
        flat = [res for samples in results for res in samples]
        arrays = [pa.array([r.id for r in repeated], type=schema.field("id").type)]
        arrays += [pa.array([r.values[f.name] for r in repeated], type=f.type)
                   for f in self.input_fields]
        arrays += [result_column([res.get(f.name) for res in flat], f.type)
                   for f in list(schema)[len(arrays):]]
        return pa.Table.from_arrays(arrays, schema=schema)

    def _count(self, out: ShardOutcome, rows: list[Any],
               results: list[list[dict[str, Any]]]) -> None:
        for row, samples in zip(rows, results):
            out.input_rows += 1
            out.rows += len(samples)
            out.input_tokens += samples[0].get("num_input_tokens") or 0
            for res in samples:
                out.finish_reasons[res["finish_reason"]] += 1
                out.output_tokens += res.get("num_generated_tokens") or 0
                if res["finish_reason"] == "error":
                    out.error_rows += 1
                    out.errors.append(res["error"] or "")
            self.task.count(out, row, samples)


def result_column(values: list[Any], typ: pa.DataType) -> pa.Array:
    """A result column; vectors (numpy rows, None for a failed row) as one buffer."""
    if pa.types.is_fixed_size_list(typ) and values and any(v is not None for v in values):
        import numpy as np

        dim = typ.list_size
        flat = np.zeros((len(values), dim), dtype=typ.value_type.to_pandas_dtype())
        for i, v in enumerate(values):
            if v is not None:
                flat[i] = v
        mask = pa.array([v is None for v in values], pa.bool_())
        return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1), typ.value_type),
                                                 dim, mask=mask)
    return pa.array(values, type=typ)


def join_tables(tables: list[pa.Table]) -> pa.Table:
    """The engine's answers to a span's batches as one table: their rows in call order, the
    counters in their footers summed (the engine's own counters: the last call's)."""
    if len(tables) == 1:
        return tables[0]
    from ray_jobs.workers.worker import ENGINE_KEY

    meta: dict[bytes, bytes] = {}
    for t in tables:
        for k, v in (t.schema.metadata or {}).items():
            meta[k] = v if k == ENGINE_KEY or k not in meta else str(int(meta[k]) + int(v)).encode()
    joined = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return joined.replace_schema_metadata(meta)


def with_digest(table: pa.Table, shard: Shard, beside: str | None = None) -> pa.Table:
    """The part's table with the shard's digest in its footer, and `beside`, the digest of
    the files committed with it, when there are (`ray_jobs.output.manifest`)."""
    meta = {PART_DIGEST_KEY: shard.digest().encode()}
    if beside is not None:
        meta[BESIDE_DIGEST_KEY] = beside.encode()
    return table.replace_schema_metadata(meta)


def _slice_chunk(chunk: Any, a: int, b: int) -> Any:
    from ray_jobs.input.files import InputChunk

    errors = {i - a: e for i, e in chunk.row_errors.items() if a <= i < b}
    return InputChunk(chunk.batch.slice(a, b - a), chunk.file, errors, chunk.lines[a:b],
                      chunk.openai_rows)


class ShardWorker:
    """What makes an engine worker (`BatchWorker`, `EmbedWorker`) a job actor: the job's
    spec given at start (`spec`), `run_shard`, and a model that fails to load reported by
    `info()` as a message (a clean job-level error) rather than as a crashed actor. The
    actor class says which task it runs (`make_task`), and whether its engine admits rows
    as others finish (`admits_rows`: then a worker holding too few rows starves it, and
    the pool warns when the user's settings do)."""

    admits_rows = False

    def __init__(self, *args: Any, spec: JobSpec | None = None, **kwargs: Any) -> None:
        self.spec = spec
        self.load_error: str | None = None
        self._runner: ShardRunner | None = None
        self._runner_lock = threading.Lock()
        self._spans: dict[int, tuple[int, int, int]] = {}  # by thread: (shard id, lo, hi)
        try:
            super().__init__(*args, **kwargs)
        except NanoserveError as e:
            self.load_error = str(e)
        except Exception as e:  # torch, CUDA, files: whatever stops the model loading here
            self.load_error = f"{type(e).__name__}: {first_line(str(e))}"

    def info(self) -> dict[str, Any]:
        import ray

        if self.load_error is not None:
            return {"load_error": self.load_error}
        return {**super().info(), "node_id": ray.get_runtime_context().get_node_id()}

    def run_shard(self, shard: Shard, rows: tuple[int, int] | None = None,
                  write: bool = True) -> ShardOutcome:
        me = threading.get_ident()
        self._spans[me] = (shard.shard_id, *(rows or (0, shard.num_rows)))
        try:
            return self._shard_runner().run(shard, rows, write)
        finally:
            del self._spans[me]

    def progress(self) -> list[tuple[int, int, int, int, int]]:
        """The spans running here whose engine shows how far it is: (shard id, first row,
        end row, rows finished, their output tokens) each. The actor has a thread more than
        the spans it holds, so this answers while they run."""
        rows_finished = getattr(self, "rows_finished", None)  # the engine worker's, if any
        out = []
        for thread, span in list(self._spans.items()):
            done = rows_finished(thread) if rows_finished is not None else None
            if done is not None:
                out.append((*span, *done))
        return out

    def write_fragments(self, shard: Shard) -> str:
        """`ShardRunner.write_fragments` of a committed shard, from its part."""
        return self._shard_runner().write_fragments(shard)

    def _shard_runner(self) -> ShardRunner:
        with self._runner_lock:  # actor threads share one runner, made at the first call
            if self._runner is None:
                self._runner = ShardRunner(self.spec, self.make_task(self.spec))
        return self._runner
