"""The job report: one self-contained HTML file per run, `OUTPUT_DIR/_nanoserve_report.html`.

The driver keeps a small record per answered piece of a batch (`PieceRecord`: when it came
back, from which worker, its rows, output tokens and the engine's counts from the table's
schema metadata), the rows written per batch, and error rows by cause; `write_report`
renders them with the job's settings, phases and summary. What it shows:
- output tokens/s over time (binned by when results came back) and the cumulative tokens;
- rows finished per worker over time;
- batch fill: each piece's rows against the job's batch size;
- waste per piece: padding (share of the padded prefill rectangle that is padding) and
  early finish (share of decode row-steps spent on rows that had already finished);
- prefix-cache hit rate (prompt tokens served from the cache / prompt tokens), only when
  the worker's tables carry the optional metadata key `nanoserve.prompt_tokens_cached`;
- error rows by cause (`error_cause`: the message up to its details);
- the settings, the phases (`JobSummary.timings`) and the summary.

Plots are drawn by matplotlib (Agg, no pyplot state) as inline SVG: no script, no file or
network fetch. The report's numbers are also embedded as JSON in
`<script type="application/json" id="nanoserve-report-data">` (`REPORT_DATA_ID`).
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ray_jobs.manifest import REPORT_NAME
from ray_jobs.timeline import PHASES
from ray_jobs.worker import (
    DECODE_ROW_STEPS_KEY,
    FINISHED_ROW_STEPS_KEY,
    PREFILL_SLOTS_KEY,
    PREFILL_TOKENS_KEY,
    PROMPT_TOKENS_CACHED_KEY,
)

REPORT_DATA_ID = "nanoserve-report-data"
MAX_TIME_BINS = 40


@dataclass(frozen=True)
class PieceRecord:
    """One answered piece of a batch (a whole batch unless it was split after worker
    deaths). Times are seconds from the job's start."""

    batch_id: int
    worker: int
    finished_s: float
    rows: int  # result rows: one per sample
    error_rows: int
    prompt_tokens: int
    output_tokens: int
    prefill_slots: int  # rows x longest prompt, summed over the engine's sub-batches
    prefill_real_tokens: int
    decode_row_steps: int
    finished_row_steps: int
    prompt_tokens_cached: int | None = None  # None: the engine has no prefix cache


def piece_record(batch_id: int, worker: int, finished_s: float, table: pa.Table) -> PieceRecord:
    """The record of a worker's answer (`BatchWorker.run_batch`'s table: one row per sample).
    `rows` counts samples (what a batch's size bounds); `prompt_tokens` counts each prompt
    once (its first sample's row), as the engine prefills it once."""
    meta = table.schema.metadata or {}
    cached = meta.get(PROMPT_TOKENS_CACHED_KEY)
    prompt_tokens = table["num_input_tokens"].to_pylist()
    if "sample_index" in table.schema.names:
        prompt_tokens = [n for n, i in zip(prompt_tokens, table["sample_index"].to_pylist())
                         if not i]
    return PieceRecord(
        batch_id, worker, finished_s, table.num_rows,
        error_rows=sum(r == "error" for r in table["finish_reason"].to_pylist()),
        prompt_tokens=sum(n or 0 for n in prompt_tokens),
        output_tokens=sum(n or 0 for n in table["num_generated_tokens"].to_pylist()),
        prefill_slots=int(meta.get(PREFILL_SLOTS_KEY, 0)),
        prefill_real_tokens=int(meta.get(PREFILL_TOKENS_KEY, 0)),
        decode_row_steps=int(meta.get(DECODE_ROW_STEPS_KEY, 0)),
        finished_row_steps=int(meta.get(FINISHED_ROW_STEPS_KEY, 0)),
        prompt_tokens_cached=None if cached is None else int(cached))


_DETAIL = re.compile(r"[:;(\[,]")


def error_cause(message: str) -> str:
    """An error message's cause, without its row's details: the text before the first
    ':', ';', '(', '[' or ',', with numbers as N ("prompt has N tokens", "empty prompt",
    "invalid sampling values")."""
    head = _DETAIL.split(message, maxsplit=1)[0].strip() or message.strip()
    return re.sub(r"\d+", "N", head)


@dataclass
class ReportLog:
    """What the driver gathers during a run for the report."""

    pieces: list[PieceRecord] = dataclasses.field(default_factory=list)
    batch_rows: dict[int, int] = dataclasses.field(default_factory=dict)  # written this run
    error_causes: Counter = dataclasses.field(default_factory=Counter)

    def written(self, batch_id: int, results: list[dict[str, Any]]) -> None:
        self.batch_rows[batch_id] = len(results)
        for res in results:
            if res["finish_reason"] == "error":
                self.error_causes[error_cause(res["error"] or "")] += 1


def report_data(log: ReportLog, summary: Any, settings: dict[str, Any],
                batch_size: int) -> dict[str, Any]:
    """The report's numbers, JSON-ready (what the page shows and embeds)."""
    pieces = [dataclasses.asdict(p) for p in sorted(log.pieces, key=lambda p: p.finished_s)]
    slots = sum(p.prefill_slots for p in log.pieces)
    steps = sum(p.decode_row_steps for p in log.pieces)
    cached = [p for p in log.pieces if p.prompt_tokens_cached is not None]
    cached_prompt = sum(p.prompt_tokens for p in cached)
    summary_d = dataclasses.asdict(summary)
    workers = summary_d.pop("workers")
    return {
        "summary": summary_d,
        "workers": workers,
        "settings": settings,
        "batch_size": batch_size,
        "phases": dict(summary.timings),
        "batches": {str(k): v for k, v in sorted(log.batch_rows.items())},
        "pieces": pieces,
        "error_causes": dict(log.error_causes.most_common()),
        "totals": {
            "rows": sum(log.batch_rows.values()),
            "error_rows": sum(log.error_causes.values()),
            "output_tokens": sum(p.output_tokens for p in log.pieces),
            "padding_waste": 1 - sum(p.prefill_real_tokens for p in log.pieces) / slots
            if slots else 0.0,
            "early_finish_waste": sum(p.finished_row_steps for p in log.pieces) / steps
            if steps else 0.0,
            "prefix_cache_hit_rate": sum(p.prompt_tokens_cached for p in cached) / cached_prompt
            if cached_prompt else None,
        },
    }


def write_report(folder: Any, data: dict[str, Any]) -> str:
    """Render `data` (from `report_data`) into `REPORT_NAME` in the output folder (a path or
    a `ray_jobs.storage.OutputDir`: local or object store), whole; returns where it is."""
    from ray_jobs.storage import OutputDir

    out = OutputDir.open(folder)
    out.write_bytes(REPORT_NAME, render_html(data).encode("utf-8"))
    return (out / REPORT_NAME).uri


# --- rendering -------------------------------------------------------------------------


def render_html(data: dict[str, Any]) -> str:
    s, t = data["summary"], data["totals"]
    sections = [
        _section("Output tokens per second", _plot_throughput(data)),
        _section("Rows finished per worker", _plot_worker_rows(data)),
        _section("Batch fill", _plot_fill(data)),
        _section("Padding and early-finish waste", _plot_waste(data)),
    ]
    if t["prefix_cache_hit_rate"] is not None:
        sections.append(_section("Prefix-cache hit rate", _plot_cache(data)))
    sections.append(_section("Error rows by cause", _plot_errors(data)))
    sections.append(_section("Phases", _plot_phases(data) + _table(
        [(PHASES.get(k, k), f"{v:.2f} s") for k, v in data["phases"].items()])))
    headline = [
        ("rows", "rows", s["rows"]),
        *([("input_rows", "input rows (n samples each give n rows)", s["input_rows"])]
          if s.get("input_rows") not in (None, s["rows"]) else []),
        ("error_rows", "error rows", s["error_rows"]),
        ("rows_resumed", "rows done by an earlier run", s["rows_resumed"]),
        ("input_tokens", "input tokens", s["input_tokens"]),
        ("output_tokens", "output tokens", s["output_tokens"]),
        ("wall_time_s", "wall time", f"{s['wall_time_s']:.1f} s"),
        ("output_tokens_per_s", "output tokens/s", f"{s['output_tokens_per_s']:.1f}"),
        ("num_batches", "batches", s["num_batches"]),
        ("padding_waste", "padding waste", f"{t['padding_waste']:.1%}"),
        ("early_finish_waste", "early-finish waste", f"{t['early_finish_waste']:.1%}"),
        ("worker_restarts", "worker restarts", s["worker_restarts"]),
        ("device_oom_errors", "device out-of-memory errors", s["device_oom_errors"]),
    ]
    rows = "".join(f'<tr><th>{html.escape(label)}</th><td data-key="{key}">'
                   f"{html.escape(str(value))}</td></tr>" for key, label, value in headline)
    settings = _table(sorted(_flatten(data["settings"]).items()))
    payload = json.dumps(data).replace("</", "<\\/")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>nanoserve batch report: {html.escape(s['output_dir'])}</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1>nanoserve batch</h1><p class=\"where\">{html.escape(s['output_dir'])}</p>"
        f"<section><h2>Summary</h2><table>{rows}</table></section>"
        + "".join(sections)
        + f"<section><h2>Settings</h2>{settings}</section>"
        f'<script type="application/json" id="{REPORT_DATA_ID}">{payload}</script>'
        "</body></html>\n")


_CSS = ("body{font-family:sans-serif;margin:2em auto;max-width:60em;color:#222;background:#fff}"
        "h1{margin-bottom:0}.where{color:#666;margin-top:.2em}"
        "table{border-collapse:collapse}th,td{text-align:left;padding:.15em .8em;"
        "border-bottom:1px solid #ddd;font-size:.9em}td{font-family:monospace}"
        "section{margin-top:1.5em}svg{max-width:100%;height:auto}")


def _section(title: str, body: str) -> str:
    return f"<section><h2>{html.escape(title)}</h2>{body}</section>"


def _table(pairs: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}"
                               f"</td></tr>" for k, v in pairs) + "</table>"


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and isinstance(v[0], dict):  # file identities
            out[f"{prefix}{k}"] = ", ".join(str(x.get("name", x)) for x in v)
        else:
            out[f"{prefix}{k}"] = v
    return out


def _figure(height: float = 2.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, height), layout="constrained")
    return fig, fig.add_subplot()


def _svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "nanoserve"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype


def _empty(message: str) -> str:
    return f"<p>{html.escape(message)}</p>"


def _plot_throughput(data: dict[str, Any]) -> str:
    pieces = data["pieces"]
    if not pieces:
        return _empty("no batch was computed in this run")
    end = max(data["summary"]["wall_time_s"], max(p["finished_s"] for p in pieces), 1e-3)
    width = end / MAX_TIME_BINS
    bins = [0.0] * MAX_TIME_BINS
    for p in pieces:
        bins[min(int(p["finished_s"] / width), MAX_TIME_BINS - 1)] += p["output_tokens"]
    fig, ax = _figure()
    ax.bar([i * width for i in range(MAX_TIME_BINS)], [b / width for b in bins], width=width,
           align="edge", color="#4c72b0", label="output tokens/s (by when results came back)")
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("output tokens/s")
    total = ax.twinx()
    times, cumulative = [0.0], [0]
    for p in pieces:
        times.append(p["finished_s"])
        cumulative.append(cumulative[-1] + p["output_tokens"])
    total.step(times, cumulative, where="post", color="#dd8452", label="output tokens so far")
    total.set_ylabel("output tokens so far")
    fig.legend(loc="outside upper center", ncols=2, frameon=False)
    return _svg(fig)


def _plot_worker_rows(data: dict[str, Any]) -> str:
    pieces = data["pieces"]
    if not pieces:
        return _empty("no batch was computed in this run")
    fig, ax = _figure()
    for w in sorted({p["worker"] for p in pieces}):
        times, rows = [0.0], [0]
        for p in pieces:
            if p["worker"] == w:
                times.append(p["finished_s"])
                rows.append(rows[-1] + p["rows"])
        ax.step(times, rows, where="post", label=f"worker {w}")
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("rows finished")
    ax.legend(frameon=False)
    return _svg(fig)


def _plot_fill(data: dict[str, Any]) -> str:
    pieces = data["pieces"]
    if not pieces:
        return _empty("no batch was computed in this run")
    size = data["batch_size"]
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    ax.bar(range(len(pieces)), [p["rows"] / size for p in pieces], color="#55a868")
    ax.axhline(1.0, color="#888", linewidth=0.8)
    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("batch (in the order results came back)")
    ax.set_ylabel(f"rows / batch size ({size})")
    return _svg(fig)


def _plot_waste(data: dict[str, Any]) -> str:
    pieces = data["pieces"]
    if not pieces:
        return _empty("no batch was computed in this run")
    t = data["totals"]
    x = list(range(len(pieces)))
    pad = [1 - p["prefill_real_tokens"] / p["prefill_slots"] if p["prefill_slots"] else 0.0
           for p in pieces]
    early = [p["finished_row_steps"] / p["decode_row_steps"] if p["decode_row_steps"] else 0.0
             for p in pieces]
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    ax.bar([i - 0.2 for i in x], pad, width=0.4, color="#c44e52",
           label=f"padding (of the prefill rectangle; job {t['padding_waste']:.1%})")
    ax.bar([i + 0.2 for i in x], early, width=0.4, color="#8172b3",
           label=f"early finish (of decode row-steps; job {t['early_finish_waste']:.1%})")
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("batch (in the order results came back)")
    ax.set_ylabel("share wasted")
    fig.legend(loc="outside upper center", ncols=2, frameon=False)
    return _svg(fig)


def _plot_cache(data: dict[str, Any]) -> str:
    pieces = [p for p in data["pieces"] if p["prompt_tokens_cached"] is not None]
    fig, ax = _figure()
    ax.plot([p["finished_s"] for p in pieces],
            [p["prompt_tokens_cached"] / p["prompt_tokens"] if p["prompt_tokens"] else 0.0
             for p in pieces], marker="o", color="#937860",
            label=f"job: {data['totals']['prefix_cache_hit_rate']:.1%}")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("prompt tokens from the cache")
    ax.legend(frameon=False)
    return _svg(fig)


def _plot_errors(data: dict[str, Any]) -> str:
    causes = data["error_causes"]
    if not causes:
        return _empty("no error rows in this run")
    names = list(causes)[::-1]
    fig, ax = _figure(max(1.2, 0.4 * len(names) + 0.8))
    ax.barh(names, [causes[n] for n in names], color="#c44e52")
    ax.set_xlabel("error rows")
    return _svg(fig) + _table(list(causes.items()))


def _plot_phases(data: dict[str, Any]) -> str:
    phases = data["phases"]
    if not phases:
        return ""
    fig, ax = _figure(1.3)
    left = 0.0
    for i, (k, v) in enumerate(phases.items()):
        ax.barh([0], [v], left=left, color=f"C{i}", label=f"{PHASES.get(k, k)} {v:.1f} s")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds since the job started")
    fig.legend(loc="outside right center", frameon=False)
    return _svg(fig)


__all__ = ["PROMPT_TOKENS_CACHED_KEY", "REPORT_DATA_ID", "PieceRecord", "ReportLog",
           "error_cause", "piece_record", "report_data", "render_html", "write_report"]
