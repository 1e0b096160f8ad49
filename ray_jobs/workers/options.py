"""Stage workers: the batch job's options (`JobOptions`, the `nanoserve batch` flags),
checked once when built, and `--num-workers` read as a `WorkerRange`. Its own module so
that the workers, the tasks, the pool and the driver all read it, one way. Every field is
declared, with its default and check, in `nanoserve.options` (what the engine shares) or
`ray_jobs.options.JOB` (the job's own).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

from nanoserve import (
    ENGINE,
    SAMPLING,
    STRUCTURED,
    InputError,
    NanoserveError,
    check_online,
)
from ray_jobs.options import JOB

DTYPES = ENGINE["dtype"].choices
SCHEDULERS = ENGINE["scheduler"].choices
KV_CACHE_DTYPES = ENGINE["kv_cache_dtype"].choices
# The shard and batch bounds of the prefill-only tasks (embedding, classification, scores):
# larger shards than generation's, their batches bounded by tokens (`JOB`'s overrides).
PREFILL_BATCH_SIZE = JOB["batch_size"].default_for("embed")
PREFILL_BATCH_TOKENS = JOB["max_batch_tokens"].default_for("embed")


@dataclass(frozen=True)
class WorkerRange:
    """`--num-workers`: `low` workers at least, `high` at most (None: every GPU the cluster
    has or gains). `grows`: a range or `auto`, which starts with the GPUs present (waiting
    for `low` of them) and takes each GPU that joins later, up to `high`; else a plain
    number, as many workers as that (capped to the cluster, on its GPUs or else its CPUs)."""

    low: int
    high: int | None
    grows: bool

    def describe(self) -> str:
        if not self.grows:
            return str(self.low)
        return "auto" if self.high is None and self.low == 1 else \
            f"{self.low}-{'' if self.high is None else self.high}"


def parse_num_workers(value: int | str | None) -> WorkerRange | None:
    """None (one worker per GPU of the cluster, 1 without GPUs), a number, 'MIN-MAX', or
    'auto' (= '1-': every GPU the cluster has or gains). NanoserveError otherwise."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == "auto":
        return WorkerRange(1, None, True)
    if re.fullmatch(r"-?\d+", text):
        n = int(text)
        if n < 1:
            raise NanoserveError(f"num_workers must be >= 1, got {n}")
        return WorkerRange(n, n, False)
    match = re.fullmatch(r"(\d+)-(\d*)", text)
    if match is None:
        raise NanoserveError(f"num_workers must be a number, MIN-MAX or auto, got {value!r}")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) else None
    if low < 1 or (high is not None and high < low):
        raise NanoserveError(f"num_workers range must have 1 <= MIN <= MAX, got {value!r}")
    return WorkerRange(low, high, True)


@dataclass(frozen=True)
class JobOptions:
    """The job's options (the CLI's flags). Sampling fields are the defaults that per-row
    columns override. The fields that `nanoserve.options` declares (sampling, structured
    output, engine) take their defaults and checks from it; the job's own are here."""

    model: str = ENGINE["model"].default
    max_tokens: int = SAMPLING["max_tokens"].default
    temperature: float = SAMPLING["temperature"].default
    top_p: float = SAMPLING["top_p"].default
    top_k: int = SAMPLING["top_k"].default
    seed: int | None = SAMPLING["seed"].default
    stop: tuple[str, ...] = SAMPLING["stop"].default
    ignore_eos: bool = SAMPLING["ignore_eos"].default
    # samples per row (1-128): one output row each, sample i drawing with seed + i
    n: int = SAMPLING["n"].default
    # per generated token: its logprob, rank and this many top
    logprobs: int | None = SAMPLING["logprobs"].default
    # the same for each prompt token after the first
    prompt_logprobs: int | None = SAMPLING["prompt_logprobs"].default
    # A structured output for every row that sets none of its own (at most one of these):
    # a JSON schema (JSON text, or a dict)
    json_schema: str | dict | None = STRUCTURED["json_schema"].default
    regex: str | None = STRUCTURED["regex"].default  # the whole text matches it
    choice: tuple[str, ...] = STRUCTURED["choice"].default  # the text is one of these
    # with `choice`: each row's probability of every label (the `choice_scores` column),
    # from forward passes, and the most likely label as its text
    choice_scores: bool = STRUCTURED["choice_scores"].default
    # chat-template options for every chat row (e.g. {"enable_thinking": false}), a dict or
    # its JSON text, kept as JSON text; a row's `chat_template_kwargs` column updates them
    chat_template_kwargs: str | dict | None = JOB["chat_template_kwargs"].default
    # 'qwen3' / 'deepseek_r1': the think block split from the answer (nanoserve.sampling.reasoning);
    # 'auto': picked from the model family where certain; 'none' (or None): no split
    reasoning_parser: str | None = ENGINE["reasoning_parser"].default
    # under a reasoning parser: at most this many tokens in a think block, then the engine
    # closes it (a row's `max_thinking_tokens` column overrides it)
    max_thinking_tokens: int | None = SAMPLING["max_thinking_tokens"].default
    dtype: str = ENGINE["dtype"].default  # bfloat16 on GPU, float32 on CPU
    # "fp8": projections quantized at load (GPU workers)
    quantization: str | None = ENGINE["quantization"].default
    # None: one per GPU of the cluster, 1 without GPUs; or "MIN-MAX" / "auto": GPU workers
    # that grow as GPUs join (see ray_jobs.dispatch.autoscale)
    num_workers: int | str | None = JOB["num_workers"].default
    batch_size: int = JOB["batch_size"].default  # rows per shard
    # a static engine's rows x max(prompt + max_tokens) per batch; a prefill-only one's tokens
    max_batch_tokens: int | None = JOB["max_batch_tokens"].default
    prompt_column: str | None = JOB["prompt_column"].default
    id_column: str | None = JOB["id_column"].default
    # 'auto': JSONL lines shaped as OpenAI batch requests are read as such; 'openai': every
    # line must be one; 'plain': none is (ray_jobs.input.openai_requests)
    input_format: str = JOB["input_format"].default
    # 'auto': output.jsonl / errors.jsonl too when the input holds OpenAI batch requests;
    # 'openai': always; 'parquet': the parts only
    output_format: str = JOB["output_format"].default
    # Ray address; None: RAY_ADDRESS, a running cluster, or local
    address: str | None = JOB["address"].default
    overwrite: bool = JOB["overwrite"].default
    retry_errors: bool = JOB["retry_errors"].default  # compute again the shards with error rows
    kv_cache_fraction: float = ENGINE["kv_cache_fraction"].default  # of a GPU's free memory
    # the KV pool's exact size per worker (else the above)
    kv_cache_bytes: int | None = ENGINE["kv_cache_bytes"].default
    # the model's dtype, or "fp8" (e4m3, sm_89+ GPUs)
    kv_cache_dtype: str = ENGINE["kv_cache_dtype"].default
    # each worker's engine: the most rows decoding at once (LLM's max_batch_size); a worker
    # holds a few times that many rows (`ray_jobs.dispatch.pool.hold_limits`); None: the engine's
    # default (`nanoserve.scheduling.model_runner.default_max_rows`: from its KV pool, 256-1,024 on a GPU)
    max_running_rows: int | None = ENGINE["max_running_rows"].default
    # each worker's engine: continuous (nanoserve.llm.LLM)
    scheduler: str = ENGINE["scheduler"].default
    # engines reuse the KV blocks of shared prompt prefixes
    prefix_caching: bool = ENGINE["prefix_caching"].default
    # LoRA adapters, "NAME=PATH" (local PEFT folders); a row picks one by its `lora` column
    lora: tuple[str, ...] = ENGINE["lora"].default
    chunk_rows: int = JOB["chunk_rows"].default  # rows read and tokenized at a time
    # shards a worker holds at once; None: as many as keep its engine full (`hold_limits`)
    max_in_flight_per_worker: int | None = JOB["max_in_flight_per_worker"].default
    # for an actor to be placed and load the model
    worker_start_timeout_s: float = JOB["worker_start_timeout_s"].default
    # worker deaths with no shard answered between them
    max_deaths_in_a_row: int = JOB["max_deaths_in_a_row"].default
    progress: bool = JOB["progress"].default  # a tqdm bar on stderr

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "choice", tuple(self.choice or ()))
        object.__setattr__(self, "lora", tuple(self.lora or ()))
        if problem := ENGINE["lora"].problem(self.lora, ENGINE["lora"].flag):
            raise InputError(problem)
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InputError(f"--json-schema: the JSON schema is not valid JSON "
                                     f"({e})") from None
        if schema is not None:  # one text whatever the file's layout (keys keep their order:
            # the properties of an object are generated in it)
            object.__setattr__(self, "json_schema", json.dumps(schema, ensure_ascii=False))
        asked = [flag for flag, value in (("--json-schema", self.json_schema),
                                          ("--regex", self.regex), ("--choice", self.choice))
                 if value is not None and value != ()]
        if len(asked) > 1:
            raise InputError(f"give at most one structured output for the job, not "
                                 f"{' and '.join(asked)}")
        so = self.structured_outputs()
        if so is not None and so.problems():
            raise InputError(f"{asked[0]}: {so.problems()[0]}")
        if self.chat_template_kwargs is not None:
            from nanoserve import template_kwargs

            try:
                kwargs = template_kwargs(self.chat_template_kwargs, "--chat-template-kwargs")
            except ValueError as e:
                raise InputError(str(e)) from None
            object.__setattr__(self, "chat_template_kwargs",
                               json.dumps(kwargs, ensure_ascii=False) if kwargs else None)
        if self.choice_scores:
            from nanoserve import check_labels

            if not self.choice:
                raise InputError("--choice-scores needs the labels: give them with --choice")
            try:
                check_labels(self.choice)
            except ValueError as e:
                raise InputError(f"--choice: {e}") from None
        if self.reasoning_parser is not None:  # (None is "none")
            parser = ENGINE["reasoning_parser"]
            if problem := parser.problem(self.reasoning_parser, "reasoning parser"):
                raise InputError(problem)
        thinking = SAMPLING["max_thinking_tokens"]
        if problem := thinking.problem(self.max_thinking_tokens, thinking.flag):
            raise InputError(problem)
        for name in ("scheduler", "dtype", "kv_cache_fraction", "kv_cache_dtype",
                     "max_running_rows", "kv_cache_bytes"):  # the engine's, as LLM's
            if problem := ENGINE[name].problem(getattr(self, name)):
                raise NanoserveError(problem)
        for name, option in JOB.items():  # the job's own, as declared
            if name in _FIELDS and (problem := option.problem(getattr(self, name))):
                raise InputError(problem)
        check_online(self.quantization)
        parse_num_workers(self.num_workers)  # raises NanoserveError if invalid

    def structured_outputs(self) -> Any:
        """The job-wide `nanoserve.sampling.structured.StructuredOutputs`, or None."""
        if self.json_schema is None and self.regex is None and not self.choice:
            return None
        from nanoserve import StructuredOutputs

        return StructuredOutputs(json=self.json_schema, regex=self.regex,
                                 choice=self.choice or None)

    def sampling_defaults(self) -> dict[str, Any]:
        """The `SamplingParams` fields every row starts from."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop, "ignore_eos": self.ignore_eos, "n": self.n,
                "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs,
                "structured_outputs": self.structured_outputs(),
                **({"choice_scores": True} if self.choice_scores else {}),
                **({"max_thinking_tokens": self.max_thinking_tokens}
                   if self.max_thinking_tokens is not None else {})}


_FIELDS = {f.name for f in fields(JobOptions)}


__all__ = ["DTYPES", "KV_CACHE_DTYPES", "SCHEDULERS", "JobOptions", "WorkerRange",
           "parse_num_workers"]
