"""Stage tasks: the classification task (a label per row, `nanoserve classify`,
`run_job(..., task="classify")`) and the score task (a score per text pair, `nanoserve
score`, `run_job(..., task="score")`), over a checkpoint with a sequence-classification head:
an encoder (BERT, XLM-RoBERTa, ModernBERT: nanoserve/encoder/) or a decoder
(`*ForSequenceClassification` of a registered family, reward models among them:
nanoserve/classify.py); and for the score task a causal LM too, as a Qwen3-Reranker-style
reranker (nanoserve/rerank.py). The engine object is `nanoserve.load_classifier`'s, the same
face whatever the model (`Classifier`).

    summary = run_job("reviews.jsonl", "labels/", task="classify", model="classifier/")
    summary = run_job("pairs.jsonl", "scores/", task="score", model="reranker/")
    summary = run_job("pairs.jsonl", "scores/", task="score", model="Qwen3-Reranker-0.6B/",
                      instruction="Given a question, retrieve passages that answer it")

classify: each row's text (its `prompt` or `text` column, or `--prompt-column`) through the
head. The output has `id`, the input columns, then
- `label` (string): single-label heads: the most probable label (config.json's `id2label`);
  null for a multi-label head (read `probs`) and for a regression head;
- `probs` (map<string, float64>): label -> probability, softmax over the labels for a
  single-label head, each label's sigmoid for a multi-label one; null for regression;
- `score` (float64): a regression (reward) head's raw output; null otherwise. A regression
  head of more than one output is refused;
- `num_input_tokens`, `error` (null unless the row failed).

score: each row's pair, columns `text_1` and `text_2` (else `query` and `document`),
tokenized as one input (the tokenizer's pair template, segment ids 0 / 1; a reranker's
prompt around query and document, with `instruction`, default the model card's). The output
has `id`, the input columns, then `score` (float64: a one-output head's raw logit, as
sentence-transformers' `CrossEncoder.predict` gives it with an identity activation; a
two-label head's probability of label 1: softmax, or sigmoid for a multi-label head; a
reranker's P(yes), its two labels being ("no", "yes")), `num_input_tokens` and `error`.
Other heads are refused, and an instruction for a model that is not a reranker.

Both are the job every task runs (`ray_jobs.dispatch.driver.run_job`): streaming input,
shards, dispatch, exactly-once parts, resume (the manifest's settings name the task and
its limit, so a rerun with another task or limit is refused), object storage and report.
Rows are cut to the input limit (`max_input_tokens`, default and at most the model's
positions; pairs lose tokens from the longer text first) and counted; with `truncate=False`
a longer row is an error row. A missing, null or empty text (or either text of a pair) is
an error row. A causal LM given to classify, a base model or a GGUF file is refused with a
line naming what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve import ENGINE, InputError, NanoserveError
from ray_jobs.input.files import InputChunk, InputInfo
from ray_jobs.preparation.prepare import (
    TEXT,
    ColumnPlan,
    read_rows,
    text_of,
    text_prompt_column,
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

# The options both tasks add to `JobOptions` (a subset of the embedding task's, same meaning;
# `instruction` a reranker's only).
CLASSIFY_OPTIONS = ("max_input_tokens", "truncate", "instruction")
# The score task's pair columns, in order of preference.
PAIR_COLUMNS = (("text_1", "text_2"), ("query", "document"))

CLASSIFY_RESULT = pa.schema([pa.field("label", pa.string()),
                             pa.field("probs", pa.map_(pa.string(), pa.float64())),
                             pa.field("score", pa.float64()),
                             pa.field("num_input_tokens", pa.int32()),
                             pa.field("error", pa.string())])
SCORE_RESULT = pa.schema([pa.field("score", pa.float64()),
                          pa.field("num_input_tokens", pa.int32()),
                          pa.field("error", pa.string())])
RESULTS = {"classify": CLASSIFY_RESULT, "score": SCORE_RESULT}
_BOOKKEEPING = [pa.field("finish_reason", pa.string()), pa.field("num_generated_tokens", pa.int32())]


def worker_schema(task: str) -> pa.Schema:
    return pa.schema(list(RESULTS[task]) + _BOOKKEEPING)


@dataclass(frozen=True)
class ClassifyRow:
    """One input row ready for a batch (the `batching.BatchRow` protocol)."""

    position: int
    id: Any
    values: dict[str, Any]
    prompt_token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] = ()
    error: str | None = None
    truncated: bool = False
    params: None = None
    n: int = 1
    max_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def pair_columns(names: list[str]) -> tuple[str, str] | None:
    """The score task's (first, second) columns in an input with these columns."""
    return next((p for p in PAIR_COLUMNS if p[0] in names), None)


class ClassifyPreparer:
    """Input chunks to `ClassifyRow`s: a text (classify) or a pair (`pair`: its two columns,
    score) tokenized by the classifier's tokenizer (a reranker's with `instruction`), cut to
    `limit` tokens (or, without `truncate`, an error row when longer)."""

    def __init__(self, plan: ColumnPlan, tokenizer: Any, limit: int, truncate: bool = True,
                 pair: tuple[str, str] | None = None, instruction: str | None = None) -> None:
        self.plan, self.limit, self.truncate, self.pair = plan, limit, truncate, pair
        self.tokenizer = tokenizer.with_limit(limit)
        if instruction is not None:
            self.tokenizer = self.tokenizer.with_instruction(instruction)

    def prepare(self, chunk: InputChunk, first_position: int,
                read_images: bool = True) -> list[ClassifyRow]:
        out = []
        for position, row_id, values, error, parsed in read_rows(
                chunk, first_position, self.plan.id_column, self._ids):
            ids, types, cut = parsed or ((), (), False)
            out.append(ClassifyRow(position, row_id, values, ids, types, error, cut))
        return out

    def _text(self, values: dict[str, Any], column: str) -> str:
        value = values.get(column)
        if value is None:
            raise ValueError(f"no text: column {column!r} is null or missing")
        value = text_of(value, column)
        if not value.strip():
            raise ValueError(f"empty text (column {column!r})")
        return value

    def _ids(self, values: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        if self.pair is not None:
            ids, types, cut = self.tokenizer.encode_row(self._text(values, self.pair[0]),
                                                        self._text(values, self.pair[1]))
        else:
            column, kind = self.plan.prompt_of(values, "text")
            if kind != TEXT:
                raise ValueError(f"column {column!r} holds {kind.replace('_', ' ')}; a "
                                 f"classification job reads text")
            ids, types, cut = self.tokenizer.encode_row(self._text(values, column))
        if cut and not self.truncate:
            raise ValueError(f"input is above the limit of {self.limit} tokens "
                             f"(--max-input-tokens; without --no-truncate it would be cut)")
        return tuple(ids), tuple(types), cut


class ClassifyWorker:
    """A classifier (`nanoserve.load_classifier`: an encoder's, a decoder's head, a reranker
    for the score task) held for the life of the process; `run_batch` answers one row per
    request with the task's result columns (`RESULTS[task]`) and, for the job's
    bookkeeping, `finish_reason` ('stop' or 'error') and `num_generated_tokens` (0)."""

    def __init__(self, model: str, dtype: str = ENGINE["dtype"].default, device: str | None = None,
                 num_threads: int | None = None, max_batch_tokens: int = PREFILL_BATCH_TOKENS,
                 task: str = "classify", **_generation: Any) -> None:
        import threading

        from nanoserve import load_classifier
        from ray_jobs.workers.worker import _fault_hold_load_while_file, _fault_on_load, pick_device

        _fault_hold_load_while_file()
        _fault_on_load()
        if num_threads:
            import torch

            torch.set_num_threads(num_threads)
        self.task = task
        self.classifier = load_classifier(model, dtype=dtype, device=device or pick_device(),
                                          max_batch_tokens=max_batch_tokens,
                                          rerank=task == "score")
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        import os
        import socket

        from ray_jobs.workers.worker import ray_gpu_ids

        return {"gpu_ids": ray_gpu_ids(), "device": str(self.classifier.model.device),
                "host": socket.gethostname(), "pid": os.getpid(),
                "scheduler": "classification" if self.task == "classify" else "scoring"}

    def run_batch(self, requests: list[Any]) -> pa.Table:
        from ray_jobs.workers.worker import (
            OOM_KEY,
            PREFILL_SLOTS_KEY,
            PREFILL_TOKENS_KEY,
            _fault_hold_while_file,
            _first_line,
        )

        _fault_hold_while_file()
        ids = [list(r.prompt_token_ids) for r in requests]
        types = [list(r.token_type_ids) or [0] * len(r.prompt_token_ids) for r in requests]
        results: list[dict[str, Any]]
        try:
            with self._lock:
                logits = self.classifier.classify_ids(ids, types)
            results = self.read_logits(logits)
        except (NanoserveError, ValueError, RuntimeError):  # each row alone: a bad one fails
            results = []
            for i, t in zip(ids, types):
                try:
                    with self._lock:
                        results += self.read_logits(self.classifier.classify_ids([i], [t]))
                except (NanoserveError, ValueError, RuntimeError) as e:
                    results.append({"error": f"{self.task} failed: {type(e).__name__}: "
                                             f"{_first_line(str(e))}"})
        rows = [{**res, "num_input_tokens": len(i), "num_generated_tokens": 0,
                 "finish_reason": "error" if res.get("error") else "stop"}
                for res, i in zip(results, ids)]
        table = pa.Table.from_pylist(rows, schema=worker_schema(self.task))
        real = sum(len(i) for i in ids)
        return table.replace_schema_metadata({PREFILL_SLOTS_KEY: str(real).encode(),
                                              PREFILL_TOKENS_KEY: str(real).encode(),
                                              OOM_KEY: b"0"})

    def read_logits(self, logits: Any) -> list[dict[str, Any]]:
        """Each row's result columns from its logits (see the module docstring)."""
        config = self.classifier.config
        preds = self.classifier.predict(logits)
        if self.task == "score":
            if config.num_labels == 1:
                return [{"score": float(row[0])} for row in logits]
            second = config.id2label[1]
            return [{"score": p.probs[second]} for p in preds]
        if config.problem_type == "regression":
            return [{"score": p.score} for p in preds]
        multi = config.problem_type == "multi_label_classification"
        return [{"label": None if multi else p.label, "probs": p.probs} for p in preds]


def error_row(message: str, num_input_tokens: int = 0) -> dict[str, Any]:
    return {"num_input_tokens": num_input_tokens, "error": message, "finish_reason": "error",
            "num_generated_tokens": 0}


class ClassifyTask:
    """Both tasks' plug-in of the shard walk (`ray_jobs.workers.tasks`): rows prepared by
    `ClassifyPreparer`, run by `ClassifyWorker.run_batch`, one result row a row."""

    def __init__(self, plan: ColumnPlan, options: dict[str, Any], tokenizer: Any,
                 config: Any = None, engine: Any = None) -> None:
        """`options`: the job's `JobSpec.task_options` (`task`, `limit`, `truncate`, `pair`,
        `instruction`)."""
        pair = options.get("pair")
        self.verb = "classification" if options["task"] == "classify" else "scoring"
        self.preparer = ClassifyPreparer(plan, tokenizer, options["limit"],
                                         options.get("truncate", True),
                                         tuple(pair) if pair else None,
                                         options.get("instruction"))
        self.engine = engine

    def batches(self, rows: list[Any]) -> list[list[int]]:
        """One batch, one engine call (the classifier packs its rows by tokens itself)."""
        return [list(range(len(rows)))]

    def requests(self, rows: list[Any]) -> list[Any]:
        return rows

    def results(self, table: pa.Table, rows: list[Any]) -> list[list[dict[str, Any]]]:
        out = []
        for res in table.to_pylist():
            if res.get("probs") is not None:
                res["probs"] = dict(res["probs"])
            out.append([res])
        return out

    def error_results(self, message: str, row: Any) -> list[dict[str, Any]]:
        return [error_row(message, row.num_prompt_tokens)]

    def count(self, out: ShardOutcome, row: Any, samples: list[dict[str, Any]]) -> None:
        out.truncated += bool(getattr(row, "truncated", False))


class RayClassifyWorker(ShardWorker, ClassifyWorker):
    """Both tasks' actor: a `ClassifyWorker` that runs shards (`ShardWorker`)."""

    def make_task(self, spec: Any) -> ClassifyTask:
        return ClassifyTask(spec.plan, spec.task_options, self.classifier.tokenizer,
                            engine=self.run_batch)


def take_options(options: dict[str, Any]) -> dict[str, Any]:
    """`CLASSIFY_OPTIONS`, popped from the job's keyword arguments; the prefill-only batch
    bounds (as embedding's) set as the job's defaults."""
    own = {k: options.pop(k) for k in CLASSIFY_OPTIONS if k in options}
    options.setdefault("batch_size", PREFILL_BATCH_SIZE)
    if options.get("max_batch_tokens") is None:
        options["max_batch_tokens"] = PREFILL_BATCH_TOKENS
    return own


def score_prompt_column(given: str | None, names: list[str]) -> str | None:
    """The score task reads its pair columns (`PAIR_COLUMNS`); the first is planned as the
    prompt column. InputError when the input has no pair."""
    found = ", ".join(repr(n) for n in names) or "(none)"
    if given is not None:
        raise InputError("a score job reads the pair columns text_1 and text_2 (or query and "
                         "document); --prompt-column does not apply")
    pair = pair_columns(names)
    if pair is None or pair[1] not in names:
        raise InputError(f"a score job reads columns text_1 and text_2 (or query and "
                         f"document); columns found: {found}")
    return pair[0]


def _limit(own: dict[str, Any], config: Any) -> int:
    top = config.max_position_embeddings
    limit = own.get("max_input_tokens")
    if limit is None:
        return top
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= top:
        raise InputError(f"max_input_tokens must be an integer from 1 to the model's "
                         f"{top} positions, got {limit!r}")
    return limit


def task_options(task: str, own: dict[str, Any], config: Any, names: list[str],
                 model_path: Path, tokenizer: Any) -> dict[str, Any]:
    """`ClassifyTask`'s options (the job's `JobSpec.task_options`) for an input of these
    columns, from `take_options`' result and the classifier's config and tokenizer
    (`load_meta`). InputError for a head the task cannot read, a limit above the model's
    positions (or, for a reranker, too short for its prompt), an instruction for a model
    that is not a reranker, an input column clashing with an output one."""
    clashes = [n for n in RESULTS[task].names if n in names and n not in ("error",
                                                                          "num_input_tokens")]
    if clashes:
        raise InputError(f"input column {clashes[0]!r} clashes with the output column of that "
                         f"name; rename it")
    if task == "score" and not (config.num_labels == 1 or config.num_labels == 2):
        raise InputError(f"a score job needs a head of one output or two labels; model "
                         f"{model_path} has {config.num_labels} ({', '.join(config.id2label)})")
    if (task == "classify" and config.problem_type == "regression"
            and config.num_labels != 1):
        raise InputError(f"model {model_path} is a regression head of {config.num_labels} "
                         f"outputs; a classify job reads one ('score')")
    instruction = own.get("instruction") or None
    if instruction is not None and not isinstance(instruction, str):
        raise InputError(f"instruction must be a text, got {instruction!r}")
    if instruction is not None and tokenizer.instruction is None:
        raise InputError(f"--instruction applies to a causal-LM reranker (score); model "
                         f"{model_path} ({config.architecture}) takes none")
    limit = _limit(own, config)
    tokenizer = tokenizer.with_limit(limit)  # InputError: a reranker's prompt does not fit
    if instruction is not None:
        tokenizer = tokenizer.with_instruction(instruction)
    pair = pair_columns(names) if task == "score" else None
    return {"task": task, "limit": limit, "truncate": bool(own.get("truncate", True)),
            "pair": list(pair) if pair else None, "instruction": tokenizer.instruction}


def _plan(task: str, opts: JobOptions, own: dict[str, Any], info: InputInfo,
          plan: ColumnPlan, model_path: Path, config: Any, tokenizer: Any) -> TaskPlan:
    options = task_options(task, own, config, info.schema.names, model_path, tokenizer)
    settings = {"task": task, "limit": options["limit"], "truncate": options["truncate"],
                "labels": list(config.id2label), "problem_type": config.problem_type}
    if options["instruction"] is not None:  # a reranker's prompt
        settings["instruction"] = options["instruction"]
    schema = pa.schema([pa.field("id", plan.id_type)] + plan.passthrough_fields()
                       + list(RESULTS[task]))
    return TaskPlan(opts, schema, ClassifyTask(plan, options, tokenizer, config),
                    RayClassifyWorker, task_options=options,
                    actor_kwargs={"task": task, "max_batch_tokens": opts.max_batch_tokens},
                    settings={"sampling": None, task: settings},
                    report_settings={task: settings})


def plan_classify(*args: Any) -> TaskPlan:
    return _plan("classify", *args)


def plan_score(*args: Any) -> TaskPlan:
    return _plan("score", *args)


def load_meta(model_path: Path, task: str = "classify") -> tuple[Any, Any]:
    """The classifier's config and tokenizer (`nanoserve.read_classifier`; for the score
    task a causal LM's as a reranker's): a ModelError naming the supported architectures for
    anything else (a causal LM to classify, a base model, a GGUF file)."""
    from nanoserve import read_classifier

    return read_classifier(model_path, rerank=task == "score")


def load_score_meta(model_path: Path) -> tuple[Any, Any]:
    return load_meta(model_path, "score")


def summary_lines(s: Any) -> list[str]:
    """The summary's lines of either task (`ray_jobs.dispatch.driver.JobSummary.format`)."""
    return prefill_summary_lines(s, f"tokens: {s.input_tokens} input")


CLASSIFY = TaskKind("classify", "classify", (), take_options, text_prompt_column, plan_classify,
                    prefill_progress, summary_lines, load_meta)
SCORE = TaskKind("score", "score", (), take_options, score_prompt_column, plan_score,
                 prefill_progress, summary_lines, load_score_meta)


__all__ = ["CLASSIFY", "CLASSIFY_OPTIONS", "PAIR_COLUMNS", "RESULTS", "SCORE",
           "ClassifyPreparer", "ClassifyRow", "ClassifyTask", "ClassifyWorker",
           "RayClassifyWorker", "load_meta", "load_score_meta", "score_prompt_column",
           "task_options"]
