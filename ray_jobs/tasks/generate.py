"""Stage tasks: the generation task of the job pipeline, a completion per row (`nanoserve batch`,
`run_job(..., task="generate")`, the default).

What generation adds to the job's walk (`ray_jobs.workers.tasks`, `ray_jobs.dispatch.driver.run_pipeline`):
- on the driver (`plan_job`): the rows' `RowPreparer` (sampling defaults, a job-wide
  structured output compiled, the chat template checked), the LoRA adapters' folders
  checked against the model (`--lora`; their files in the manifest's settings), the
  reasoning parser picked, the
  output controls and the parts' schema (`prepare.ColumnPlan.output_schema`), whether
  the job writes the OpenAI output files (an input of OpenAI batch requests, or
  `--output-format openai`);
- on the workers (`GenerateTask`, `RayBatchWorker`): rows prepared (each with its adapter:
  `ray_jobs.preparation.lora_column`), run by
  `BatchWorker.run_batch` (one result row per sample; the engine's reasoning parser, the
  one picked here and named in the workers' `reasoning_parser`, split the think block off);
  in a job with OpenAI output files, each shard's lines of them written with its part
  (`ray_jobs.workers.tasks.ShardRunner.commit`);
- what the user sees: tokens, output tokens/s, padding waste and the prefix cache's hit rate
  in the summary; output tokens/s on the progress bar.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve import InputError, NanoserveError
from ray_jobs.input.files import InputInfo
from ray_jobs.output import openai_files
from ray_jobs.output.manifest import file_fingerprint
from ray_jobs.preparation.lora_column import check_lora_column, row_adapter
from ray_jobs.preparation.prepare import (
    ColumnPlan,
    RowPreparer,
    output_controls,
)
from ray_jobs.preparation.row_images import ModelImages
from ray_jobs.preparation.silent_no_ops import column_slips, unread_template_kwargs
from ray_jobs.workers.options import JobOptions
from ray_jobs.workers.tasks import ShardOutcome, ShardWorker, TaskKind, TaskPlan
from ray_jobs.workers.worker import BatchWorker, GenerationRequest, error_rows


class GenerateTask:
    """Generation: rows prepared by `ray_jobs.preparation.prepare.RowPreparer`, run by
    `BatchWorker.run_batch`, one result row per sample (the think block already split off
    by the engine's reasoning parser, if it runs one)."""

    verb = "generation"  # in the message of rows whose run raised

    def __init__(self, plan: ColumnPlan, options: dict[str, Any], tokenizer: Any, config: Any,
                 engine: Any = None, grammars: Any = None, preparer: Any = None,
                 static_rows: int | None = None, images: Any = None,
                 adapters: tuple[str, ...] = ()) -> None:
        """`options`: the job's `JobSpec.task_options` (sampling `defaults`,
        `chat_template_kwargs`, `max_batch_tokens`); `static_rows`: the
        most rows a static engine runs at once (None: a continuous engine, or none);
        `images`: the model's `ray_jobs.preparation.row_images.ModelImages` (None: it takes no
        images); `adapters`: the engine's LoRA adapters' names (a request's `model` may name
        one)."""
        eos = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids)))
        self.preparer = preparer or RowPreparer(
            plan, tokenizer, config.max_position_embeddings, config.vocab_size,
            options["defaults"], eos_token_ids=eos, grammars=grammars,
            chat_template_kwargs=options.get("chat_template_kwargs"), images=images)
        self.engine = engine
        self.static_rows = static_rows
        self.max_batch_tokens = options.get("max_batch_tokens")
        self.adapters = adapters

    def batches(self, rows: list[Any]) -> list[list[int]]:
        """The engine's batches of `rows` (indices into them), a call each: one of all the
        rows, in input order, for a continuous engine (it admits rows as others finish); for
        a static one
        the rows sorted by prompt length, longest first, and cut at `static_rows` samples
        and the job's `max_batch_tokens` (`ray_jobs.preparation.batching.cut_batches`): a static
        batch is padded to its longest row and runs until its last row ends."""
        if self.static_rows is None:
            return [list(range(len(rows)))]
        from ray_jobs.preparation.batching import BatchLimits, cut_batches

        limits = BatchLimits(self.static_rows, self.max_batch_tokens)
        at = {id(r): i for i, r in enumerate(rows)}
        return [[at[id(r)] for r in batch] for batch in cut_batches(rows, limits)]

    def requests(self, rows: list[Any]) -> list[Any]:
        return [GenerationRequest(r.prompt_token_ids, r.params, r.images,
                                  row_adapter(r.values, self.adapters)) for r in rows]

    def results(self, table: pa.Table, rows: list[Any]) -> list[list[dict[str, Any]]]:
        """The engine's table as each row's samples' results."""
        return _per_row(table.to_pylist(), [r.n for r in rows])

    def error_results(self, message: str, row: Any) -> list[dict[str, Any]]:
        return error_rows(message, row.num_prompt_tokens, row.n)

    def count(self, out: ShardOutcome, row: Any, samples: list[dict[str, Any]]) -> None:
        out.empty_answers += sum(res["finish_reason"] == "stop" and res["generated_text"] == ""
                                 for res in samples)
        if row.params is not None and row.params.structured_outputs is not None:
            cut = sum(res["finish_reason"] == "length" for res in samples)
            if cut:
                out.cut_constrained[row.params.max_tokens] += cut


class RayBatchWorker(ShardWorker, BatchWorker):
    """The generation task's actor: a `BatchWorker` that runs shards (`ShardWorker`)."""

    admits_rows = True  # its continuous engine does

    def make_task(self, spec: Any) -> GenerateTask:
        static = getattr(self.llm, "scheduler", "static") == "static"
        return GenerateTask(spec.plan, spec.task_options, self.llm.tokenizer, self.llm.config,
                            engine=self.run_batch, grammars=self.llm.grammars,
                            static_rows=self.llm.max_batch_size if static else None,
                            images=ModelImages.of_engine(self.llm),
                            adapters=getattr(self.llm, "lora_names", ()))


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


def take_options(options: dict[str, Any]) -> dict[str, Any]:
    """Generation's options are the job's own (`JobOptions`): none to take."""
    return {}


def prompt_column(given: str | None, names: list[str]) -> str | None:
    """The prompt column named by the user, else each row's first of `prepare.PROMPT_COLUMNS`."""
    return given


def plan_job(opts: JobOptions, own: dict[str, Any], info: InputInfo, plan: ColumnPlan,
             model_path: Path, config: Any, tokenizer: Any) -> TaskPlan:
    """Generation's part of the job (see the module docstring). InputError for the job's
    sampling options, a structured output that does not compile, a chat template that is
    missing or broken for chat rows, a reasoning parser the model cannot run, or a `lora`
    column that is not text; ModelError for a LoRA adapter folder that cannot be used."""
    check_lora_column(info.schema)
    opts, adapters = _checked_adapters(opts, config)
    eos = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids)))
    # (the driver's preparer makes error rows only: it never reads an image)
    preparer = RowPreparer(plan, tokenizer, config.max_position_embeddings, config.vocab_size,
                           opts.sampling_defaults(), eos_token_ids=eos,
                           chat_template_kwargs=opts.chat_template_kwargs,
                           images=ModelImages.of(config, model_path))
    from nanoserve import choose_reasoning_parser

    try:  # the engine's choice, made once here: no parser is built on the driver
        reasoning, reasoning_line = choose_reasoning_parser(opts.reasoning_parser,
                                                            config.architecture, tokenizer)
    except ValueError as e:
        raise InputError(f"--reasoning-parser: {e}") from None
    # The workers' engines run the parser picked here, by name (`JobOptions.reasoning_parser`,
    # the engine's option): it splits their completions, steers budgets and constraints.
    opts = dataclasses.replace(opts, reasoning_parser=reasoning or "none")
    if reasoning is None and (opts.max_thinking_tokens is not None
                              or "max_thinking_tokens" in plan.override_columns):
        raise InputError("--max-thinking-tokens / a 'max_thinking_tokens' column needs a "
                         "reasoning parser (--reasoning-parser qwen3|deepseek_r1)")
    controls = output_controls(plan, opts.sampling_defaults(), reasoning=reasoning is not None)
    schema = plan.output_schema(controls)  # an input column that clashes is refused here
    options = {"defaults": opts.sampling_defaults(),
               "chat_template_kwargs": opts.chat_template_kwargs,
               "max_batch_tokens": opts.max_batch_tokens}
    warnings = column_slips(info.schema.names) + unread_template_kwargs(
        tokenizer, preparer.template_kwargs, "--chat-template-kwargs")
    return TaskPlan(opts, schema, GenerateTask(plan, options, tokenizer, config,
                                               preparer=preparer),
                    RayBatchWorker, controls, options, summary={"reasoning": reasoning_line},
                    settings={"lora": adapters} if adapters else {},
                    openai_output=openai_files.wants_openai_output(opts.output_format,
                                                                   info.openai_rows),
                    warnings=tuple(warnings))


def _checked_adapters(opts: JobOptions, config: Any) -> tuple[JobOptions, dict[str, Any]]:
    """The job's `--lora` adapters checked against the model before any worker starts
    (`nanoserve.check_lora_adapters`: every field and tensor header), their folders made
    absolute for the workers, and what the manifest records of them: each one's files."""
    if not opts.lora:
        return opts, {}
    if opts.scheduler == "static":
        raise InputError("--lora runs on the continuous scheduler only (--scheduler auto or "
                         "continuous)")
    from nanoserve import check_lora_adapters

    folders = check_lora_adapters(opts.lora, config)
    files = {name: [file_fingerprint(folder / f)
                    for f in ("adapter_config.json", "adapter_model.safetensors")]
             for name, folder in folders.items()}
    return dataclasses.replace(opts, lora=tuple(f"{n}={p}" for n, p in folders.items())), files


def progress(run: Any, elapsed: float) -> str:
    """The progress bar's rates after `elapsed` seconds."""
    return f"{run.output_tokens / elapsed:.1f} out tok/s"


def summary_lines(s: Any) -> list[str]:
    """The summary's generation lines (`ray_jobs.dispatch.driver.JobSummary.format`). The
    wall time's rate counts the job's fixed cost (Ray's start, the workers' load); beside
    it, the rate while the workers generated (the first shard and generate phases)."""
    generating = s.timings.get("first_shard", 0.0) + s.timings.get("generate", 0.0)
    return [
        f"tokens: {s.input_tokens} input, {s.output_tokens} output",
        f"wall time: {s.wall_time_s:.1f} s, {s.output_tokens_per_s:.1f} output tokens/s"
        + (f" (generation: {generating:.1f} s, {s.output_tokens / generating:.1f} output "
           f"tokens/s)" if generating > 0 else ""),
        f"padding waste: {s.padding_waste:.1%} of the padded prefill",
        *([f"prefix cache: {s.prefix_hit_rate:.1%} of prompt tokens served from it"]
          if s.prefix_hit_rate is not None else []),
    ]


GENERATE = TaskKind("generate", "batch", ("stop", "length", "error"), take_options,
                    prompt_column, plan_job, progress, summary_lines)


__all__ = ["GENERATE", "GenerateTask", "RayBatchWorker"]
