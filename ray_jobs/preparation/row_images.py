"""Stage preparation: a row's images (vision-language models such as Qwen2.5-VL), where they
are in the row, the conversation they belong to, and which of them the output repeats.

The batch job's workers, the Ray Data processor and OpenAI request files all prepare rows
through `RowPreparer`, which reads a row's images here, on the worker that prepares the row
(never on the driver).

Where a row's images are:
- in its `messages`: OpenAI content parts, `{"type": "image_url", "image_url": {"url":
  ...}}` (a `data:` URL, a local path or `file://` URL, or an object-storage URI: `s3://`,
  `gs://`, ...) or `{"type": "image", "image": path or bytes}`, beside `{"type": "text",
  "text": ...}` parts;
- in its `image` column, beside a `prompt` (text): bytes, a path or URI (a string), a list
  of them, or a Hugging Face `datasets` image (`{bytes, path}`). The row becomes one user
  turn, its images first and then the prompt's text, rendered with the chat template. A
  row whose `image` is null (or an empty list) is an ordinary `prompt` row: its text is
  continued without the template.

Reading (`nanoserve.multimodal.image_input`): nothing comes from the web; object-storage URIs are
read through `pyarrow.fs` with the store's own credentials, as the job's input and output
are; a local path is the worker's (relative to the folder the job started in, for a local
Ray). Pillow decodes each image upright (EXIF) in RGB; an encoded image over 64 MiB or one
whose header says more than 64 Mi pixels is refused before any pixel is decoded. A row
whose image is missing, broken, too large or remote is an error row saying so; the other
rows go on.

Output: an `image` column of paths (strings) is copied to the output as the other input
columns are; one that holds bytes is not (each part would hold its rows' images again):
join the results to the images on `id`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from nanoserve import ImageConfig, InputError
from ray_jobs.input.json_shapes import IMAGE_COLUMN

IMAGE_PARTS = ("image_url", "image")  # content-part types that hold an image


@dataclass(frozen=True)
class ModelImages:
    """What reading a row's images needs from the model: its image placeholder token and
    its image processor's settings (`preprocessor_config.json`)."""

    image_token_id: int
    config: ImageConfig

    @classmethod
    def of(cls, model_config: Any, model_path: str | Path) -> ModelImages | None:
        """The model's, or None for a model without a vision tower (it takes no images)."""
        if model_config.vision is None:
            return None
        return cls(model_config.image_token_id, ImageConfig.from_folder(model_path))

    @classmethod
    def of_engine(cls, llm: Any) -> ModelImages | None:
        """A loaded `nanoserve.llm.LLM`'s (None: it takes no images)."""
        if getattr(llm, "image_config", None) is None:
            return None
        return cls(llm.config.image_token_id, llm.image_config)


def image_column_kind(t: pa.DataType) -> str | None:
    """'paths' or 'bytes' for the type of an `image` column, None for an all-null one;
    InputError for a type that holds no images."""
    item = t.value_type if pat.is_list(t) or pat.is_large_list(t) else t
    if pat.is_dictionary(item):
        item = item.value_type
    if pat.is_null(item):
        return None
    if pat.is_string(item) or pat.is_large_string(item) or pat.is_string_view(item):
        return "paths"
    if pat.is_binary(item) or pat.is_large_binary(item) or pat.is_binary_view(item):
        return "bytes"
    if pat.is_struct(item) and {f.name for f in item} & {"bytes", "path"}:
        return "bytes"  # a Hugging Face datasets image: {bytes, path}
    raise InputError(f"column {IMAGE_COLUMN!r} holds each row's images: bytes, a path or URI "
                     f"(a string), a list of them, or {{bytes, path}}; it has type {t}")


def image_sources(value: Any) -> list[Any]:
    """The images of one `image` value, in order (bytes, or a path / URI / data: URL).
    ValueError (the row's error) for a null item of a list."""
    items = value if isinstance(value, list) else [value]
    out = []
    for k, item in enumerate(items):
        if isinstance(item, dict):  # {bytes, path}: the bytes where present
            item = item.get("bytes") or item.get("path")
        if item is None:
            raise ValueError(f"column {IMAGE_COLUMN!r}: image {k} of the row is null")
        out.append(item)
    return out


def prompt_turn(text: str, sources: list[Any]) -> list[dict[str, Any]]:
    """A `prompt` row with images as a conversation: one user turn, the images first."""
    parts = [{"type": "image", "image": s} for s in sources]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def plain_conversation(messages: Any) -> tuple[Any, bool]:
    """(the messages as the chat template takes them, whether they hold an image). Keys whose
    value is null are dropped, in messages and in their content parts (Arrow gives every
    message and part every key any has); a content of text parts only is joined into one
    string (what a model without images takes; a template renders both alike). ValueError
    for a part that is not text or an image."""
    if not isinstance(messages, list):
        return messages, False
    out, images = [], False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list):
            parts = [_plain_part(p, i, j) for j, p in enumerate(content)]
            if any(p.get("type") in IMAGE_PARTS for p in parts):
                images = True
                m["content"] = parts
            else:
                m["content"] = "".join(p["text"] for p in parts)
        out.append(m)
    return out, images


def _plain_part(part: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}]['content'][{j}]"
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be a content part (an object with a 'type')")
    part = {k: ({x: y for x, y in v.items() if y is not None} if isinstance(v, dict) else v)
            for k, v in part.items() if v is not None}
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where} is a text part without a string 'text'")
    elif kind not in IMAGE_PARTS:
        raise ValueError(f"{where}: a part of type {kind!r} is not read (text, image_url and "
                         f"image parts are)")
    return part


def check_takes_images(images: ModelImages | None) -> None:
    """ValueError (the row's error) for a row with images and a model without a vision
    tower."""
    if images is None:
        raise ValueError("the row has images and the model takes none: use a vision-language "
                         "model (Qwen2.5-VL), or drop the images")


def copies_image_column(t: pa.DataType) -> bool:
    """Whether the output repeats an `image` column of type `t`: paths yes, bytes no."""
    try:
        return image_column_kind(t) != "bytes"
    except InputError:
        return True
