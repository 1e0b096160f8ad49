"""The job's own options, declared once: `JOB`, the options the engine does not take (how the
input is cut into shards and read, the cluster, reruns, the Ray Data stage's pool, the
prefill-only tasks' own), each an `Option` record of `nanoserve.options` (its default,
help, choices or check; an entry point's deliberate override, with its reason). The
options the engine shares (sampling, structured output, the engine's settings) are
`nanoserve.options`' tables.

What takes them from here: the job's commands (`ray_jobs.cli`: `add_option`, or a flag of
another shape that reads the option's default and help), `JobOptions`' fields and checks
(`ray_jobs.workers.options`), the tasks' defaults of the job's (`take_options`), the Ray
Data stage's keyword arguments (`ray_jobs.data_processor`), and the input stage's reading
defaults (`ray_jobs.input`).

Invariants: a default is written once, here; the job's base, below every stage: it imports
nothing of the job, and nothing of the engine but its public `Option` (torch-free), so
every stage and the command line read it (tests/test_layering.py). tests/test_options.py
holds every entry point to it and scans the source for a default written again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanoserve import Option

PREFILL_TASKS = ("embed", "classify", "score")  # their commands' and tasks' names


def _at_least(low: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            return f"must be an integer >= {low}, got {v!r}"
        return None
    return check


def _positive(unit: str = "") -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            return f"must be > 0{unit}, got {v!r}"
        return None
    return check


def _prefill(value: Any) -> tuple[tuple[str, Any], ...]:
    """The same override for each prefill-only task (embed, classify, score)."""
    return tuple((task, value) for task in PREFILL_TASKS)


JOB = {o.name: o for o in (
    # -- input and columns
    Option("prompt_column", str, None,
           "the column holding the prompt (text, messages or token ids)", metavar="NAME",
           helps=(("embed", "the column holding the text or token ids"),
                  ("classify", "the column holding the text"))),
    Option("id_column", str, None,
           "the column holding row ids (default: 'id' if present, else positions)",
           metavar="NAME"),
    Option("input_format", str, "auto",
           "auto: JSONL lines with custom_id and body are OpenAI batch requests; openai: "
           "every line must be one (a line that is not is an error row); plain: no line is "
           "(default: auto)",
           choices=("auto", "openai", "plain")),
    Option("output_format", str, "auto",
           "openai: also OUTPUT_DIR/output.jsonl and errors.jsonl in OpenAI's batch output "
           "shape, in input order, once the job completes; parquet: the parts only; auto: "
           "openai when the input holds OpenAI batch requests (default: auto)",
           choices=("auto", "parquet", "openai")),
    Option("chunk_rows", int, 1024,
           "rows read from a file at a time (a chunk: the scan's and a worker's reads)",
           check=_at_least(1)),
    Option("chat_template_kwargs", str, None,
           "options for the chat template, e.g. '{\"enable_thinking\": false}' (a row's "
           "'chat_template_kwargs' column updates them; a key the model's template never "
           "reads is a warning)", metavar="JSON"),
    # -- execution: shards and batches
    Option("batch_size", int, 64,
           "rows per shard: the consecutive input rows of one file that a worker takes at "
           "once and writes as one part (default: %(default)s)",
           check=_at_least(1), overrides=_prefill(1024),
           why="the prefill-only tasks run a shard as packed prefills, no KV cache kept: "
               "larger shards keep their engines full, bounded by max_batch_tokens"),
    Option("max_batch_tokens", int, None,
           "a static engine's cap on rows x max(prompt + max_tokens) in one of its batches "
           "(default: none)",
           check=_at_least(1), overrides=_prefill(65536),
           why="a prefill-only engine packs a shard's rows by tokens: this bounds a packed "
               "batch (its activations)",
           helps=tuple((task, "tokens per batch, at most (rows x longest row; default: "
                              "%(default)s)") for task in PREFILL_TASKS)),
    Option("kv_cache_memory", float, None,
           "exact KV pool size per worker in GiB, instead of the fraction (default on the "
           "CPU: 1)", metavar="GIB", check=_positive(" GiB")),
    # -- the cluster
    Option("num_workers", str, None,
           "workers: N (capped to the cluster's GPUs, else CPUs); MIN-MAX or auto (= 1-): "
           "GPU workers, starting with the GPUs present (waiting up to "
           "--worker-start-timeout for MIN) and adding one for each GPU that joins, up to "
           "MAX (default: one per GPU of the cluster; 1 without GPUs)",
           metavar="N|MIN-MAX|auto"),
    Option("worker_start_timeout_s", float, 600.0,
           "longest wait for the cluster's first GPUs (MIN-MAX, auto) and for a worker to be "
           "placed and load the model (default: 600)",
           metavar="SECONDS", flag_name="worker-start-timeout", check=_positive()),
    Option("address", str, None,
           "Ray address (default: RAY_ADDRESS, a running cluster, else a private local Ray; "
           "'local' forces the latter)"),
    Option("max_in_flight_per_worker", int, None,
           "shards a worker holds at once (default: as many as keep its engine full: "
           "`ray_jobs.dispatch.pool.hold_limits`)", check=_at_least(1)),
    Option("max_deaths_in_a_row", int, 8,
           "worker deaths with no shard answered between them that the job rides out (one "
           "more stops it; 0: the first stops it)",
           check=_at_least(0)),
    # -- reruns
    Option("overwrite", bool, False, "replace an existing output instead of resuming it"),
    Option("retry_errors", bool, False,
           "when resuming, compute again the shards of earlier runs that hold error rows "
           "(e.g. a row whose worker died); the other written shards are kept"),
    Option("progress", bool, True,
           "no progress bar (it counts rows as the workers' engines finish them)"),
    # -- the Ray Data stage's actor pool (`build_processor`)
    Option("concurrency", int, 1, "actors in the pool, each holding one engine",
           check=_at_least(1)),
    Option("num_gpus", float, 1, "GPUs per actor (1: one engine per GPU; 0: on the CPU)"),
    Option("num_cpus", float, None, "CPU cores per actor (default: 1 on the CPU, none beside "
                                    "a GPU)"),
    # -- the prefill-only tasks: the input limit (embed, classify, score) and embedding's own
    Option("max_input_tokens", int, None,
           "the input limit (default: the model's positions, also the most it takes); "
           "longer inputs are cut to it and counted", metavar="N",
           helps=(("embed", "the input limit (default: sentence_bert_config.json's "
                            "max_seq_length, else the model's context); longer inputs are "
                            "cut to it and counted"),)),
    Option("truncate", bool, True,
           "make inputs above the limit error rows instead of cutting them"),
    Option("instruction", str, None,
           "the prompt's '<Instruct>: TEXT' of a causal LM as a reranker (default: "
           "Qwen3-Reranker's model card's, for web search); refused for a model with a head",
           metavar="TEXT"),
    Option("pooling", str, None,
           "the row's last token (Qwen3-Embedding), the mean of its tokens, or its first "
           "token (default: the folder's, else last)",
           choices=("last", "mean", "cls")),
    Option("normalize", bool, None,
           "scale each vector to unit L2 norm (default: the folder's, else on)"),
    Option("dimensions", int, None,
           "keep the first D values (Matryoshka), before normalising", metavar="D"),
    Option("instruction", str, None,
           "a query instruction, as Qwen3-Embedding documents it: each text becomes "
           "'Instruct: TEXT\\nQuery:<text>'", metavar="TEXT"),
    Option("embedding_dtype", str, "float32",
           "store the vectors as float16 (default: float32)",
           choices=("float32", "float16")),
)}


__all__ = ["JOB", "PREFILL_TASKS"]
