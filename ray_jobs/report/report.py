"""Stage report: the job report, one self-contained HTML file per run,
`OUTPUT_DIR/_nanoserve_report.html`.

Each answered span (a shard's rows sent in one call: the whole shard, or a half of one cut
after worker deaths) is read into a `SpanRecord` (`ray_jobs.workers.span`: when it came back,
from which worker, its rows, output tokens and the engine's counts from the table's schema
metadata) and folded at once into the driver's `ReportLog`: exact running totals plus sums
over at most `MAX_TIME_BINS` time bins and `SHARE_BINS` share bins, never a list of the
spans, so the log, the embedded data and the page keep one size whatever the number of
shards (a 1,000,000-row job of 7,813 shards gets the same report size as one of 79). Rows
written and error rows by cause are counted as spans are answered. `write_report` renders
them with the job's settings, phases and summary. What it shows:
- output tokens/s over time (binned by when results came back) and the cumulative tokens
  at the end of each bin;
- rows finished per worker over time (cumulative, at the end of each bin);
- shard fill: spans by their rows / the job's batch size, a shard's rows (a histogram; the
  mean in the legend);
- waste: spans by padding share (of the padded prefill rectangle) and by early-finish
  share (of the decode row-steps, spent on rows that had already finished), with the job's
  exact totals in the legend;
- prefix-cache hit rate per time bin (prompt tokens served from the cache / prompt tokens),
  only when the worker's tables carry the optional metadata key
  `nanoserve.prompt_tokens_cached`;
- error rows by cause (`error_cause`: the message up to its details);
- the settings, the phases (`JobSummary.timings`) and the summary (rows by finish reason,
  empty answers, and the summary's warnings above it: constrained rows cut by `max_tokens`,
  ...; whether Ctrl-C stopped the run);
- first, the whole job over every run into the folder (`JobTotals`: this run's counts, and
  the earlier runs' parts read back), so a resumed job's report covers all of it.

Plots are drawn by matplotlib (Agg, no pyplot state) as inline SVG: no script, no file or
network fetch; each figure is cleared once drawn, and matplotlib is imported only when a
report is rendered. The report's numbers (`report_data`: totals and bins, not per-span
records) are also embedded as JSON in
`<script type="application/json" id="nanoserve-report-data">` (`REPORT_DATA_ID`).
"""

from __future__ import annotations

import dataclasses
import html
import io
import json
import re
from collections import Counter
from typing import Any

from ray_jobs.output.manifest import REPORT_NAME
from ray_jobs.report.timeline import PHASES
from ray_jobs.workers.span import SpanRecord

REPORT_DATA_ID = "nanoserve-report-data"
MAX_TIME_BINS = 40  # time bins of the report's plots over time (and of its data)
FIRST_BIN_WIDTH_S = 1 / 64  # the time bins' width until the run outlasts MAX_TIME_BINS of them
SHARE_BINS = 20  # bins of shard fill and of waste shares (0-5%, 5-10%, ... 95-100%)
MAX_ERROR_CAUSES = 100  # distinct error causes kept; further ones count as OTHER_CAUSES
OTHER_CAUSES = "(other causes)"


_DETAIL = re.compile(r"[:;(\[,]")


def error_cause(message: str) -> str:
    """An error message's cause, without its row's details: the text before the first
    ':', ';', '(', '[' or ',', with numbers as N ("prompt has N tokens", "empty prompt",
    "invalid sampling values")."""
    head = _DETAIL.split(message, maxsplit=1)[0].strip() or message.strip()
    return re.sub(r"\d+", "N", head)


class _TimeBins:
    """Sums over time bins of equal width that cover [0, the latest time added): at most
    `MAX_TIME_BINS` of them. The width starts at `FIRST_BIN_WIDTH_S` and doubles (adjacent
    bins merged in pairs) whenever a time falls past the last bin, so a run of any length
    ends with between MAX_TIME_BINS / 2 and MAX_TIME_BINS bins (fewer for a run shorter than
    MAX_TIME_BINS / 2 first widths)."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        self.width_s = FIRST_BIN_WIDTH_S
        self.series: dict[Any, list[int]] = {f: [] for f in fields}
        self.length = 0

    def add(self, t: float, values: dict[Any, int]) -> None:
        t = max(t, 0.0)
        while t >= MAX_TIME_BINS * self.width_s:
            self.width_s *= 2
            for series in self.series.values():
                series[:] = [sum(series[i:i + 2]) for i in range(0, len(series), 2)]
            self.length = (self.length + 1) // 2
        i = int(t / self.width_s)
        if i >= self.length:
            self.length = i + 1
        for key, value in values.items():
            series = self.series.setdefault(key, [])
            series.extend([0] * (self.length - len(series)))
            series[i] += value

    def as_dict(self) -> dict[Any, list[int]]:
        return {k: v + [0] * (self.length - len(v)) for k, v in self.series.items()}


_SPAN_SUMS = ("rows", "error_rows", "prompt_tokens", "output_tokens", "prefill_slots",
               "prefill_real_tokens", "decode_row_steps", "finished_row_steps")


def _share_bin(count: int, whole: int) -> int:
    return min(int(count / whole * SHARE_BINS), SHARE_BINS - 1)


class ReportLog:
    """What the driver gathers during a run for the report: running totals and binned
    counts, never one record per span, so its size does not grow with the number of
    shards (it grows only with the number of workers and of distinct error causes, both
    capped or small).
    - `add(span)` (a `SpanRecord`): exact sums over the spans (`spans`: rows, tokens,
      prefill and decode counts, prefix-cache counts of the spans that carry them; the
      first and last result times), the same sums over time bins by when results came back
      (`_TimeBins`, at most `MAX_TIME_BINS`; rows also per worker), the number of spans by
      rows (at most one entry per span size: the batch size bounds it) and by padding and
      early-finish share (`SHARE_BINS` each);
    - `written(shard_id, results)`, `written_rows`: spans answered and rows written this
      run, error rows by cause (`error_cause`; past `MAX_ERROR_CAUSES` distinct causes,
      further ones count as `OTHER_CAUSES`)."""

    def __init__(self) -> None:
        self.spans: dict[str, Any] = {"count": 0, **{k: 0 for k in _SPAN_SUMS},
                                      "cached_spans": 0, "cached_prompt_tokens": 0,
                                      "prompt_tokens_cached": 0,
                                      "first_s": None, "last_s": None}
        self.time_bins = _TimeBins(("spans", *_SPAN_SUMS, "cached_prompt_tokens",
                                    "prompt_tokens_cached"))
        self.worker_bins = _TimeBins(())  # rows finished, keyed by worker
        self.span_rows: Counter = Counter()  # rows per span -> spans
        self.padding_bins = [0] * SHARE_BINS  # spans by padding share of their prefill
        self.early_finish_bins = [0] * SHARE_BINS  # spans by early-finish share of decode
        self.spans_answered = 0
        self.rows_written = 0
        self.error_causes: Counter = Counter()

    def add(self, p: SpanRecord) -> None:
        tot = self.spans
        tot["count"] += 1
        values = {"spans": 1, **{k: getattr(p, k) for k in _SPAN_SUMS}}
        if p.prompt_tokens_cached is not None:
            tot["cached_spans"] += 1
            values["cached_prompt_tokens"] = p.prompt_tokens
            values["prompt_tokens_cached"] = p.prompt_tokens_cached
        for k, v in values.items():
            if k != "spans":
                tot[k] += v
        tot["first_s"] = p.finished_s if tot["first_s"] is None else min(tot["first_s"],
                                                                          p.finished_s)
        tot["last_s"] = p.finished_s if tot["last_s"] is None else max(tot["last_s"],
                                                                        p.finished_s)
        self.time_bins.add(p.finished_s, values)
        self.worker_bins.add(p.finished_s, {p.worker: p.rows})
        self.span_rows[p.rows] += 1
        if p.prefill_slots:
            self.padding_bins[_share_bin(p.prefill_slots - p.prefill_real_tokens,
                                         p.prefill_slots)] += 1
        if p.decode_row_steps:
            self.early_finish_bins[_share_bin(p.finished_row_steps, p.decode_row_steps)] += 1

    def written(self, shard_id: int, results: list[dict[str, Any]]) -> None:
        self.written_rows(len(results), [res["error"] or "" for res in results
                                         if res["finish_reason"] == "error"])

    def written_rows(self, rows: int, errors: list[str], spans: int = 1) -> None:
        """`rows` output rows answered (by `spans` spans), `errors` the messages of the error
        rows among them."""
        self.spans_answered += spans
        self.rows_written += rows
        for message in errors:
            cause = error_cause(message)
            if cause not in self.error_causes and len(self.error_causes) >= MAX_ERROR_CAUSES:
                cause = OTHER_CAUSES
            self.error_causes[cause] += 1


class JobTotals:
    """The whole job's rows as its parts hold them, over every run that wrote into the
    folder: this run's (`add_run`, from the driver's counts) and the earlier runs' (`add_part`,
    read back from each part they wrote: a run killed without a report counts too). Counts
    only: its size does not grow with the parts."""

    COLUMNS = ("finish_reason", "error", "generated_text", "num_generated_tokens")

    def __init__(self, total_shards: int | None = None) -> None:
        self.total_shards = total_shards  # the job's shards (None: not known)
        self.shards = {"this run": 0, "earlier runs": 0}
        self.rows = {"this run": 0, "earlier runs": 0}
        self.finish_reasons: Counter = Counter()
        self.empty_answers = 0
        self.output_tokens = 0
        self.error_causes: Counter = Counter()

    def add_run(self, log: ReportLog, summary: Any) -> None:
        """This run's rows: the shards it wrote and their rows, by finish reason and cause."""
        self.shards["this run"] += summary.num_shards
        self.rows["this run"] += summary.rows
        self.finish_reasons.update({k: v for k, v in summary.finish_reasons.items() if v})
        self.empty_answers += getattr(summary, "empty_answers", 0)
        self.output_tokens += summary.output_tokens
        self.error_causes.update(log.error_causes)

    def add_part(self, folder: Any, name: str) -> None:
        """An earlier run's part, read back (the few columns counted; an embedding part has
        no finish_reason: its error rows are those with an `error`)."""
        schema = folder.parquet_schema(name)
        columns = [c for c in self.COLUMNS if schema is not None and c in schema.names]
        table = folder.read_parquet(name, columns).to_pydict()
        errors = table.get("error", [])
        reasons = table.get("finish_reason") or ["error" if e is not None else None
                                                 for e in errors]
        self.shards["earlier runs"] += 1
        self.rows["earlier runs"] += len(reasons)
        self.finish_reasons.update(r for r in reasons if r is not None)
        texts = table.get("generated_text", [None] * len(reasons))
        self.empty_answers += sum(r == "stop" and t == "" for r, t in zip(reasons, texts))
        self.output_tokens += sum(n or 0 for n in table.get("num_generated_tokens", ()))
        for e in errors:
            if e is not None:
                cause = error_cause(e)
                if cause not in self.error_causes and len(self.error_causes) >= MAX_ERROR_CAUSES:
                    cause = OTHER_CAUSES
                self.error_causes[cause] += 1

    def as_dict(self) -> dict[str, Any]:
        return {"total_shards": self.total_shards, "shards": dict(self.shards),
                "rows": dict(self.rows), "finish_reasons": dict(self.finish_reasons),
                "empty_answers": self.empty_answers, "output_tokens": self.output_tokens,
                "error_causes": dict(self.error_causes.most_common())}


def report_data(log: ReportLog, summary: Any, settings: dict[str, Any],
                batch_size: int, job: JobTotals | None = None) -> dict[str, Any]:
    """The report's numbers, JSON-ready (what the page shows and embeds). Bounded whatever
    the number of shards: totals, and bins, not per-span records.
    - `summary` (the `JobSummary` without its workers), `workers` (their `WorkerReport`s
      without `result_s`, the time of each result; `results` is its length), `settings`,
      `batch_size`, `phases` (seconds per phase);
    - `spans`: exact sums over the answered spans (`count`, `rows`, `error_rows`,
      `prompt_tokens`, `output_tokens`, `prefill_slots`, `prefill_real_tokens`,
      `decode_row_steps`, `finished_row_steps`; `cached_spans`, `cached_prompt_tokens` and
      `prompt_tokens_cached` over the spans whose tables carry the prefix-cache count),
      `first_s` and `last_s` (first and last result, seconds from the job's start);
    - `time_bins`: `width_s`, then per field a list with one sum per bin (bin i covers
      [i * width_s, (i + 1) * width_s), by when results came back; at most MAX_TIME_BINS),
      `rows_by_worker` {worker: list};
    - `shard_fill`: `bins` (SHARE_BINS), `spans` (spans per bin of rows / batch_size;
      bin i covers [i / bins, (i + 1) / bins), the last one from (bins - 1) / bins up,
      full shards included); `waste`: `padding` and `early_finish`, spans per bin of
      their share wasted, the same bins;
    - `error_causes` (error rows by cause, most first), `totals` (rows, error_rows,
      spans answered this run, output tokens, padding and early-finish waste, prefix-cache
      hit rate: exact);
    - `job` (`JobTotals.as_dict`: the whole job over every run, earlier runs' parts read
      back; this run's alone when `job` is None)."""
    p = dict(log.spans)
    summary_d = dataclasses.asdict(summary)
    workers = summary_d.pop("workers")
    for w in workers:
        w["results"] = len(w.pop("result_s", ()) or ())
    fill = [0] * SHARE_BINS
    for rows, n in log.span_rows.items():
        fill[_share_bin(min(rows, batch_size), batch_size) if batch_size else 0] += n
    bins = log.time_bins.as_dict()
    by_worker = log.worker_bins.as_dict()
    length = len(bins["spans"])
    if job is None:
        job = JobTotals()
        job.add_run(log, summary)
    return {
        "summary": summary_d,
        "job": job.as_dict(),
        "workers": workers,
        "settings": settings,
        "batch_size": batch_size,
        "phases": dict(summary.timings),
        "spans": p,
        "time_bins": {"width_s": log.time_bins.width_s, **bins,
                      "rows_by_worker": {str(w): v + [0] * (length - len(v))
                                         for w, v in sorted(by_worker.items())}},
        "shard_fill": {"bins": SHARE_BINS, "spans": fill},
        "waste": {"bins": SHARE_BINS, "padding": list(log.padding_bins),
                  "early_finish": list(log.early_finish_bins)},
        "error_causes": dict(log.error_causes.most_common()),
        "totals": {
            "rows": log.rows_written,
            "error_rows": sum(log.error_causes.values()),
            "spans": log.spans_answered,
            "output_tokens": p["output_tokens"],
            "padding_waste": 1 - p["prefill_real_tokens"] / p["prefill_slots"]
            if p["prefill_slots"] else 0.0,
            "early_finish_waste": p["finished_row_steps"] / p["decode_row_steps"]
            if p["decode_row_steps"] else 0.0,
            "prefix_cache_hit_rate": p["prompt_tokens_cached"] / p["cached_prompt_tokens"]
            if p["cached_prompt_tokens"] else None,
        },
    }


def write_report(folder: Any, data: dict[str, Any]) -> str:
    """Render `data` (from `report_data`) into `REPORT_NAME` in the output folder (a path or
    a `ray_jobs.input.storage.OutputDir`: local or object store), whole; returns where it is."""
    from ray_jobs.input.storage import OutputDir

    out = OutputDir.open(folder)
    out.write_bytes(REPORT_NAME, render_html(data).encode("utf-8"))
    return (out / REPORT_NAME).uri


# --- rendering -------------------------------------------------------------------------


def render_html(data: dict[str, Any]) -> str:
    s, t = data["summary"], data["totals"]
    sections = [
        _section("The whole job (every run into this folder)", _job_table(data["job"])),
        _section("Output tokens per second", _plot_throughput(data)),
        _section("Rows finished per worker", _plot_worker_rows(data)),
        _section("Shard fill", _plot_fill(data)),
        _section("Padding and early-finish waste", _plot_waste(data)),
    ]
    if t["prefix_cache_hit_rate"] is not None:
        sections.append(_section("Prefix-cache hit rate", _plot_cache(data)))
    sections.append(_section("Workers", _workers_table(data["workers"])))
    sections.append(_section("Error rows by cause", _plot_errors(data)))
    sections.append(_section("Phases", _plot_phases(data) + _table(
        [(PHASES.get(k, k), f"{v:.2f} s") for k, v in data["phases"].items()])))
    headline = [
        ("rows", "rows", s["rows"]),
        *([("input_rows", "input rows (n samples each give n rows)", s["input_rows"])]
          if s.get("input_rows") not in (None, s["rows"]) else []),
        ("error_rows", "error rows", s["error_rows"]),
        *([("finish_reasons", "rows by finish reason",
            ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items()))]
          if s.get("finish_reasons") else []),
        *([("empty_answers", "empty answers (finish_reason stop, no text)", s["empty_answers"])]
          if s.get("empty_answers") else []),
        ("rows_resumed", "rows done by an earlier run", s["rows_resumed"]),
        ("input_tokens", "input tokens", s["input_tokens"]),
        ("output_tokens", "output tokens", s["output_tokens"]),
        ("wall_time_s", "wall time", f"{s['wall_time_s']:.1f} s"),
        ("output_tokens_per_s", "output tokens/s", f"{s['output_tokens_per_s']:.1f}"),
        ("num_shards", "shards", s["num_shards"]),
        ("padding_waste", "padding waste", f"{t['padding_waste']:.1%}"),
        ("early_finish_waste", "early-finish waste", f"{t['early_finish_waste']:.1%}"),
        ("worker_restarts", "worker restarts", s["worker_restarts"]),
        ("device_oom_errors", "device out-of-memory errors", s["device_oom_errors"]),
    ]
    rows = "".join(f'<tr><th>{html.escape(label)}</th><td data-key="{key}">'
                   f"{html.escape(str(value))}</td></tr>" for key, label, value in headline)
    notes = list(s.get("warnings") or ())
    if s.get("interrupted"):
        done, total = s["interrupted"]
        notes.append(f"interrupted (Ctrl-C): {done} of {total} shards are written; rerun the "
                     f"same command to resume")
    warnings = "".join(f'<p class="warning">{html.escape(w)}</p>' for w in notes)
    settings = _table(sorted(_flatten(data["settings"]).items()))
    payload = json.dumps(data).replace("</", "<\\/")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>nanoserve batch report: {html.escape(s['output_dir'])}</title>"
        f"<style>{_CSS}</style></head><body>"
        f"<h1>nanoserve batch</h1><p class=\"where\">{html.escape(s['output_dir'])}</p>"
        f"<section><h2>Summary</h2>{warnings}<table>{rows}</table></section>"
        + "".join(sections)
        + f"<section><h2>Settings</h2>{settings}</section>"
        f'<script type="application/json" id="{REPORT_DATA_ID}">{payload}</script>'
        "</body></html>\n")


_CSS = ("body{font-family:sans-serif;margin:2em auto;max-width:60em;color:#222;background:#fff}"
        "h1{margin-bottom:0}.where{color:#666;margin-top:.2em}"
        "table{border-collapse:collapse}th,td{text-align:left;padding:.15em .8em;"
        "border-bottom:1px solid #ddd;font-size:.9em}td{font-family:monospace}"
        "section{margin-top:1.5em}svg{max-width:100%;height:auto}"
        ".warning{color:#8a4b00;background:#fff4e0;padding:.4em .8em}")


def _job_table(job: dict[str, Any]) -> str:
    """The whole job's rows and shards, this run's and earlier runs' (resumed), by finish
    reason, and its error rows by cause."""
    shards, rows = job["shards"], job["rows"]
    written = sum(shards.values())
    of = f" of {job['total_shards']}" if job.get("total_shards") is not None else ""
    pairs = [("shards written", f"{written}{of} ({shards['this run']} this run, "
                                f"{shards['earlier runs']} by earlier runs)"),
             ("rows", f"{sum(rows.values())} ({rows['this run']} this run, "
                      f"{rows['earlier runs']} by earlier runs)")]
    if job["finish_reasons"]:
        pairs.append(("rows by finish reason",
                      ", ".join(f"{k} {v}" for k, v in job["finish_reasons"].items())))
    if job["empty_answers"]:
        pairs.append(("empty answers (finish_reason stop, no text)", job["empty_answers"]))
    pairs.append(("error rows", sum(job["error_causes"].values())))
    pairs.append(("output tokens", job["output_tokens"]))
    body = "<table>" + "".join(
        f'<tr><th>{html.escape(k)}</th><td data-job="{html.escape(k)}">{html.escape(str(v))}'
        f"</td></tr>" for k, v in pairs) + "</table>"
    if job["error_causes"]:
        body += "<h3>Error rows by cause</h3>" + _table(list(job["error_causes"].items()))
    return body


def _workers_table(workers: list[dict[str, Any]]) -> str:
    """One row per worker: where it ran, what it did, and how full its engine was (busy:
    the share of its time up that its engine had rows; rows a decode step, on average). Its
    spans: the shards it answered (a shard cut after worker deaths: each of its halves)."""
    head = ("worker", "device", "host", "spans", "rows", "restarts", "ready at", "engine busy",
            "rows a decode step")
    body = []
    for w in workers:
        busy = f"{w['busy_s'] / w['up_s']:.0%}" if w.get("up_s") else "-"
        per_step = (f"{w['decode_row_steps'] / w['decode_steps']:.1f} of {w['max_rows']}"
                    if w.get("decode_steps") else "-")
        ready = f"{w['ready_s']:.1f} s" if w.get("ready_s") is not None else "-"
        cells = (w["index"], w["device"], w["host"], w["spans"], w["rows"], w["restarts"],
                 ready, busy, per_step)
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(body)
            + "</table>")


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
    from matplotlib.figure import Figure  # imported on the first report: the driver's own

    fig = Figure(figsize=(8, height), layout="constrained")
    return fig, fig.add_subplot()


def _svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "nanoserve"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    fig.clear()  # drop the artists now (a Figure outside pyplot holds reference cycles)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype


def _empty(message: str) -> str:
    return f"<p>{html.escape(message)}</p>"


def _no_spans(data: dict[str, Any]) -> bool:
    return not data["spans"]["count"]


def _edges(data: dict[str, Any]) -> list[float]:
    """The times where the time bins end (the last one at the last result)."""
    bins = data["time_bins"]
    n = len(bins["spans"])
    return [min((i + 1) * bins["width_s"], data["spans"]["last_s"]) for i in range(n)]


def _ratio(counts: list[int], whole: list[int]) -> list[float | None]:
    return [a / b if b else None for a, b in zip(counts, whole)]


def _plot_throughput(data: dict[str, Any]) -> str:
    if _no_spans(data):
        return _empty("no shard was computed in this run")
    bins = data["time_bins"]
    width = bins["width_s"]
    tokens = bins["output_tokens"]
    fig, ax = _figure()
    ax.bar([i * width for i in range(len(tokens))], [b / width for b in tokens], width=width,
           align="edge", color="#4c72b0", label="output tokens/s (by when results came back)")
    ax.set_xlim(0, max(data["summary"]["wall_time_s"], len(tokens) * width))
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("output tokens/s")
    total = ax.twinx()
    cumulative = [0]
    for b in tokens:
        cumulative.append(cumulative[-1] + b)
    total.plot([0.0, *_edges(data)], cumulative, color="#dd8452", marker=".",
               label="output tokens so far (at the end of each bin)")
    total.set_ylabel("output tokens so far")
    fig.legend(loc="outside upper center", ncols=2, frameon=False)
    return _svg(fig)


def _plot_worker_rows(data: dict[str, Any]) -> str:
    if _no_spans(data):
        return _empty("no shard was computed in this run")
    fig, ax = _figure()
    edges = [0.0, *_edges(data)]
    for w, rows in data["time_bins"]["rows_by_worker"].items():
        cumulative = [0]
        for r in rows:
            cumulative.append(cumulative[-1] + r)
        ax.plot(edges, cumulative, marker=".", label=f"worker {w}")
    ax.set_xlabel("seconds since the job started (a point at the end of each bin)")
    ax.set_ylabel("rows finished")
    ax.legend(frameon=False)
    return _svg(fig)


def _share_axis(ax, bins: int) -> list[float]:
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:.0%}")
    return [i / bins for i in range(bins)]


def _plot_fill(data: dict[str, Any]) -> str:
    if _no_spans(data):
        return _empty("no shard was computed in this run")
    size, fill = data["batch_size"], data["shard_fill"]
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    x = _share_axis(ax, fill["bins"])
    mean = data["spans"]["rows"] / data["spans"]["count"] / size if size else 0.0
    ax.bar(x, fill["spans"], width=1 / fill["bins"], align="edge", color="#55a868",
           edgecolor="white", label=f"mean {mean:.1%} of the batch size")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"rows / batch size ({size}, a shard's rows); the last bin holds the full "
                  f"shards")
    ax.set_ylabel("spans (shards, or halves)")
    ax.legend(frameon=False)
    return _svg(fig)


def _plot_waste(data: dict[str, Any]) -> str:
    waste = data["waste"]
    if not sum(waste["padding"]) and not sum(waste["early_finish"]):
        return _empty("no prefill or decode counts in this run's results")
    t = data["totals"]
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    x = _share_axis(ax, waste["bins"])
    half = 0.5 / waste["bins"]
    ax.bar(x, waste["padding"], width=half, align="edge", color="#c44e52",
           label=f"padding (of the prefill rectangle; job {t['padding_waste']:.1%})")
    ax.bar([i + half for i in x], waste["early_finish"], width=half, align="edge",
           color="#8172b3",
           label=f"early finish (of decode row-steps; job {t['early_finish_waste']:.1%})")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("share wasted in a span (its engine batches' prefill or decode)")
    ax.set_ylabel("spans")
    fig.legend(loc="outside upper center", ncols=2, frameon=False)
    return _svg(fig)


def _plot_cache(data: dict[str, Any]) -> str:
    bins = data["time_bins"]
    edges = _edges(data)
    starts = [i * bins["width_s"] for i in range(len(edges))]
    points = [((a + b) / 2, r) for a, b, r in
              zip(starts, edges, _ratio(bins["prompt_tokens_cached"],
                                        bins["cached_prompt_tokens"])) if r is not None]
    fig, ax = _figure()
    ax.plot([t for t, _ in points], [r for _, r in points], marker="o", color="#937860",
            label=f"job: {data['totals']['prefix_cache_hit_rate']:.1%}")
    ax.set_ylim(0, 1)
    ax.set_xlabel("seconds since the job started (middle of each bin)")
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


__all__ = ["REPORT_DATA_ID", "JobTotals", "ReportLog", "error_cause", "report_data", "render_html",
           "write_report"]
