"""The engine as a Ray Data stage, for any task of the job (generate, embed, classify,
score): a `ray.data.Dataset` of prompts (or texts, or text pairs) in, the same rows with
the task's result columns out.

Entry point (Ray Data) of the job pipeline (docs/modules.md).

    import ray.data
    from ray_jobs.data_processor import build_processor

    process = build_processor("smollm2-135m-instruct", concurrency=2, num_gpus=1,
                              max_tokens=64)
    out = process(ray.data.read_parquet("prompts/"))   # lazy, streaming
    out.write_parquet("out/")
    vectors = build_processor(task="embed", num_gpus=1)(ray.data.read_parquet("docs/"))
    labels = build_processor("classifier/", task="classify")(ray.data.read_parquet("docs/"))

Contract (see docs/interfaces.md):
- input rows as `nanoserve batch` reads them: a `prompt` (text), `messages` (chat) or
  `prompt_token_ids` column (or the one `prompt_column` names; a row uses the first of them
  it has), images for a vision-language model (image content parts in `messages`, or an
  `image` column beside `prompt`: `ray_jobs.preparation.row_images`; read and decoded in the actor),
  and optional per-row `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `n`,
  `logprobs`, `prompt_logprobs` and structured outputs (`response_format`, `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`);
- output: every input row, once per sample (n rows for a row asking for n samples, its
  columns repeated), with its columns unchanged and the result columns of
  `ray_jobs.preparation.result_columns.RESULT_SCHEMA` appended (`generated_text`, `generated_token_ids`,
  `num_input_tokens`, `num_generated_tokens`, `finish_reason`, `error`), then the output
  controls the batch can need (`prepare.output_controls`): `sample_index` when the default
  `n` is above 1 or the batch has an `n` column, `logprobs` / `prompt_logprobs` when the
  defaults or a column ask for them (an input `logprobs` / `prompt_logprobs` column is
  replaced by the result column of its name). Row order within a batch is kept; Ray Data
  may reorder blocks (keep an id column to join on);
- a bad row (empty prompt, malformed messages, token ids out of range, invalid sampling
  values, a structured output that is malformed or does not compile, a prompt the KV cache
  cannot hold, a generation failure) is an `error` row (n of them for n samples), as in
  `nanoserve batch` (an image that is missing, broken or too large included); the dataset
  does not fail for it. A dataset whose columns hold no
  prompt at all is refused with an `InputError` when its first batch is read;
- run by a fixed pool of `concurrency` actors, each holding one engine (`BatchWorker`) for
  its life: with `num_gpus=1` one GPU each (the CUDA device when torch sees one, else the
  CPU), with `num_gpus=0` `num_cpus` cores each;
- streaming: Ray Data feeds the actors block by block and each batch is answered from its
  own rows alone, so a dataset larger than memory flows through.

The same per-row steps as the batch job, reused: the task's plug-in answers a batch as the
job answers a shard (`ray_jobs.workers.tasks.answer_rows`): `RowPreparer` (rows to token ids and
`SamplingParams`, or error rows; constraints compiled once per actor) and
`BatchWorker.run_batch` (token ids to an Arrow table with a row per sample, error rows for
what does not fit). Nothing else is written: no manifest, no resume (Ray Data's own
execution decides what runs again).

With `task="embed"` the stage is the embedding task's (`ray_jobs.tasks.embed`):
`DatasetEmbedder` actors, an `EmbedWorker` each, append `embedding`, `num_input_tokens` and
`error` to every row (the `text` column is read when no prompt column is there), with the
embedding options of `nanoserve embed` checked against the model's files before any actor
starts.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve import ENGINE, SAMPLING, resolve_model
from ray_jobs.input.files import InputChunk
from ray_jobs.options import JOB
from ray_jobs.preparation.prepare import (
    ColumnPlan,
    RowPreparer,
    load_model_meta,
    output_controls,
    plan_columns,
    text_prompt_column,
)
from ray_jobs.preparation.result_columns import result_schema
from ray_jobs.preparation.row_images import ModelImages
from ray_jobs.tasks.classify import (
    CLASSIFY_OPTIONS,
    RESULTS,
    ClassifyTask,
    ClassifyWorker,
    load_meta,
    score_prompt_column,
    task_options,
)
from ray_jobs.tasks.embed import (
    EMBED_OPTIONS,
    EmbedTask,
    EmbedWorker,
    embed_result_schema,
    embed_settings,
    take_options,
)
from ray_jobs.tasks.embed import prompt_column as embed_prompt_column
from ray_jobs.tasks.generate import GenerateTask
from ray_jobs.workers.tasks import answer_rows, result_column
from ray_jobs.workers.worker import BatchWorker


class DatasetStage(abc.ABC):
    """The callable classes Ray Data runs in each actor of the pool (the model loaded once,
    in the constructor): `__call__(batch: pa.Table) -> pa.Table` answers every batch it is
    given with the task's plug-in, as the job answers a shard's rows. A subclass gives the
    task and its result columns for a batch's schema (`_task`)."""

    @abc.abstractmethod
    def _task(self, schema: pa.Schema) -> tuple[Any, pa.Schema]:
        """The task's plug-in for a batch of this schema, and its result columns."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        """`batch`'s rows, in order, each once per result row (a row's n samples), with the
        result columns appended (an input column of the same name replaced)."""
        batch = batch.combine_chunks()
        record = pa.RecordBatch.from_arrays(
            [c.chunk(0) if c.num_chunks else pa.array([], c.type) for c in batch.columns],
            schema=batch.schema)
        task, schema = self._task(batch.schema)
        rows = task.preparer.prepare(InputChunk(record, Path("<dataset>")), 0)
        results, _, _ = answer_rows(task, rows)
        repeat = [i for i, samples in enumerate(results) for _ in samples]
        out = batch.take(pa.array(repeat, pa.int64())) if repeat != list(range(len(rows))) \
            else batch
        out = out.drop_columns([c for c in schema.names if c in out.column_names])
        flat = [res for samples in results for res in samples]
        for field in schema:
            out = out.append_column(field, result_column([res.get(field.name) for res in flat],
                                                         field.type))
        return out


class DatasetGenerator(DatasetStage):
    """Generation's stage: a `BatchWorker` per actor, rows prepared by `RowPreparer`."""

    def __init__(self, model: str = ENGINE["model"].default,
                 sampling: dict[str, Any] | None = None,
                 prompt_column: str | None = JOB["prompt_column"].default,
                 dtype: str = ENGINE["dtype"].default,
                 kv_cache_fraction: float = ENGINE["kv_cache_fraction"].default,
                 kv_cache_bytes: int | None = ENGINE["kv_cache_bytes"].default,
                 scheduler: str = ENGINE["scheduler"].default, num_threads: int | None = None,
                 chat_template_kwargs: dict[str, Any] | None = JOB["chat_template_kwargs"].default,
                 reasoning_parser: str | None = ENGINE["reasoning_parser"].default) -> None:
        path = resolve_model(model)
        self.chat_template_kwargs = chat_template_kwargs
        self.config, self.tokenizer = load_model_meta(path)
        self.sampling = dict(sampling or {})
        self.prompt_column = prompt_column
        self.worker = BatchWorker(str(path), dtype=dtype, kv_cache_fraction=kv_cache_fraction,
                                  kv_cache_bytes=kv_cache_bytes, scheduler=scheduler,
                                  num_threads=num_threads, reasoning_parser=reasoning_parser)
        # the parser the engine resolved and applies (None: no split)
        self.reasoning = self.worker.llm.reasoning_parser
        self._preparers: dict[pa.Schema, tuple[RowPreparer, tuple[str, ...]]] = {}

    def _preparer(self, schema: pa.Schema) -> tuple[RowPreparer, tuple[str, ...]]:
        """One `RowPreparer` (and the output controls) per input schema seen (blocks may
        differ, e.g. an all-null column). Row ids play no part here: rows are never matched
        back by id. The preparers share the actor's engine's grammar cache."""
        if schema not in self._preparers:
            plan: ColumnPlan = dataclasses.replace(
                plan_columns(schema, self.prompt_column), id_column=None)
            llm = self.worker.llm
            preparer = RowPreparer(
                plan, self.tokenizer, self.config.max_position_embeddings,
                self.config.vocab_size, self.sampling, eos_token_ids=llm.eos_token_ids,
                grammars=llm.grammars, chat_template_kwargs=self.chat_template_kwargs,
                images=ModelImages.of_engine(llm))
            controls = output_controls(plan, self.sampling,
                                       reasoning=self.reasoning is not None)
            plan.output_schema(controls)  # InputError for a clashing column
            self._preparers[schema] = (preparer, controls)
        return self._preparers[schema]

    def _task(self, schema: pa.Schema) -> tuple[GenerateTask, pa.Schema]:
        preparer, controls = self._preparer(schema)
        options = {"defaults": self.sampling}
        task = GenerateTask(preparer.plan, options, self.tokenizer, self.config,
                            engine=self.worker.run_batch, preparer=preparer)
        return task, result_schema(controls)


class DatasetEmbedder(DatasetStage):
    """The embedding task's stage: an `EmbedWorker` per actor, rows prepared by
    `EmbedPreparer`. `options`: `EmbedTask`'s (`EmbedSettings.task_options`)."""

    def __init__(self, model: str, options: dict[str, Any], pooling: dict[str, Any],
                 prompt_column: str | None = JOB["prompt_column"].default,
                 dtype: str = ENGINE["dtype"].default, num_threads: int | None = None,
                 max_batch_tokens: int = JOB["max_batch_tokens"].default_for("embed")) -> None:
        path = resolve_model(model)
        self.config, self.tokenizer = load_model_meta(path)
        self.options = dict(options)
        self.prompt_column = prompt_column
        self.worker = EmbedWorker(str(path), dtype=dtype, num_threads=num_threads,
                                  pooling=pooling, max_batch_tokens=max_batch_tokens)
        self._tasks: dict[pa.Schema, tuple[EmbedTask, pa.Schema]] = {}

    def _task(self, schema: pa.Schema) -> tuple[EmbedTask, pa.Schema]:
        """One task per input schema seen; row ids play no part (rows are never matched
        back by id)."""
        if schema not in self._tasks:
            column = embed_prompt_column(self.prompt_column, schema.names)
            plan = dataclasses.replace(plan_columns(schema, column), id_column=None)
            task = EmbedTask(plan, self.options, self.tokenizer, self.config,
                             engine=self.worker.run_batch)
            self._tasks[schema] = (task, embed_result_schema(self.worker.embedder.dim,
                                                             self.options["embedding_dtype"]))
        return self._tasks[schema]


class DatasetClassifier(DatasetStage):
    """The classification or score task's stage (`task`): a `ClassifyWorker` per actor,
    rows prepared by `ClassifyPreparer`. `options`: `CLASSIFY_OPTIONS`' values."""

    def __init__(self, model: str, task: str, options: dict[str, Any],
                 prompt_column: str | None = JOB["prompt_column"].default,
                 dtype: str = ENGINE["dtype"].default, num_threads: int | None = None,
                 max_batch_tokens: int = JOB["max_batch_tokens"].default_for("classify")) -> None:
        self.path = resolve_model(model)
        self.config, self.tokenizer = load_meta(self.path, task)
        self.task, self.options, self.prompt_column = task, dict(options), prompt_column
        self.worker = ClassifyWorker(str(self.path), dtype=dtype, num_threads=num_threads,
                                     max_batch_tokens=max_batch_tokens, task=task)
        self._tasks: dict[pa.Schema, tuple[ClassifyTask, pa.Schema]] = {}

    def _task(self, schema: pa.Schema) -> tuple[ClassifyTask, pa.Schema]:
        """One task per input schema seen (its pair columns, for the score task)."""
        if schema not in self._tasks:
            pick = score_prompt_column if self.task == "score" else text_prompt_column
            column = pick(self.prompt_column, schema.names)
            plan = dataclasses.replace(plan_columns(schema, column), id_column=None)
            names = [n for n in schema.names if n not in RESULTS[self.task].names]
            options = task_options(self.task, self.options, self.config, names, self.path,
                                   self.tokenizer)
            task = ClassifyTask(plan, options, self.worker.classifier.tokenizer,
                                engine=self.worker.run_batch)
            self._tasks[schema] = (task, RESULTS[self.task])
        return self._tasks[schema]


def build_processor(
        model: str = ENGINE["model"].default, *,
        concurrency: int = JOB["concurrency"].default,
        num_gpus: float = JOB["num_gpus"].default,
        num_cpus: float | None = JOB["num_cpus"].default,
        batch_size: int = JOB["batch_size"].default_for("build_processor"),
        prompt_column: str | None = JOB["prompt_column"].default,
        dtype: str = ENGINE["dtype"].default,
        kv_cache_fraction: float = ENGINE["kv_cache_fraction"].default,
        kv_cache_bytes: int | None = ENGINE["kv_cache_bytes"].default,
        scheduler: str = ENGINE["scheduler"].default,
        chat_template_kwargs: dict[str, Any] | None = JOB["chat_template_kwargs"].default,
        reasoning_parser: str | None = ENGINE["reasoning_parser"].default,
        **sampling: Any) -> Callable[[Any], Any]:
    """A function `Dataset -> Dataset` that appends the result columns to every row (see
    the module docstring). `concurrency` actors, each with `num_gpus` GPUs (1: one engine
    per GPU; 0: on the CPU, `num_cpus` cores each, default 1); `batch_size` rows per call
    of an engine; `scheduler`: each engine's batching, "auto" (continuous: a batch's rows
    leave as they finish; rows with images need it) or "static"; `sampling`: the
    `SamplingParams` fields (`max_tokens`, `temperature`,
    `top_p`, `top_k`, `seed`, `stop`, `ignore_eos`, `n`, `logprobs`, `prompt_logprobs`,
    `structured_outputs`: a `nanoserve.sampling.structured.StructuredOutputs`) that per-row columns
    override; `chat_template_kwargs`: chat-template options for every chat row (e.g.
    `{"enable_thinking": False}`; a row's `chat_template_kwargs` column updates them);
    `reasoning_parser`: "auto" (picked from the model family where certain), "none",
    "qwen3" or "deepseek_r1": the think block in a `reasoning` column (and
    `num_reasoning_tokens`), `generated_text` the answer; constraints apply after the block,
    `max_thinking_tokens` (an option or a column) bounds it. Options are checked here, before any actor starts (InputError, ValueError);
    a default structured output is compiled with the model's tokenizer here too.

    `task="embed"`: the embedding task's stage instead (`DatasetEmbedder`); the other
    keyword arguments are then `pooling`, `normalize`, `dimensions`, `instruction`,
    `max_input_tokens`, `truncate`, `embedding_dtype` (see `run_job`) and
    `max_batch_tokens` (default 65,536), resolved against the model's files here.

    `task="classify"` or `task="score"`: the classifier tasks' stage (`DatasetClassifier`,
    ray_jobs/tasks/classify.py: `label`, `probs`, `score` or `score` alone, then
    `num_input_tokens` and `error`); the other keyword arguments are then
    `max_input_tokens`, `truncate`, `instruction` (a reranker's) and `max_batch_tokens`,
    checked against the model's files here (a model that is no classifier is refused; the
    score task runs a causal LM as a reranker)."""
    from nanoserve import InputError, SamplingParams

    task = sampling.pop("task", "generate")
    for name, value in (("concurrency", concurrency), ("batch_size", batch_size)):
        if problem := JOB[name].problem(value):
            raise ValueError(problem)
    if task == "embed":
        return _actor_pool(DatasetEmbedder, {"model": model, "prompt_column": prompt_column,
                                             "dtype": dtype, **_embedding_options(model, sampling)},
                           concurrency, num_gpus, num_cpus, batch_size)
    if task in ("classify", "score"):
        return _actor_pool(DatasetClassifier, {"model": model, "task": task,
                                               "prompt_column": prompt_column, "dtype": dtype,
                                               **_classify_options(model, task, sampling)},
                           concurrency, num_gpus, num_cpus, batch_size)
    if task != "generate":
        raise InputError(f"task must be 'generate', 'embed', 'classify' or 'score', got "
                         f"{task!r}")
    for name, value in (("dtype", dtype), ("kv_cache_fraction", kv_cache_fraction),
                        ("scheduler", scheduler)):
        if problem := ENGINE[name].problem(value):
            raise InputError(problem)
    sampling = {"max_tokens": SAMPLING["max_tokens"].default, **sampling}
    if "stop" in sampling:
        sampling["stop"] = tuple(sampling["stop"] or ())
    try:
        params = SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise InputError(f"invalid sampling options: {e}") from None
    from nanoserve import template_kwargs

    try:
        chat_template_kwargs = template_kwargs(chat_template_kwargs) or None
    except ValueError as e:
        raise InputError(str(e)) from None
    path = resolve_model(model)  # a model that is not there is refused here, not in every actor
    if params.structured_outputs is not None:
        config, tokenizer = load_model_meta(path)
        plan = ColumnPlan((("prompt", "text"),), None, (), pa.schema([("prompt", pa.string())]))
        RowPreparer(plan, tokenizer, config.max_position_embeddings, config.vocab_size,
                    sampling)  # InputError if it does not compile
    constructor = {"model": model, "sampling": sampling, "prompt_column": prompt_column,
                   "dtype": dtype, "kv_cache_fraction": kv_cache_fraction,
                   "kv_cache_bytes": kv_cache_bytes, "scheduler": scheduler,
                   "chat_template_kwargs": chat_template_kwargs,
                   "reasoning_parser": reasoning_parser}
    return _actor_pool(DatasetGenerator, constructor, concurrency, num_gpus, num_cpus,
                       batch_size)


def _actor_pool(stage: type, constructor: dict[str, Any], concurrency: int, num_gpus: float,
                num_cpus: float | None, batch_size: int) -> Callable[[Any], Any]:
    """The stage as a fixed pool of `concurrency` actors of class `stage` (built with
    `constructor` and its thread count), `batch_size` rows a call."""
    if num_gpus:
        resources: dict[str, Any] = {"num_gpus": num_gpus, "num_cpus": num_cpus or 0}
        num_threads = None
    else:
        resources = {"num_cpus": num_cpus or 1}
        num_threads = max(1, int(num_cpus or 1))
    constructor = {**constructor, "num_threads": num_threads}

    def process(ds: Any) -> Any:
        from ray.data import ActorPoolStrategy

        return ds.map_batches(
            stage, fn_constructor_kwargs=constructor, batch_format="pyarrow",
            batch_size=batch_size, compute=ActorPoolStrategy(size=concurrency),
            zero_copy_batch=True, **resources)

    return process


def _embedding_options(model: str, options: dict[str, Any]) -> dict[str, Any]:
    """`DatasetEmbedder`'s `options`, `pooling` and `max_batch_tokens`, resolved against the
    model's files (InputError for an unknown or a bad option)."""
    from nanoserve import InputError

    options = dict(options)
    max_batch_tokens = options.pop("max_batch_tokens", JOB["max_batch_tokens"].default_for("embed"))
    unknown = sorted(set(options) - set(EMBED_OPTIONS))
    if unknown:
        raise InputError(f"not an embedding option: {', '.join(unknown)}")
    own = take_options(options)
    path = resolve_model(model)
    config, _ = load_model_meta(path)
    settings = embed_settings(path, config, own)
    return {"options": settings.task_options(), "pooling": settings.pooling.as_dict(),
            "max_batch_tokens": max_batch_tokens}


def _classify_options(model: str, task: str, options: dict[str, Any]) -> dict[str, Any]:
    """`DatasetClassifier`'s `options` and `max_batch_tokens`, checked against the model's
    files (InputError for an unknown or a bad option, ModelError for a model that is not a
    classifier, or for the score task a causal LM)."""
    from nanoserve import InputError

    options = dict(options)
    max_batch_tokens = options.pop("max_batch_tokens", JOB["max_batch_tokens"].default_for(task))
    unknown = sorted(set(options) - set(CLASSIFY_OPTIONS))
    if unknown:
        raise InputError(f"not a {task} option: {', '.join(unknown)}")
    path = resolve_model(model)
    config, tokenizer = load_meta(path, task)
    task_options(task, options, config, [], path, tokenizer)  # limit, head, instruction
    return {"options": options, "max_batch_tokens": max_batch_tokens}


__all__ = ["DatasetClassifier", "DatasetEmbedder", "DatasetGenerator", "DatasetStage", "build_processor"]
