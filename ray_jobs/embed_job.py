"""Embedding jobs: `ray_jobs.run_batch_job(..., task="embed")` (= `run_embed_job`),
`nanoserve embed INPUT -o OUT`.

Stage 3, workers (and the embedding task's entry) of the job pipeline (docs/modules.md).

    from ray_jobs import run_batch_job
    summary = run_batch_job("docs.parquet", "vectors/", task="embed", dimensions=256)

Each row's text (its `prompt` or `text` column, or `--prompt-column`), or token ids
(`prompt_token_ids`), becomes one vector: the output has `id`, the input columns, then
`embedding` (`fixed_size_list<float32>[dim]`, or float16 with `embedding_dtype="float16"`),
`num_input_tokens` and `error` (null unless the row failed). Chat `messages` rows are error
rows (embed text instead).

The job is the generation job's (`ray_jobs.driver`): the same streaming input, batches,
dispatch, worker replacement, exactly-once parts, manifest (its settings name the task and
the pooling, so a rerun with other pooling is refused), resume, object storage and report.
What differs: the rows are prepared here (`EmbedPreparer`: the instruction prefixed, inputs
longer than the limit cut to it and counted, or with `truncate=False` made error rows), the
batches are bounded by tokens (`max_batch_tokens`, default 65,536 per batch, 1,024 rows),
and the actors are `EmbedWorker`s: an `Embedder` each (nanoserve/embed.py: prefill only,
rows packed, no KV pool).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve.errors import InputError, NanoserveError
from ray_jobs.io import InputChunk
from ray_jobs.prepare import MESSAGES, TEXT, ColumnPlan, load_model_meta, plan_columns
from ray_jobs.tasks import JobSpec, ShardOutcome, ShardWorker

# The options an embedding job adds to `JobOptions` (run_batch_job's keyword arguments).
EMBED_OPTIONS = ("task", "pooling", "normalize", "dimensions", "instruction",
                 "max_input_tokens", "truncate", "embedding_dtype")
EMBED_BATCH_SIZE = 1024
EMBED_BATCH_TOKENS = 65536
EMBEDDING_DTYPES = {"float32": pa.float32(), "float16": pa.float16()}


def embed_result_schema(dim: int, embedding_dtype: str = "float32") -> pa.Schema:
    return pa.schema([pa.field("embedding", pa.list_(EMBEDDING_DTYPES[embedding_dtype], dim)),
                      pa.field("num_input_tokens", pa.int32()),
                      pa.field("error", pa.string())])


@dataclass(frozen=True)
class EmbedRow:
    """One input row ready for an embedding batch (the `batching.BatchRow` protocol)."""

    position: int
    id: Any
    values: dict[str, Any]
    prompt_token_ids: tuple[int, ...]
    error: str | None = None
    truncated: bool = False
    params: None = None  # what `GenerationRequest` carries for a generation row
    n: int = 1
    max_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class EmbedPreparer:
    """Input chunks to `EmbedRow`s: text with the instruction prefixed and tokenized, token
    ids checked against the vocabulary; inputs above `limit` tokens cut (keeping the
    tokenizer's closing special tokens) or, without `truncate`, error rows."""

    def __init__(self, plan: ColumnPlan, tokenizer: Any, vocab_size: int, limit: int,
                 instruction: str | None = None, truncate: bool = True) -> None:
        from nanoserve.embed import with_instruction

        self.plan, self.tokenizer, self.vocab_size = plan, tokenizer, vocab_size
        self.limit, self.instruction, self.truncate = limit, instruction, truncate
        self._with_instruction = with_instruction
        plain = tokenizer.encode("a", add_special_tokens=False)
        full = tokenizer.encode("a")
        at = next((i for i in range(len(full) - len(plain) + 1)
                   if full[i:i + len(plain)] == plain), None)
        self.suffix = tuple(full[at + len(plain):]) if at is not None else ()

    def prepare(self, chunk: InputChunk, first_position: int,
                read_images: bool = True) -> list[EmbedRow]:
        """The chunk's rows, tokenized (`read_images`: unused, an embedding job takes no
        images)."""
        out = []
        for i, values in enumerate(chunk.batch.to_pylist()):
            position = first_position + i
            row_id = position if self.plan.id_column is None else values[self.plan.id_column]
            error = chunk.row_errors.get(i)
            if error is None and row_id is None:
                error = f"the row has no id (column {self.plan.id_column!r} is null)"
            ids: tuple[int, ...] = ()
            cut = False
            if error is None:
                try:
                    ids, cut = self._ids(values)
                except (ValueError, TypeError) as e:
                    error, ids = str(e), ()
            out.append(EmbedRow(position, row_id, values, ids, error, cut))
        return out

    def _ids(self, values: dict[str, Any]) -> tuple[tuple[int, ...], bool]:
        found = next(((c, k) for c, k in self.plan.prompt_columns
                      if values.get(c) is not None), None)
        if found is None:
            names = " / ".join(c for c, _ in self.plan.prompt_columns)
            raise ValueError(f"no input: {names} is null")
        column, kind = found
        value = values[column]
        if self.plan.image_column and values.get(self.plan.image_column):
            raise ValueError(f"the row has an image (column {self.plan.image_column!r}); an "
                             f"embedding job embeds text or token ids")
        if kind == MESSAGES:
            raise ValueError(f"column {column!r} holds chat messages; an embedding job embeds "
                             f"text or token ids")
        if kind == TEXT:
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"column {column!r} is not valid UTF-8 ({e.reason})") from None
            if not value.strip():
                raise ValueError(f"empty text (column {column!r})")
            ids = list(self.tokenizer.encode(self._with_instruction(value, self.instruction)))
        else:
            bad = [t for t in value if t is None or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"column {column!r} holds token id {bad[0]}, outside the "
                                 f"vocabulary [0, {self.vocab_size})")
            ids = [int(t) for t in value]
        if not ids:
            raise ValueError(f"empty input (column {column!r})")
        if len(ids) <= self.limit:
            return tuple(ids), False
        if not self.truncate:
            raise ValueError(f"input has {len(ids)} tokens, above the limit of {self.limit} "
                             f"(--max-input-tokens; without --no-truncate it would be cut)")
        s = list(self.suffix)
        if s and ids[-len(s):] == s and len(s) < self.limit:
            return tuple(ids[:self.limit - len(s)] + s), True
        return tuple(ids[:self.limit]), True


class EmbedWorker:
    """An `Embedder` held for the life of the process; `run_batch` answers one row per
    request: `embedding` (float32 list), `num_input_tokens`, `error`, and for the job's
    bookkeeping `finish_reason` ('stop' or 'error') and `num_generated_tokens` (0)."""

    def __init__(self, model: str, dtype: str = "auto", device: str | None = None,
                 num_threads: int | None = None, pooling: dict[str, Any] | None = None,
                 max_batch_tokens: int = 16384, **_generation: Any) -> None:
        import os

        import torch

        from nanoserve.embed import Embedder, PoolingConfig
        from ray_jobs.worker import _fault_hold_load_while_file, _fault_on_load, pick_device

        _fault_hold_load_while_file()
        _fault_on_load()
        if num_threads is not None:
            torch.set_num_threads(max(1, min(num_threads, os.cpu_count() or 1)))
        self.embedder = Embedder.load(model, dtype=dtype, device=device or pick_device(),
                                      max_batch_tokens=max_batch_tokens)
        self.embedder.pooling = PoolingConfig(**(pooling or {}))
        self.embedder.limit = self.embedder.pooling.max_input_tokens or self.embedder.limit
        self.embedder.dim = self.embedder.pooling.dimensions or self.embedder.config.hidden_size
        # The actor takes two batches at once (max_in_flight_per_worker): their prefills take
        # turns on the model, while one batch's table is built as the other runs.
        import threading

        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        import os
        import socket

        from ray_jobs.worker import ray_gpu_ids

        return {"gpu_ids": ray_gpu_ids(), "device": str(self.embedder.device),
                "host": socket.gethostname(), "pid": os.getpid(), "scheduler": "embedding"}

    def run_batch(self, requests: list[Any]) -> pa.Table:
        from ray_jobs.worker import (
            OOM_KEY,
            PREFILL_SLOTS_KEY,
            PREFILL_TOKENS_KEY,
            _fault_hold_while_file,
            _fault_kill_on_text,
            _first_line,
        )

        _fault_hold_while_file()
        _fault_kill_on_text(self.embedder.tokenizer, requests)
        ids = [list(r.prompt_token_ids) for r in requests]
        try:
            with self._lock:
                vectors: list[Any] = list(self.embedder.embed_ids(ids).numpy())
            errors: list[str | None] = [None] * len(ids)
        except (NanoserveError, ValueError, RuntimeError):  # each row alone: a bad one fails
            vectors, errors = [], []
            for row in ids:
                try:
                    with self._lock:
                        vectors.append(self.embedder.embed_ids([row]).numpy()[0])
                    errors.append(None)
                except (NanoserveError, ValueError, RuntimeError) as e:
                    vectors.append(None)
                    errors.append(f"embedding failed: {type(e).__name__}: "
                                  f"{_first_line(str(e))}")
        table = worker_table(vectors, [len(i) for i in ids], errors, self.embedder.dim)
        real = sum(len(i) for i in ids)
        return table.replace_schema_metadata({PREFILL_SLOTS_KEY: str(real).encode(),
                                              PREFILL_TOKENS_KEY: str(real).encode(),
                                              OOM_KEY: b"0"})


def embed_worker_schema(dim: int) -> pa.Schema:
    return pa.schema(list(embed_result_schema(dim))
                     + [pa.field("finish_reason", pa.string()),
                        pa.field("num_generated_tokens", pa.int32())])


def worker_table(vectors: list[Any], num_input_tokens: list[int], errors: list[str | None],
                 dim: int) -> pa.Table:
    """`embed_worker_schema`'s table, built by columns: the vectors as one float32 buffer
    (a failed row's slot zero and null), not as Python floats."""
    import numpy as np

    flat = np.zeros((len(vectors), dim), dtype=np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            flat[i] = v
    mask = pa.array([v is None for v in vectors], pa.bool_())
    emb = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), dim, mask=mask)
    return pa.Table.from_arrays(
        [emb, pa.array(num_input_tokens, pa.int32()), pa.array(errors, pa.string()),
         pa.array(["error" if e is not None else "stop" for e in errors], pa.string()),
         pa.array([0] * len(errors), pa.int32())], schema=embed_worker_schema(dim))


class FastRows:
    """A worker's table whose `to_pylist` gives each row's `embedding` as a numpy row of
    `dtype` (None for a failed row) instead of a list of Python floats: the driver regroups
    and writes a batch's rows without converting each float twice. Everything else is the
    table's."""

    def __init__(self, table: pa.Table, dtype: str = "float32") -> None:
        self._table = table
        self._dtype = dtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)

    def __getitem__(self, key: Any) -> Any:
        return self._table[key]

    def to_pylist(self) -> list[dict[str, Any]]:
        emb = self._table.column("embedding").combine_chunks()
        rows = self._table.drop_columns(["embedding"]).to_pylist()
        dim = emb.type.list_size
        values = emb.values.slice(emb.offset * dim, len(emb) * dim)
        matrix = values.to_numpy(zero_copy_only=False).reshape(len(emb), dim).astype(
            self._dtype, copy=False)
        nulls = emb.is_null().to_pylist()
        for i, row in enumerate(rows):
            row["embedding"] = None if nulls[i] else matrix[i]
        return rows


def embed_row(vector: Any, num_input_tokens: int, error: str | None) -> dict[str, Any]:
    return {"embedding": vector, "num_input_tokens": num_input_tokens, "error": error,
            "finish_reason": "error" if error is not None else "stop",
            "num_generated_tokens": 0}


def embed_error_rows(message: str, num_input_tokens: int = 0, n: int = 1) -> list[dict[str, Any]]:
    return [embed_row(None, num_input_tokens, message) for _ in range(n)]


class EmbedTask:
    """The embedding task of the job pipeline (`ray_jobs.tasks`): rows prepared by
    `EmbedPreparer`, run by `EmbedWorker.run_batch`, one vector a row."""

    verb = "embedding"

    def __init__(self, spec: JobSpec, tokenizer: Any, config: Any, engine: Any = None,
                 grammars: Any = None, preparer: Any = None) -> None:
        opts = spec.task_options
        self.preparer = preparer or EmbedPreparer(
            spec.plan, tokenizer, config.vocab_size, opts["limit"], opts.get("instruction"),
            opts.get("truncate", True))
        self.engine = engine
        self.dtype = opts.get("embedding_dtype", "float32")

    def groups(self, rows: list[Any]) -> list[list[int]]:
        """One engine call (the embedder packs its rows by tokens itself)."""
        return [list(range(len(rows)))]

    def requests(self, rows: list[Any]) -> list[Any]:
        return rows

    def results(self, table: pa.Table, rows: list[Any]) -> list[list[dict[str, Any]]]:
        return [[res] for res in FastRows(table, self.dtype).to_pylist()]

    def error_results(self, message: str, row: Any) -> list[dict[str, Any]]:
        return embed_error_rows(message, row.num_prompt_tokens)

    def count(self, out: ShardOutcome, row: Any, samples: list[dict[str, Any]]) -> None:
        out.truncated += bool(getattr(row, "truncated", False))


class RayEmbedWorker(ShardWorker, EmbedWorker):
    """The embedding job's actor: an `EmbedWorker` that runs shards (`ShardWorker`)."""

    def make_task(self, spec: Any) -> EmbedTask:
        return EmbedTask(spec, self.embedder.tokenizer, self.embedder.config,
                         engine=self.run_batch)


@dataclass(frozen=True)
class EmbedSettings:
    pooling: Any  # nanoserve.embed.PoolingConfig
    truncate: bool
    embedding_dtype: str
    dim: int


def embed_settings(model_path: Path, config: Any, options: dict[str, Any]) -> EmbedSettings:
    """The embedding options of a job (popped from `options`), resolved against the model
    folder (nanoserve.embed.resolve_pooling). InputError for a bad one."""
    from nanoserve.embed import resolve_pooling

    task = options.pop("task", "embed")
    if task != "embed":
        raise InputError(f"task must be 'generate' or 'embed', got {task!r}")
    embedding_dtype = options.pop("embedding_dtype", "float32") or "float32"
    if embedding_dtype not in EMBEDDING_DTYPES:
        raise InputError(f"embedding dtype must be one of {', '.join(EMBEDDING_DTYPES)}, "
                         f"got {embedding_dtype!r}")
    truncate = bool(options.pop("truncate", True))
    pooling = resolve_pooling(
        model_path, config.hidden_size, config.max_position_embeddings,
        pooling=options.pop("pooling", None), normalize=options.pop("normalize", None),
        dimensions=options.pop("dimensions", None), instruction=options.pop("instruction", None),
        max_input_tokens=options.pop("max_input_tokens", None))
    return EmbedSettings(pooling, truncate, embedding_dtype,
                         pooling.dimensions or config.hidden_size)


def run_embed_job(input: str | Path, output_dir: str | Path, **options: Any) -> Any:
    """`run_batch_job(..., task="embed")`: see the module docstring. Returns an
    `EmbedJobSummary`."""
    from nanoserve.model_store import DEFAULT_MODEL, resolve_model
    from ray_jobs.batching import BatchLimits
    from ray_jobs.driver import Pipeline, _job_settings, run_pipeline
    from ray_jobs.io import scan_input
    from ray_jobs.options import JobOptions
    from ray_jobs.prepare import PROMPT_COLUMNS
    from ray_jobs.shards import InputSpec
    from ray_jobs.storage import OutputDir
    from ray_jobs.tasks import JobSpec, ShardRunner
    from ray_jobs.timeline import Timeline

    timeline = Timeline(time.perf_counter())
    options = dict(options)
    options.setdefault("batch_size", EMBED_BATCH_SIZE)
    if options.get("max_batch_tokens") is None:
        options["max_batch_tokens"] = EMBED_BATCH_TOKENS
    model_path = resolve_model(options.get("model") or DEFAULT_MODEL)
    config, tokenizer = load_model_meta(model_path)
    settings = embed_settings(model_path, config, options)
    opts = JobOptions(**options)
    limits = BatchLimits(opts.batch_size, opts.max_batch_tokens,
                         opts.window_batches * opts.batch_size)  # (checked before the scan)
    info = scan_input(input, opts.chunk_rows, opts.id_column, shard_rows=opts.batch_size)
    prompt_column = opts.prompt_column
    names = info.schema.names
    if prompt_column is None and not any(c in names for c in PROMPT_COLUMNS) \
            and "text" in names:
        prompt_column = "text"
    plan = plan_columns(info.schema, prompt_column, opts.id_column)
    if "embedding" in names:
        raise InputError("input column 'embedding' clashes with the output column of that "
                         "name; rename it")
    schema = pa.schema([pa.field("id", plan.id_type)] + plan.passthrough_fields()
                       + list(embed_result_schema(settings.dim, settings.embedding_dtype)))
    limit = settings.pooling.max_input_tokens
    preparer = EmbedPreparer(plan, tokenizer, config.vocab_size, limit,
                             settings.pooling.instruction, settings.truncate)
    job_settings = _job_settings(opts, info, model_path, limits, plan)
    job_settings["sampling"] = None  # no sampling: the embedding settings instead
    job_settings["embed"] = {**settings.pooling.as_dict(), "truncate": settings.truncate,
                             "embedding_dtype": settings.embedding_dtype}
    job_settings["columns"]["prompt_column"] = prompt_column
    folder = OutputDir.open(output_dir)
    spec = JobSpec("embed", InputSpec.of(info, opts.chunk_rows), plan, schema, folder, (),
                   {"limit": limit, "instruction": settings.pooling.instruction,
                    "truncate": settings.truncate, "embedding_dtype": settings.embedding_dtype})
    local = ShardRunner(spec, EmbedTask(spec, tokenizer, config, preparer=preparer))

    def finish(summary: Any, run: Any) -> EmbedJobSummary:
        return EmbedJobSummary(**{f.name: getattr(summary, f.name)
                                  for f in dataclasses.fields(EmbedJobSummary)
                                  if hasattr(summary, f.name)},
                               truncated_rows=run.truncated_rows, dimensions=settings.dim)

    return run_pipeline(Pipeline(
        opts, info, output_dir, folder, job_settings, spec, local, _EmbedJobRun,
        EmbedJobSummary, actor=RayEmbedWorker,
        actor_kwargs={"pooling": settings.pooling.as_dict(),
                      "max_batch_tokens": opts.max_batch_tokens},
        report_settings={"options": dataclasses.asdict(opts), "model": job_settings["model"],
                         "input": job_settings["input"], "embed": job_settings["embed"]},
        finish=finish), timeline)


@dataclass(frozen=True)
class EmbedJobSummary:
    """What one embedding run did (the fields of `driver.JobSummary`, plus the rows cut to
    the input limit and the vectors' dimension)."""

    output_dir: str
    rows: int
    error_rows: int
    rows_resumed: int
    input_tokens: int
    output_tokens: int
    wall_time_s: float
    output_tokens_per_s: float
    padding_waste: float
    num_batches: int
    workers: tuple = ()
    worker_restarts: int = 0
    device_oom_errors: int = 0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    report: str | None = None
    prefix_hit_rate: float | None = None
    nodes_lost: tuple[str, ...] = ()
    input_rows: int | None = None
    truncated_rows: int = 0
    dimensions: int = 0

    def format(self) -> str:
        from ray_jobs.timeline import PHASES

        rate = self.rows / self.wall_time_s if self.wall_time_s > 0 else 0.0
        tok = self.input_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0
        lines = [
            f"rows: {self.rows} ({self.error_rows} error rows)"
            + (f", {self.rows_resumed} done by an earlier run" if self.rows_resumed else ""),
            f"truncated: {self.truncated_rows} row(s) cut to the input limit",
            f"vectors: {self.dimensions} dimensions; tokens: {self.input_tokens} input",
            f"wall time: {self.wall_time_s:.1f} s, {rate:.1f} rows/s, {tok:.1f} tokens/s",
            f"batches: {self.num_batches} on {len(self.workers)} worker(s); "
            f"output: {self.output_dir}",
        ]
        if self.worker_restarts:
            lines.append(f"recovered: {self.worker_restarts} worker restart(s)")
        if self.report:
            lines.append(f"report: {self.report}")
        if self.nodes_lost:
            lines.append(f"nodes lost: {len(self.nodes_lost)} ({'; '.join(self.nodes_lost)})")
        if self.timings:
            lines.append("time: " + ", ".join(f"{PHASES[k]} {v:.1f} s"
                                              for k, v in self.timings.items()))
        return "\n".join(lines)


def _embed_job_run_class() -> type:
    from ray_jobs.driver import _JobRun

    class EmbedJobRun(_JobRun):
        """The generation job's run, with the embedding job's progress bar."""

        truncated_rows = 0
        embedding_dtype = "float32"
        BAR_DESCRIPTION = "nanoserve embed"

        def _rates(self, elapsed: float) -> str:
            return (f"{self.input_rows / elapsed:.1f} rows/s, "
                    f"{self.input_tokens / elapsed:.1f} input tok/s")


    return EmbedJobRun


def driver_first_line(text: str) -> str:
    from ray_jobs.pool import first_line

    return first_line(text)


def _EmbedJobRun(*args: Any, **kwargs: Any) -> Any:
    return _embed_job_run_class()(*args, **kwargs)


class DatasetEmbedder:
    """The callable class Ray Data runs in each actor of an embedding processor: an
    `EmbedWorker` loaded once, then `__call__(batch: pa.Table) -> pa.Table` appends
    `embedding`, `num_input_tokens` and `error` to the batch's rows (in order; bad rows are
    error rows, as in the job)."""

    def __init__(self, model: str, settings: dict[str, Any], prompt_column: str | None = None,
                 dtype: str = "auto", num_threads: int | None = None,
                 max_batch_tokens: int = EMBED_BATCH_TOKENS) -> None:
        from nanoserve.embed import PoolingConfig
        from nanoserve.model_store import resolve_model

        path = resolve_model(model)
        self.config, self.tokenizer = load_model_meta(path)
        self.settings = dict(settings)
        self.pooling = PoolingConfig(**self.settings["pooling"])
        self.prompt_column = prompt_column
        self.worker = EmbedWorker(str(path), dtype=dtype, num_threads=num_threads,
                                  pooling=self.settings["pooling"],
                                  max_batch_tokens=max_batch_tokens)
        self._preparers: dict[pa.Schema, EmbedPreparer] = {}

    def _preparer(self, schema: pa.Schema) -> EmbedPreparer:
        if schema not in self._preparers:
            from ray_jobs.prepare import PROMPT_COLUMNS

            column = self.prompt_column
            if column is None and not any(c in schema.names for c in PROMPT_COLUMNS) \
                    and "text" in schema.names:
                column = "text"
            plan = dataclasses.replace(plan_columns(schema, column), id_column=None)
            self._preparers[schema] = EmbedPreparer(
                plan, self.tokenizer, self.config.vocab_size, self.pooling.max_input_tokens,
                self.pooling.instruction, self.settings["truncate"])
        return self._preparers[schema]

    def __call__(self, batch: pa.Table) -> pa.Table:
        batch = batch.combine_chunks()
        record = pa.RecordBatch.from_arrays(
            [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in batch.columns],
            schema=batch.schema)
        rows = self._preparer(batch.schema).prepare(InputChunk(record, Path("<dataset>")), 0)
        results: list[dict[str, Any] | None] = [
            embed_row(None, 0, r.error) if r.error is not None else None for r in rows]
        todo = [i for i, r in enumerate(rows) if r.error is None]
        if todo:
            answered = FastRows(self.worker.run_batch([rows[i] for i in todo]),
                                self.settings["embedding_dtype"]).to_pylist()
            for i, res in zip(todo, answered, strict=True):
                results[i] = res
        schema = embed_result_schema(self.worker.embedder.dim, self.settings["embedding_dtype"])
        table = pa.Table.from_pylist(
            [{f.name: res[f.name] for f in schema} for res in results], schema=schema)
        out = batch.drop_columns([c for c in schema.names if c in batch.column_names])
        for field, column in zip(schema, table.columns):
            out = out.append_column(field, column)
        return out


def build_embed_processor(model: str, *, concurrency: int = 1, num_gpus: float = 1,
                          num_cpus: float | None = None, batch_size: int = 256,
                          prompt_column: str | None = None, dtype: str = "auto",
                          max_batch_tokens: int = EMBED_BATCH_TOKENS,
                          **options: Any) -> Any:
    """`build_processor(model, task="embed", ...)`: a function `Dataset -> Dataset` that
    appends `embedding`, `num_input_tokens` and `error` to every row. `options`: `pooling`,
    `normalize`, `dimensions`, `instruction`, `max_input_tokens`, `truncate`,
    `embedding_dtype` (see `run_batch_job`), checked here against the model's files before
    any actor starts."""
    from nanoserve.model_store import resolve_model

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    options = dict(options)
    options.setdefault("task", "embed")
    unknown = sorted(set(options) - set(EMBED_OPTIONS))
    if unknown:
        raise InputError(f"not an embedding option: {', '.join(unknown)}")
    path = resolve_model(model)
    config, _ = load_model_meta(path)
    s = embed_settings(path, config, options)
    settings = {"pooling": s.pooling.as_dict(), "truncate": s.truncate,
                "embedding_dtype": s.embedding_dtype}
    if num_gpus:
        resources: dict[str, Any] = {"num_gpus": num_gpus, "num_cpus": num_cpus or 0}
        num_threads = None
    else:
        resources = {"num_cpus": num_cpus or 1}
        num_threads = max(1, int(num_cpus or 1))
    constructor = {"model": model, "settings": settings, "prompt_column": prompt_column,
                   "dtype": dtype, "num_threads": num_threads,
                   "max_batch_tokens": max_batch_tokens}

    def process(ds: Any) -> Any:
        from ray.data import ActorPoolStrategy

        return ds.map_batches(
            DatasetEmbedder, fn_constructor_kwargs=constructor, batch_format="pyarrow",
            batch_size=batch_size, compute=ActorPoolStrategy(size=concurrency),
            zero_copy_batch=True, **resources)

    return process


__all__ = ["EMBED_OPTIONS", "DatasetEmbedder", "EmbedJobSummary", "EmbedPreparer", "EmbedRow",
           "EmbedWorker", "RayEmbedWorker", "build_embed_processor", "embed_result_schema",
           "run_embed_job"]
