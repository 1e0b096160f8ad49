"""Stage input: two shapes one JSON Lines column may mix, read as the wider one, what lets a
file hold rows with images beside rows without.

- A conversation (a list of messages with a `content`, e.g. `messages`): a message's
  content is a string or a list of OpenAI content parts. Where any message of the column
  has parts, every string content is read as one text part, `[{"type": "text", "text":
  s}]` (the chat template renders both alike; `ray_jobs.preparation.row_images` joins a message of
  text parts back into a string for a model without images).
- The `image` column: one image (a path, a URI, a data: URL) or a list of them. Where any
  row has a list, one image is read as a list of one.

Arrow gives a column one type, and without this a row of the minority shape would be an
error row. A column with only the narrow shape keeps its type, so a text-only input reads
exactly as before. The scan decides per column (`drop_narrow`: the wide type wins over the
narrow one whatever their counts); every read then widens the narrow values of a wide
column (`widen`), the scan's chunks included (a chunk is widened where one of its values is
wide).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.types as pat

IMAGE_COLUMN = "image"


def widen(name: str, values: list[Any], typ: pa.DataType | None) -> list[Any]:
    """`values` (one column of a chunk of JSON rows) with narrow values in the wide shape
    where the column is wide: `typ` is that wide type, or (`typ` None: the scan) one of the
    values is wide. Any other column is returned as it is."""
    first = next((v for v in values if v), None)
    if name == IMAGE_COLUMN and first is not None:
        wide = _is_list_type(typ) if typ is not None else any(isinstance(v, list) for v in values)
        if wide:
            return [v if v is None or isinstance(v, list) else [v] for v in values]
        return values
    if not _is_conversation(first):
        return values
    wide = (_content_type(typ) == "parts" if typ is not None
            else any(_has_parts(v) for v in values))
    return [_as_parts(v) for v in values] if wide else values


def drop_narrow(name: str, counts: dict[pa.DataType, int]) -> dict[pa.DataType, int]:
    """The scan's types of one column ({type: values}) with the narrow shape's types folded
    into the first wide one, when both are there."""
    if name == IMAGE_COLUMN:
        wide = [t for t in counts if _is_list_type(t)]
        narrow = [t for t in counts if not _is_list_type(t) and not pat.is_null(t)]
    else:
        wide = [t for t in counts if _content_type(t) == "parts"]
        narrow = [t for t in counts if _content_type(t) == "string"]
    if not wide or not narrow:
        return counts
    out = {t: n for t, n in counts.items() if t not in narrow}
    out[wide[0]] += sum(counts[t] for t in narrow)
    return out


def _is_conversation(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and isinstance(v[0], dict) and "content" in v[0]


def _has_parts(v: Any) -> bool:
    return isinstance(v, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                       for m in v)


def _as_parts(v: Any) -> Any:
    if not isinstance(v, list):
        return v
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in v]


def _is_list_type(t: pa.DataType | None) -> bool:
    return t is not None and (pat.is_list(t) or pat.is_large_list(t))


def _content_type(t: pa.DataType | None) -> str | None:
    """'string' or 'parts' for a conversation type (a list of structs with `content`),
    by its content's type; None for any other type."""
    if not _is_list_type(t) or not pat.is_struct(t.value_type):
        return None
    item = t.value_type
    i = item.get_field_index("content")
    if i < 0:
        return None
    content = item.field(i).type
    if pat.is_string(content) or pat.is_large_string(content):
        return "string"
    return "parts" if _is_list_type(content) else None
