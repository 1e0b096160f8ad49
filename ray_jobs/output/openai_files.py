"""Stage output: OpenAI Batch API output files, each shard's results written as its
lines of `output.jsonl` / `errors.jsonl` in OpenAI's batch output shape, and the files
joined from them.

The request lines they answer are read by the input stage (`ray_jobs.input.openai_requests`).

Each shard's lines are made on the worker that ran it, from the rows of its part
(`format_shard`), and written beside the part as its fragments `_output-NNNNN.jsonl` and
`_errors-NNNNN.jsonl` (`fragment_names`), before the part, whose footer names their bytes
(`ray_jobs.workers.tasks.ShardRunner.commit`, `ray_jobs.output.manifest.adopt_part`): a shard is committed
with its fragments. Each answered request is one line of `output.jsonl`:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200,
     "request_id": "req_...", "body": <chat.completion or text_completion>}, "error": null}

with one choice per sample, `usage` from the engine's token counts (completion tokens summed
over the samples); a failed request is a line of `errors.jsonl` with status code 400 (its
input) or 500 (the engine or its worker failed) and the body `{"error": {"message", "type",
"param", "code"}}`. The ids are hashes of the job's settings, the row's input position and
its custom_id (the same for the same job); `created` is the time the shard's lines were
made.

When every shard is recorded, the driver writes `output.jsonl` and `errors.jsonl`
(`write_outputs`): each the shards' fragments joined in shard order, which is input order,
as a streamed copy of their bytes (no line is parsed, no row read); a shard committed
without fragments (by a version that assembled the files on the driver) gets them first from
its part, on a worker or, when none runs, on the driver (the same `format_shard`). Both
files are written whole (a local temporary file renamed, or one upload to an object store),
and rewritten by every run that completes the job, so a killed driver rerun gives them
again. The fragments stay in the folder (`_` names: Parquet readers skip them).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa

from nanoserve import NanoserveError
from ray_jobs.input.openai_requests import CHAT_URL, COMPLETIONS_URL
from ray_jobs.input.storage import OutputDir
from ray_jobs.options import JOB

OUTPUT_NAME = "output.jsonl"
ERRORS_NAME = "errors.jsonl"
OUTPUT_FORMATS = JOB["output_format"].choices
_PART_COLUMNS = ("id", "generated_text", "num_input_tokens", "num_generated_tokens",
                 "finish_reason", "error", "sample_index", "logprobs", "choice_scores",
                 "reasoning")
_SERVER_ERRORS = ("generation failed", "the worker died")


def wants_openai_output(output_format: str, openai_rows: int) -> bool:
    """Whether the job writes output.jsonl / errors.jsonl: 'openai', or 'auto' for an input
    of OpenAI batch request lines."""
    if problem := JOB["output_format"].problem(output_format, "output format"):
        raise NanoserveError(problem)
    return output_format == "openai" or (output_format == "auto" and openai_rows > 0)


@dataclass(frozen=True)
class OpenAIOutput:
    """What a worker needs, beside the job's column plan and the tokenizer, to write a
    shard's lines of the OpenAI files: the model name the responses give, and the job's key
    (a hash of its settings, in every line's ids)."""

    model: str
    job_key: str

    @classmethod
    def of(cls, model: str, settings: dict[str, Any]) -> OpenAIOutput:
        """For the job of `settings` (the manifest's) run with `model` as the user named it."""
        if "/" in model or model.endswith(".gguf"):  # a path: its name
            model = Path(model).name
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        return cls(model, key)


def fragment_names(shard_id: int) -> tuple[str, str]:
    """A shard's fragments of output.jsonl and of errors.jsonl, beside its part (`_` names:
    Parquet readers skip them)."""
    return f"_output-{shard_id:05d}.jsonl", f"_errors-{shard_id:05d}.jsonl"


def part_columns(names: list[str], plan: Any) -> list[str]:
    """Of a part's columns `names`, those its lines are made from: `id`, the results, the
    request's `url` and the prompt columns (a row's endpoint)."""
    wanted = (*_PART_COLUMNS, "url", *(column for column, _ in plan.prompt_columns))
    return [c for c in dict.fromkeys(wanted) if c in names]


def format_shard(table: pa.Table, first_position: int, plan: Any, output: OpenAIOutput,
                 token: TokenText) -> tuple[bytes, bytes]:
    """A shard's lines of output.jsonl and of errors.jsonl (see the module docstring), from
    its part's rows: one per sample, a row's samples consecutive, the rows in input order
    from input position `first_position`."""
    created = int(time.time())
    out, errors = [], []
    rows = table.select(part_columns(table.column_names, plan)).to_pylist()
    for k, samples in enumerate(_per_row(rows)):
        row_id = samples[0]["id"]
        digest = hashlib.sha256(f"{output.job_key}:{first_position + k}:{row_id}".encode()
                                ).hexdigest()
        custom_id = None if row_id is None else str(row_id)
        failed = next((s for s in samples if s["finish_reason"] == "error"), None)
        if failed is not None:
            errors.append(_error_line(digest, custom_id, failed["error"] or "failed"))
            continue
        body = _completion(digest, _is_chat(samples[0], plan), samples, created, output.model,
                           token)
        out.append({"id": f"batch_req_{digest[:24]}", "custom_id": custom_id,
                    "response": {"status_code": 200, "request_id": f"req_{digest[24:48]}",
                                 "body": body},
                    "error": None})
    return _jsonl(out), _jsonl(errors)


def _per_row(rows: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """A part's rows grouped per input row: a row's samples are consecutive, sample_index
    0, 1, ..."""
    samples: list[dict[str, Any]] = []
    for r in rows:
        if samples and (r["id"] != samples[0]["id"] or not r.get("sample_index")):
            yield samples
            samples = []
        samples.append(r)
    if samples:
        yield samples


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)


def write_outputs(folder: OutputDir, shards: Iterable[Any],
                  make_fragments: Callable[[list[Any]], None]) -> None:
    """`output.jsonl` and `errors.jsonl`: the fragments of every shard (`shards`: the job's,
    in order, ids 0, 1, ...) joined in shard order, which is input order, as a streamed
    copy of their bytes (`OutputDir.concatenate`: nothing is parsed). Shards committed
    without fragments (by an earlier version) get theirs from `make_fragments` first."""
    names = set(folder.names())
    missing, count = [], 0
    for shard in shards:
        count += 1
        if not names.issuperset(fragment_names(shard.shard_id)):
            missing.append(shard)
    if missing:
        make_fragments(missing)
    for i, name in enumerate((OUTPUT_NAME, ERRORS_NAME)):
        folder.concatenate(name, (fragment_names(shard_id)[i] for shard_id in range(count)))


def _is_chat(values: dict[str, Any], plan: Any) -> bool:
    """A row's endpoint: its request's url, else its prompt column (the first not null):
    chat for messages, completions for text or token ids."""
    url = values.get("url")
    if url in (CHAT_URL, COMPLETIONS_URL):
        return url == CHAT_URL
    for column, kind in plan.prompt_columns:
        if values.get(column) is not None:
            return kind == "messages"
    return False


def _error_line(digest: str, custom_id: str | None, message: str) -> dict[str, Any]:
    server = message.startswith(_SERVER_ERRORS)
    return {"id": f"batch_req_{digest[:24]}", "custom_id": custom_id,
            "response": {"status_code": 500 if server else 400,
                         "request_id": f"req_{digest[24:48]}",
                         "body": {"error": {"message": message,
                                            "type": "server_error" if server
                                            else "invalid_request_error",
                                            "param": None, "code": None}}},
            "error": None}


def _completion(digest: str, chat: bool, samples: list[dict[str, Any]], created: int,
                model: str, token: TokenText) -> dict[str, Any]:
    choices = []
    for i, s in enumerate(samples):
        entries = s.get("logprobs")
        if chat:
            logprobs = None if entries is None else {
                "content": [token.chat_entry(e) for e in entries], "refusal": None}
            choices.append({"index": i, "message": {"role": "assistant",
                                                    "content": s["generated_text"],
                                                    "refusal": None},
                            "logprobs": logprobs, "finish_reason": s["finish_reason"]})
        else:
            choices.append({"index": i, "text": s["generated_text"],
                            "logprobs": None if entries is None else token.completion(entries),
                            "finish_reason": s["finish_reason"]})
        if chat and "reasoning" in s:  # a reasoning parser ran: the think block's text
            choices[-1]["message"]["reasoning_content"] = s["reasoning"]
        if s.get("choice_scores") is not None:  # {label: probability}, labels in order
            choices[-1]["choice_scores"] = dict(s["choice_scores"])
    prompt = samples[0]["num_input_tokens"] or 0
    completion = sum(s["num_generated_tokens"] or 0 for s in samples)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{digest[:32]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


class TokenText:
    """A token id's text and bytes, as OpenAI's logprobs give them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = _byte_level_bytes(self.tokenizer.id_to_token(token_id))
        return text, list(raw if raw is not None else text.encode("utf-8"))

    def chat_entry(self, e: dict[str, Any]) -> dict[str, Any]:
        text, raw = self.text(e["token_id"])
        top = []
        for t in e["top"] or ():
            t_text, t_raw = self.text(t["token_id"])
            top.append({"token": t_text, "logprob": t["logprob"], "bytes": t_raw})
        return {"token": text, "logprob": e["logprob"], "bytes": raw, "top_logprobs": top}

    def completion(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        tokens, offsets, at = [], [], 0
        for e in entries:
            text = self.text(e["token_id"])[0]
            tokens.append(text)
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{self.text(t["token_id"])[0]: t["logprob"]
                                  for t in e["top"] or ()} for e in entries],
                "text_offset": offsets}


def _byte_level_bytes(token: str | None) -> bytes | None:
    """The bytes of a byte-level BPE token's string, or None when it is not one."""
    from nanoserve import byte_level_bytes

    return byte_level_bytes(token)
