"""Stage 3, workers: a shard's walk on the worker that holds the engine, and the job's two
tasks (generation, embedding) as plug-ins of it.

    read (ray_jobs.shards.read_shard) -> prepare (the task's preparer: images read and
    decoded, tokenize, chat template, constraints) -> run (the task's engine call) ->
    assemble (`id`, the input columns, the task's result columns, in input order) -> write
    the part (the job's OutputDir, local or object storage)

`ShardRunner.run` is that walk; it returns the shard's counts (`ShardOutcome`), a few
hundred bytes whatever its rows, and the table itself only when asked (a piece of a shard
that was cut after killing its workers: the driver joins the pieces and writes the part).
The driver runs the same walk without an engine (`error=`) to make the `error` rows of a
row isolated as a worker killer: the rows are read again there, a shard at a time.

A task (`GenerateTask` here, `ray_jobs.embed_job.EmbedTask`) says only what differs: how rows are prepared, how
the prepared rows are run, and what a row's result columns hold (its error rows included).
Everything else (reading, ids, error rows never sent to the engine, input order, counts,
the report's record, the part and its digest) is this module's, once.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from nanoserve.errors import NanoserveError, first_line
from ray_jobs.manifest import PART_DIGEST_KEY, part_name
from ray_jobs.prepare import ColumnPlan
from ray_jobs.shards import InputSpec, Shard, read_shard
from ray_jobs.storage import OutputDir


@dataclass(frozen=True)
class JobSpec:
    """What every worker needs to run any shard of the job, sent once when its actor
    starts: the input, the column plan, the output schema and folder, and the task's own
    options (`task_options`: generation's sampling defaults, chat-template options and
    reasoning parser; embedding's limit, instruction, truncation and vector dtype)."""

    task: str  # "generate" or "embed"
    input: InputSpec
    plan: ColumnPlan
    schema: pa.Schema  # the parts' schema: id, input columns, the task's result columns
    folder: OutputDir
    controls: tuple[str, ...] = ()
    task_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShardOutcome:
    """What a worker answers for a shard, or a piece of one (`rows`)."""

    shard_id: int
    rows: int = 0  # output rows: one per sample
    input_rows: int = 0
    error_rows: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    truncated: int = 0  # embedding: inputs cut to the limit
    finish_reasons: Counter = field(default_factory=Counter)
    cut_constrained: Counter = field(default_factory=Counter)  # by max_tokens
    errors: list[str] = field(default_factory=list)  # each error row's message
    meta: dict[bytes, bytes] = field(default_factory=dict)  # the engine's (ray_jobs.worker keys)
    record: Any = None  # the report's `PieceRecord` (None: nothing went to the engine)
    answered_prompt_tokens: int = 0  # prompt tokens of the rows the engine answered
    table: pa.Table | None = None  # the rows, when not written by the worker


class GenerateTask:
    """Generation: rows prepared by `ray_jobs.prepare.RowPreparer`, run by
    `BatchWorker.run_batch`, one result row per sample; a reasoning parser splits the
    think block off after."""

    verb = "generation"  # in the message of rows whose run raised

    def __init__(self, spec: JobSpec, tokenizer: Any, config: Any, engine: Any = None,
                 grammars: Any = None, preparer: Any = None,
                 static_rows: int | None = None, images: Any = None) -> None:
        """`static_rows`: the most rows a static engine runs at once (None: a continuous
        engine, or none); `images`: the model's `ray_jobs.row_images.ModelImages` (None: it
        takes no images)."""
        from ray_jobs.prepare import RowPreparer

        opts = spec.task_options
        eos = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids)))
        self.preparer = preparer or RowPreparer(
            spec.plan, tokenizer, config.max_position_embeddings, config.vocab_size,
            opts["defaults"], eos_token_ids=eos, grammars=grammars,
            chat_template_kwargs=opts.get("chat_template_kwargs"), images=images)
        self.engine = engine
        self.static_rows = static_rows
        self.max_batch_tokens = opts.get("max_batch_tokens")
        self.reasoning = None
        if opts.get("reasoning_parser"):
            from nanoserve.reasoning import ReasoningParser

            self.reasoning = ReasoningParser(opts["reasoning_parser"], tokenizer)

    def groups(self, rows: list[Any]) -> list[list[int]]:
        """The engine calls for `rows` (indices into them): one of all the rows, in input
        order, for a continuous engine (it admits rows as others finish); for a static one
        the rows sorted by prompt length, longest first, and cut at `static_rows` samples
        and the job's `max_batch_tokens` (`ray_jobs.batching.cut_window`): a static batch
        is padded to its longest row and runs until its last row ends."""
        if self.static_rows is None:
            return [list(range(len(rows)))]
        from ray_jobs.batching import BatchLimits, cut_window

        limits = BatchLimits(self.static_rows, self.max_batch_tokens, max(1, len(rows)))
        at = {id(r): i for i, r in enumerate(rows)}
        return [[at[id(r)] for r in group] for group in cut_window(rows, limits)]

    def requests(self, rows: list[Any]) -> list[Any]:
        from ray_jobs.worker import GenerationRequest

        return [GenerationRequest(r.prompt_token_ids, r.params, r.images) for r in rows]

    def results(self, table: pa.Table, rows: list[Any]) -> list[list[dict[str, Any]]]:
        """The engine's table as each row's samples' results."""
        out = _per_row(table.to_pylist(), [r.n for r in rows])
        if self.reasoning is not None:
            out = [[split_reasoning(self.reasoning, r.prompt_token_ids, res) for res in samples]
                   for r, samples in zip(rows, out)]
        return out

    def error_results(self, message: str, row: Any) -> list[dict[str, Any]]:
        from ray_jobs.worker import error_rows

        return error_rows(message, row.num_prompt_tokens, row.n)

    def count(self, out: ShardOutcome, row: Any, samples: list[dict[str, Any]]) -> None:
        if row.params is not None and row.params.structured_outputs is not None:
            cut = sum(res["finish_reason"] == "length" for res in samples)
            if cut:
                out.cut_constrained[row.params.max_tokens] += cut




class ShardRunner:
    """A shard's walk (see the module docstring) for one job and one task instance."""

    def __init__(self, spec: JobSpec, task: Any) -> None:
        self.spec = spec
        self.task = task
        self.input_fields = spec.plan.passthrough_fields(spec.controls)

    def run(self, shard: Shard, rows: tuple[int, int] | None = None, write: bool = True,
            error: str | None = None) -> ShardOutcome:
        """Read, prepare and run the shard's rows [rows[0], rows[1]) (None: all), then
        write its part (`write`) or return the table. `error`: run nothing, every row
        becomes an error row with that message (the driver's isolated rows; their images
        are not read)."""
        prepared = self._prepare(shard, rows, read_images=error is None)
        out = ShardOutcome(shard.shard_id)
        results: list[list[dict[str, Any]] | None] = [None] * len(prepared)
        todo = []
        for i, r in enumerate(prepared):
            if r.error is not None:
                results[i] = self.task.error_results(r.error, r)
            elif error is not None:
                results[i] = self.task.error_results(error, r)
            else:
                todo.append(i)
        if todo:
            run_rows = [prepared[i] for i in todo]
            groups = self.task.groups(run_rows)
            order = [i for g in groups for i in g]
            table = join_tables([self.task.engine(self.task.requests([run_rows[i] for i in g]))
                                 for g in groups])
            todo, run_rows = [todo[i] for i in order], [run_rows[i] for i in order]
            out.meta = dict(table.schema.metadata or {})
            from ray_jobs.report import piece_record

            out.record = piece_record(shard.shard_id, 0, 0.0, table)
            for i, res in zip(todo, self.task.results(table, run_rows), strict=True):
                results[i] = res
                out.answered_prompt_tokens += res[0]["num_input_tokens"] or 0
        table = self._assemble(prepared, results)
        self._count(out, prepared, results)
        if write:
            self.spec.folder.write_parquet(part_name(shard.shard_id), with_digest(table, shard))
        else:
            out.table = table
        return out

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
        arrays += [_column([res.get(f.name) for res in flat], f.type)
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


def _column(values: list[Any], typ: pa.DataType) -> pa.Array:
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
    """The engine's answers to a shard's calls as one table: their rows in call order, the
    counters in their footers summed (the engine's own counters: the last call's)."""
    if len(tables) == 1:
        return tables[0]
    from ray_jobs.worker import ENGINE_KEY

    meta: dict[bytes, bytes] = {}
    for t in tables:
        for k, v in (t.schema.metadata or {}).items():
            meta[k] = v if k == ENGINE_KEY or k not in meta else str(int(meta[k]) + int(v)).encode()
    joined = pa.concat_tables([t.replace_schema_metadata(None) for t in tables])
    return joined.replace_schema_metadata(meta)


def with_digest(table: pa.Table, shard: Shard) -> pa.Table:
    """The part's table with the shard's digest in its footer (`ray_jobs.manifest`)."""
    return table.replace_schema_metadata({PART_DIGEST_KEY: shard.digest().encode()})


def _slice_chunk(chunk: Any, a: int, b: int) -> Any:
    from ray_jobs.io import InputChunk

    errors = {i - a: e for i, e in chunk.row_errors.items() if a <= i < b}
    return InputChunk(chunk.batch.slice(a, b - a), chunk.file, errors, chunk.lines[a:b],
                      chunk.openai_rows)


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


def split_reasoning(parser: Any, prompt_ids: Any, res: dict[str, Any]) -> dict[str, Any]:
    """A result row with its think block split off (`nanoserve.reasoning`): `reasoning`
    (null where the output has no block), `num_reasoning_tokens`, and `generated_text` the
    answer only (empty when the block never closed: finish_reason stays as the row ended,
    'length' when it hit max_tokens while thinking). Error rows pass unchanged."""
    if res["finish_reason"] == "error" or res["generated_token_ids"] is None:
        return res
    reasoning, answer, n, _ = parser.split_text(prompt_ids, res["generated_token_ids"])
    return {**res, "generated_text": answer, "reasoning": reasoning, "num_reasoning_tokens": n}


class ShardWorker:
    """What makes an engine worker (`BatchWorker`, `EmbedWorker`) a job actor: the job's
    spec given at start (`spec`), `run_shard`, and a model that fails to load reported by
    `info()` as a message (a clean job-level error) rather than as a crashed actor. The
    engine class says which task it runs (`make_task`)."""

    def __init__(self, *args: Any, spec: JobSpec | None = None, **kwargs: Any) -> None:
        self.spec = spec
        self.load_error: str | None = None
        self._runner: ShardRunner | None = None
        self._runner_lock = threading.Lock()
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
        with self._runner_lock:  # actor threads share one runner, made at the first shard
            if self._runner is None:
                self._runner = ShardRunner(self.spec, self.make_task(self.spec))
        return self._runner.run(shard, rows, write)
