"""Stage preparation: which LoRA adapter a row runs under (`nanoserve batch --lora NAME=PATH`).

- a `lora` column names the row's adapter; null is the base model; a name the job was not
  given makes the row an error row (`unknown_adapter`, on the worker), never a dead job;
- an OpenAI batch request (`ray_jobs.input.openai_requests`) keeps its body's `model` as
  the row's `model` column: where it names one of the job's adapters, the row runs under it
  (vLLM's way), any other model name is the base model; a `lora` column, where the input has
  one and the row sets it, comes first.

The column must hold text (a job-level `InputError` otherwise, before any worker starts).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.types as pat

from nanoserve import InputError

LORA_COLUMN = "lora"
MODEL_COLUMN = "model"  # an OpenAI request's body.model


def check_lora_column(schema: pa.Schema) -> None:
    """InputError when the input's `lora` column does not hold text (a name the job lacks
    is that row's error, found on the worker)."""
    if LORA_COLUMN not in schema.names:
        return
    t = schema.field(LORA_COLUMN).type
    if pat.is_dictionary(t):
        t = t.value_type
    if not (pat.is_null(t) or pat.is_string(t) or pat.is_large_string(t)
            or pat.is_string_view(t)):
        raise InputError(f"column {LORA_COLUMN!r} (each row's LoRA adapter, by the name given "
                         f"with --lora NAME=PATH) must hold text, not {t}")


def row_adapter(values: dict[str, Any], adapters: Collection[str]) -> str | None:
    """The adapter a row asks for: its `lora` value, else its `model` where that names one of
    `adapters`, else None (the base model). The name is not checked here."""
    name = values.get(LORA_COLUMN)
    if name is not None:
        return str(name)
    model = values.get(MODEL_COLUMN)
    return model if isinstance(model, str) and model in adapters else None


def unknown_adapter(name: str | None, adapters: Collection[str]) -> str | None:
    """A row's error for an adapter the job was not given, else None."""
    if name is None or name in adapters:
        return None
    given = ", ".join(sorted(adapters)) if adapters else "none (give them with --lora NAME=PATH)"
    return f"unknown LoRA adapter {name!r} (column {LORA_COLUMN!r}); the job's adapters: {given}"


__all__ = ["LORA_COLUMN", "MODEL_COLUMN", "check_lora_column", "row_adapter", "unknown_adapter"]
