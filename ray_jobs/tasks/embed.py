"""Stage tasks: the embedding task of the job pipeline, a vector per row (`nanoserve embed`,
`run_job(..., task="embed")`).

    from ray_jobs import run_embed_job
    summary = run_embed_job("docs.parquet", "vectors/", dimensions=256)

Each row's text (its `prompt` or `text` column, or `--prompt-column`), or token ids
(`prompt_token_ids`), becomes one vector: the output has `id`, the input columns, then
`embedding` (`fixed_size_list<float32>[dim]`, or float16 with `embedding_dtype="float16"`),
`num_input_tokens` and `error` (null unless the row failed). Chat `messages` rows are error
rows (embed text instead).

The job is the one both tasks run (`ray_jobs.dispatch.driver.run_job`): the same streaming input,
shards, dispatch, worker replacement, exactly-once parts, manifest (its settings name the
pooling, so a rerun with other pooling is refused), resume, object storage and report. What the
embedding task adds: its options (`EMBED_OPTIONS`, resolved against the model's files by
`embed_settings`), its rows (`EmbedPreparer`: the instruction prefixed, inputs longer than
the limit cut to it and counted, or with `truncate=False` made error rows), larger shards
(1,024 rows) whose batches are bounded by tokens (`max_batch_tokens`, default 65,536), and its
actors, `RayEmbedWorker`s: an `Embedder` each (nanoserve/embed.py: prefill only, rows
packed, no KV pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve import ENGINE, InputError, NanoserveError
from ray_jobs.input.files import InputChunk, InputInfo
from ray_jobs.options import JOB
from ray_jobs.preparation.prepare import (
    MESSAGES,
    TEXT,
    ColumnPlan,
    read_rows,
    text_of,
    text_prompt_column,
    token_ids_of,
)
from ray_jobs.workers.options import PREFILL_BATCH_SIZE, PREFILL_BATCH_TOKENS, JobOptions
from ray_jobs.workers.tasks import (
    ShardOutcome,
    ShardWorker,
    TaskKind,
    TaskPlan,
    prefill_progress,
    prefill_summary_lines,
)

# The options the embedding task adds to `JobOptions` (run_job's keyword arguments).
EMBED_OPTIONS = ("pooling", "normalize", "dimensions", "instruction", "max_input_tokens",
                 "truncate", "embedding_dtype")
EMBED_BATCH_SIZE = PREFILL_BATCH_SIZE
EMBED_BATCH_TOKENS = PREFILL_BATCH_TOKENS
EMBEDDING_DTYPES = {"float32": pa.float32(), "float16": pa.float16()}


def embed_result_schema(dim: int,
                        embedding_dtype: str = JOB["embedding_dtype"].default) -> pa.Schema:
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
        from nanoserve import with_instruction

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
        for position, row_id, values, error, parsed in read_rows(
                chunk, first_position, self.plan.id_column, self._ids):
            ids, cut = parsed or ((), False)
            out.append(EmbedRow(position, row_id, values, ids, error, cut))
        return out

    def _ids(self, values: dict[str, Any]) -> tuple[tuple[int, ...], bool]:
        column, kind = self.plan.prompt_of(values, "input")
        value = values[column]
        if self.plan.image_column and values.get(self.plan.image_column):
            raise ValueError(f"the row has an image (column {self.plan.image_column!r}); an "
                             f"embedding job embeds text or token ids")
        if kind == MESSAGES:
            raise ValueError(f"column {column!r} holds chat messages; an embedding job embeds "
                             f"text or token ids")
        if kind == TEXT:
            value = text_of(value, column)
            if not value.strip():
                raise ValueError(f"empty text (column {column!r})")
            ids = list(self.tokenizer.encode(self._with_instruction(value, self.instruction)))
        else:
            ids = list(token_ids_of(value, column, self.vocab_size))
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

    def __init__(self, model: str, dtype: str = ENGINE["dtype"].default, device: str | None = None,
                 num_threads: int | None = None, pooling: dict[str, Any] | None = None,
                 max_batch_tokens: int = 16384, **_generation: Any) -> None:
        from nanoserve import Embedder, PoolingConfig
        from ray_jobs.workers.worker import _fault_hold_load_while_file, _fault_on_load, pick_device

        _fault_hold_load_while_file()
        _fault_on_load()
        self.embedder = Embedder.load(model, dtype=dtype, device=device or pick_device(),
                                      max_batch_tokens=max_batch_tokens, num_threads=num_threads)
        self.embedder.pooling = PoolingConfig(**(pooling or {}))
        self.embedder.limit = self.embedder.pooling.max_input_tokens or self.embedder.limit
        self.embedder.dim = self.embedder.pooling.dimensions or self.embedder.config.hidden_size
        # The actor takes two shards at once (`hold_limits`): their batches' prefills take
        # turns on the model, while one batch's table is built as the other runs.
        import threading

        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        import os
        import socket

        from ray_jobs.workers.worker import ray_gpu_ids

        return {"gpu_ids": ray_gpu_ids(), "device": str(self.embedder.device),
                "host": socket.gethostname(), "pid": os.getpid(), "scheduler": "embedding"}

    def run_batch(self, requests: list[Any]) -> pa.Table:
        from ray_jobs.workers.worker import (
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
    """The embedding task's plug-in of the shard walk (`ray_jobs.workers.tasks`): rows prepared by
    `EmbedPreparer`, run by `EmbedWorker.run_batch`, one vector a row."""

    verb = "embedding"

    def __init__(self, plan: ColumnPlan, options: dict[str, Any], tokenizer: Any, config: Any,
                 engine: Any = None) -> None:
        """`options`: the job's `JobSpec.task_options` (`limit`, `instruction`, `truncate`,
        `embedding_dtype`)."""
        self.preparer = EmbedPreparer(plan, tokenizer, config.vocab_size, options["limit"],
                                      options.get("instruction"),
                                      options.get("truncate", JOB["truncate"].default))
        self.engine = engine
        self.dtype = options.get("embedding_dtype", JOB["embedding_dtype"].default)

    def batches(self, rows: list[Any]) -> list[list[int]]:
        """One batch, one engine call (the embedder packs its rows by tokens itself)."""
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
    """The embedding task's actor: an `EmbedWorker` that runs shards (`ShardWorker`)."""

    def make_task(self, spec: Any) -> EmbedTask:
        return EmbedTask(spec.plan, spec.task_options, self.embedder.tokenizer,
                         self.embedder.config, engine=self.run_batch)


@dataclass(frozen=True)
class EmbedSettings:
    """The embedding options of a job or a Ray Data processor, resolved (`embed_settings`)."""

    pooling: Any  # nanoserve.embed.PoolingConfig
    truncate: bool
    embedding_dtype: str
    dim: int

    def task_options(self) -> dict[str, Any]:
        """`EmbedTask`'s options (the job's `JobSpec.task_options`)."""
        return {"limit": self.pooling.max_input_tokens, "instruction": self.pooling.instruction,
                "truncate": self.truncate, "embedding_dtype": self.embedding_dtype}


def take_options(options: dict[str, Any]) -> dict[str, Any]:
    """The embedding options (`EMBED_OPTIONS`), popped from `options` (the job's keyword
    arguments), and the embedding task's defaults of the job's shard and batch bounds set
    there.
    InputError for an unknown vector dtype."""
    own = {k: options.pop(k) for k in EMBED_OPTIONS if k in options}
    own["embedding_dtype"] = own.get("embedding_dtype") or JOB["embedding_dtype"].default
    if own["embedding_dtype"] not in EMBEDDING_DTYPES:
        raise InputError(f"embedding dtype must be one of {', '.join(EMBEDDING_DTYPES)}, "
                         f"got {own['embedding_dtype']!r}")
    options.setdefault("batch_size", EMBED_BATCH_SIZE)
    if options.get("max_batch_tokens") is None:
        options["max_batch_tokens"] = EMBED_BATCH_TOKENS
    return own


def embed_settings(model_path: Path, config: Any, own: dict[str, Any]) -> EmbedSettings:
    """The embedding options (`take_options`' result) resolved against the model folder
    (nanoserve.embed.resolve_pooling). InputError for a bad one."""
    from nanoserve import resolve_pooling

    pooling = resolve_pooling(
        model_path, config.hidden_size, config.max_position_embeddings,
        pooling=own.get("pooling"), normalize=own.get("normalize"),
        dimensions=own.get("dimensions"), instruction=own.get("instruction"),
        max_input_tokens=own.get("max_input_tokens"))
    return EmbedSettings(pooling, bool(own.get("truncate", JOB["truncate"].default)),
                         own["embedding_dtype"],
                         pooling.dimensions or config.hidden_size)


def prompt_column(given: str | None, names: list[str]) -> str | None:
    """The column to embed: the one named, else each row's first of
    `prepare.PROMPT_COLUMNS` the input has, else `text` (`prepare.text_prompt_column`)."""
    return text_prompt_column(given, names)


def plan_job(opts: JobOptions, own: dict[str, Any], info: InputInfo, plan: ColumnPlan,
             model_path: Path, config: Any, tokenizer: Any) -> TaskPlan:
    """The embedding task's part of the job (see the module docstring). InputError for a
    pooling option the model cannot take, or an input column named `embedding`."""
    settings = embed_settings(model_path, config, own)
    if "embedding" in info.schema.names:
        raise InputError("input column 'embedding' clashes with the output column of that "
                         "name; rename it")
    schema = pa.schema([pa.field("id", plan.id_type)] + plan.passthrough_fields()
                       + list(embed_result_schema(settings.dim, settings.embedding_dtype)))
    options = settings.task_options()
    embed = {**settings.pooling.as_dict(), "truncate": settings.truncate,
             "embedding_dtype": settings.embedding_dtype}
    return TaskPlan(opts, schema, EmbedTask(plan, options, tokenizer, config), RayEmbedWorker,
                    task_options=options,
                    actor_kwargs={"pooling": settings.pooling.as_dict(),
                                  "max_batch_tokens": opts.max_batch_tokens},
                    # no sampling: the embedding settings instead
                    settings={"sampling": None, "embed": embed},
                    report_settings={"embed": embed}, summary={"dimensions": settings.dim})


def summary_lines(s: Any) -> list[str]:
    """The summary's embedding lines (`ray_jobs.dispatch.driver.JobSummary.format`)."""
    return prefill_summary_lines(s, f"vectors: {s.dimensions} dimensions; tokens: {s.input_tokens} input")


EMBED = TaskKind("embed", "embed", (), take_options, prompt_column, plan_job, prefill_progress,
                 summary_lines)


__all__ = ["EMBED", "EMBED_OPTIONS", "EmbedPreparer", "EmbedRow", "EmbedTask", "EmbedWorker",
           "RayEmbedWorker", "embed_result_schema", "embed_settings"]
