"""Stage input: OpenAI Batch API request lines read as input rows.

The answers' files are the output stage's (`ray_jobs.output.openai_files`).

A JSON Lines line `{"custom_id", "method": "POST", "url", "body"}` (recognised by its
`custom_id` and `body` keys; with `--input-format openai` every line is read as one) becomes
an ordinary input row (`flatten_request`): `id` is the custom_id, `url` is kept, and the
body's fields become the job's per-row columns:

- `/v1/chat/completions`: `messages` (content as a string or a list of content parts:
  text parts, joined into one string where there is no image, and `image_url` parts, a
  `data:` URL, a local path or an object-storage URI, `detail` "auto" or absent: read on the
  worker for a vision-language model, `ray_jobs.preparation.row_images`);
  `logprobs` (true) with `top_logprobs` K become the row's `logprobs` K;
- `/v1/completions`: `prompt` (a string, a list of one string, or a list of token ids);
  `logprobs` K;
- both: `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `n`, `stop`,
  `seed`, `response_format`, and vLLM's extras `top_k`, `ignore_eos`, `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`; a body without `temperature` or
  `top_p` gets OpenAI's defaults, 1 and 1 (`OPENAI_DEFAULTS`: it samples, where a plain
  row without them takes the job's values, greedy by default);
- `model`, kept as the row's `model` column: where it names one of the job's LoRA adapters
  (`--lora NAME=PATH`), the row runs under it (`ray_jobs.preparation.lora_column`); any
  other name is the job's model (the response names the job's model);
- accepted and not used: `user`, `metadata`, `store`, and `stream` false, `echo` false,
  `presence_penalty` / `frequency_penalty` 0, `logit_bias` empty; a field whose value is
  null is absent.

Anything else (a body field we do not apply, another method or url, a body that is not an
object) makes the row an error row whose message names it. Duplicate custom_ids are the
input's duplicate ids: refused before any work (`ray_jobs.input.io.scan_input`).
"""

from __future__ import annotations

import json
from typing import Any

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
_REQUEST_KEYS = ("custom_id", "method", "url", "body")
_BOTH = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed",
         "response_format", "top_k", "ignore_eos", "guided_json", "guided_regex",
         "guided_choice", "guided_grammar", "model", "user", "metadata", "store", "stream",
         "presence_penalty", "frequency_penalty", "logit_bias", "choice_scores",
         "max_thinking_tokens"}
_FIELDS = {CHAT_URL: _BOTH | {"messages", "logprobs", "top_logprobs", "chat_template_kwargs"},
           COMPLETIONS_URL: _BOTH | {"prompt", "logprobs", "echo"}}
_COPIED = ("temperature", "top_p", "n", "seed", "response_format", "top_k", "ignore_eos",
           "guided_json", "guided_regex", "guided_choice", "guided_grammar", "choice_scores",
           "max_thinking_tokens", "model")
_NEUTRAL = {"stream": (False,), "echo": (False,), "presence_penalty": (0,),
            "frequency_penalty": (0,), "logit_bias": ({},)}
_IGNORED = ("user", "metadata", "store")
# What OpenAI's API takes for a field the request leaves out (its API reference: temperature
# "Defaults to 1", top_p "Defaults to 1"); the job's own defaults apply to plain rows only.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


def is_request(row: Any) -> bool:
    """Whether a JSON Lines object has the shape of an OpenAI batch request line."""
    return isinstance(row, dict) and "custom_id" in row and "body" in row


def flatten_request(row: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The input row of one request line, and why it cannot run (None when it can). A
    request that cannot run keeps only its `id` and `url`."""
    custom_id = row.get("custom_id")
    url = row.get("url")
    head = {"id": custom_id if isinstance(custom_id, str) else None,
            "url": url if isinstance(url, str) else None}
    try:
        return {**head, **_body_fields(row)}, None
    except ValueError as e:
        return head, str(e)


def _body_fields(row: dict[str, Any]) -> dict[str, Any]:
    missing = [k for k in _REQUEST_KEYS if k not in row]
    if missing:
        raise ValueError(f"not an OpenAI batch request line: it lacks {_names(missing)} "
                         f"(a line is {{custom_id, method, url, body}})")
    extra = [k for k in row if k not in _REQUEST_KEYS]
    if extra:
        raise ValueError(f"unknown request field(s) {_names(extra)}")
    if not isinstance(row["custom_id"], str) or not row["custom_id"]:
        raise ValueError(f"custom_id must be a non-empty string, got {json.dumps(row['custom_id'])}")
    if row["method"] != "POST":
        raise ValueError(f"method {json.dumps(row['method'])} is not supported: use \"POST\"")
    url = row["url"]
    if url not in _FIELDS:
        raise ValueError(f"url {json.dumps(url)} is not supported: nanoserve answers "
                         f"{CHAT_URL} and {COMPLETIONS_URL}")
    body = row["body"]
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    unsupported = [k for k in body if k not in _FIELDS[url]
                   or (k in _NEUTRAL and not _neutral(k, body[k]))]
    if unsupported:
        raise ValueError(f"unsupported body field(s) {_names(unsupported)} for {url} "
                         f"(nanoserve does not apply them; remove them to run the request)")
    out: dict[str, Any] = {k: body[k] for k in _COPIED if k in body}
    for k, v in OPENAI_DEFAULTS.items():
        out.setdefault(k, v)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        out["max_tokens"] = limit
    if "stop" in body:
        stop = body["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("body.stop must be a string or a list of strings")
        out["stop"] = stop
    if url == CHAT_URL:
        out["messages"] = _messages(body.get("messages"))
        if "chat_template_kwargs" in body:  # JSON text: rows' objects differ in their keys
            if not isinstance(body["chat_template_kwargs"], dict):
                raise ValueError("body.chat_template_kwargs must be a JSON object")
            out["chat_template_kwargs"] = json.dumps(body["chat_template_kwargs"])
        asked = body.get("logprobs", False)
        if not isinstance(asked, bool):
            raise ValueError("body.logprobs must be true or false for chat completions")
        if "top_logprobs" in body and not asked:
            raise ValueError("body.top_logprobs needs body.logprobs true")
        if asked:
            out["logprobs"] = body.get("top_logprobs", 0)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            out["prompt"] = prompt
        elif (isinstance(prompt, list) and prompt
              and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            out["prompt_token_ids"] = prompt
        elif prompt is None:
            raise ValueError("body.prompt is missing")
        else:
            raise ValueError("body.prompt must be a string or a list of token ids (one prompt "
                             "per request line)")
        if "logprobs" in body:
            out["logprobs"] = body["logprobs"]
    return out


def _neutral(key: str, value: Any) -> bool:
    return any(value == v and type(value) is not bool or value is v for v in _NEUTRAL[key])


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("body.messages must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"body.messages[{i}] must be an object with a role")
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = [_part(part, i) for part in content]
            if all(p["type"] == "text" for p in content):
                content = "".join(p["text"] for p in content)
        if not isinstance(content, (str, list)):
            raise ValueError(f"body.messages[{i}].content must be a string or a list of "
                             f"content parts")
        extra = [k for k in m if k not in ("role", "content", "name")]
        if extra:
            raise ValueError(f"body.messages[{i}] has unsupported field(s) {_names(extra)}")
        out.append({"role": m["role"], "content": content})
    return out


def _part(part: Any, i: int) -> dict[str, Any]:
    """One content part of body.messages[i]: a text part, or an image_url part whose url
    is a data: URL, a path or an object-storage URI (read on the worker,
    `ray_jobs.preparation.row_images`); its `detail` may be "auto" (images are sized by the model's
    image processor)."""
    kind = part.get("type") if isinstance(part, dict) else None
    where = f"body.messages[{i}].content"
    if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
        return {"type": "text", "text": part["text"]}
    if kind == "image_url" and set(part) <= {"type", "image_url"}:
        image = part.get("image_url")
        if not isinstance(image, dict) or not isinstance(image.get("url"), str):
            raise ValueError(f"{where}: an image_url part needs image_url.url (a string)")
        extra = [k for k in image if k not in ("url", "detail") or (
            k == "detail" and image[k] not in ("auto", None))]
        if extra:
            raise ValueError(f"{where}: image_url field(s) {_names(extra)} not supported "
                             f"(nanoserve does not apply them; detail may be \"auto\")")
        return {"type": "image_url", "image_url": {"url": image["url"]}}
    if kind in ("text", "image_url"):
        raise ValueError(f"{where}: a malformed {kind} part (text: {{type, text}}; "
                         f"image_url: {{type, image_url: {{url}}}})")
    raise ValueError(f"{where}: a part of type {json.dumps(kind)} is not supported (text and "
                     f"image_url parts are)")


def _names(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys)


# --- output ------------------------------------------------------------------------------------
