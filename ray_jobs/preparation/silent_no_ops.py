"""Warnings for what a job would otherwise ignore silently: an input column close to a per-row
option's name (it passes through as data), and chat-template options the model's template never
reads. Each is one `warning:` line, said before any work and kept in the summary and report."""

from __future__ import annotations

from typing import Any

from nanoserve import NanoserveError
from ray_jobs.preparation.lora_column import LORA_COLUMN
from ray_jobs.preparation.prepare import (
    CONSTRAINT_COLUMNS,
    OTHER_OVERRIDES,
    OVERRIDE_COLUMNS,
    PROMPT_COLUMNS,
    TEMPLATE_KWARGS_COLUMN,
)

ROW_OPTION_COLUMNS = (OVERRIDE_COLUMNS + OTHER_OVERRIDES + CONSTRAINT_COLUMNS
                      + (TEMPLATE_KWARGS_COLUMN, LORA_COLUMN))  # what a row may set for itself


def column_slips(names: list[str]) -> list[str]:
    """A warning line for each input column that is not a per-row option but is close to
    one (`max_token`, `temprature`, `Temperature`): such a column passes through to the
    output as data, and its rows run with the job's value, which is seldom what was meant."""
    import difflib

    out = []
    for name in names:
        if name in ROW_OPTION_COLUMNS or name in PROMPT_COLUMNS:
            continue
        close = difflib.get_close_matches(name.lower(), ROW_OPTION_COLUMNS, n=1, cutoff=0.8)
        if close:
            out.append(f"warning: column {name!r} is not a per-row option: it passes "
                       f"through to the output as data, and its rows run with the job's "
                       f"settings; did you mean {close[0]!r}?")
    return out


def unread_template_kwargs(tokenizer: Any, kwargs: dict[str, Any], flag: str) -> list[str]:
    """A warning line for each chat-template option (`kwargs`, from `flag`) that the model's
    chat template never reads, so it changes nothing (`enable_thinking` given to a template
    without a think block, a misspelt key). None for a model without a chat template."""
    source = getattr(tokenizer, "chat_template", None)
    if not kwargs or not source:
        return []
    import difflib

    from nanoserve import ChatTemplate

    try:
        read = ChatTemplate(source).variables()
    except NanoserveError:
        return []  # a broken template is refused where chat rows need it
    out = []
    for key in kwargs:
        if key not in read:
            close = difflib.get_close_matches(key, sorted(read), n=1, cutoff=0.8)
            out.append(f"warning: {flag}: the model's chat template never reads {key!r}, so it "
                       f"changes nothing" + (f"; did you mean {close[0]!r}?" if close else ""))
    return out
