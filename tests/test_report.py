"""The job report (`ray_jobs.report.report`): written by every batch job into its output folder,
checked against the manifest and the Parquet parts (the independent record of what was
written), and rendered in a real headless Chromium (Debian's `chromium`; `.ci/run`
installs it, and sets NANOSERVE_REQUIRE_CHROMIUM=1 so a missing browser fails there
instead of skipping).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import pyarrow.dataset as ds
import pytest

from ray_jobs import run_batch_job
from ray_jobs.output.manifest import REPORT_NAME, Manifest
from ray_jobs.report.report import (
    MAX_ERROR_CAUSES,
    MAX_TIME_BINS,
    REPORT_DATA_ID,
    ReportLog,
    error_cause,
    render_html,
    report_data,
)
from ray_jobs.workers.span import SpanRecord

ROWS = ([{"prompt": f"Item number {i} is", "max_tokens": 1 + i % 4} for i in range(10)]
        + [{"prompt": ""}, {"prompt": "  "}, {"prompt": "Hello", "temperature": -1.0}])
CAUSES = {"empty prompt": 2, "invalid sampling values": 1}
# The solid fill colours of bars in the report's plots (ray_jobs.report.report), as RGB.
PLOT_COLOURS = {"throughput": (0x4C, 0x72, 0xB0), "shard fill": (0x55, 0xA8, 0x68),
                "early-finish waste": (0x81, 0x72, 0xB3), "error rows": (0xC4, 0x4E, 0x52)}
DATA_RE = re.compile(rf'<script type="application/json" id="{REPORT_DATA_ID}">(.*?)</script>',
                     re.S)


def embedded_data(page: str) -> dict:
    return json.loads(DATA_RE.search(page).group(1).replace("<\\/", "</"))


@pytest.fixture(scope="module")
def job(tmp_path_factory, ray_session, tiny_job_model):
    folder = tmp_path_factory.mktemp("report-job")
    path = folder / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = folder / "out"
    summary = run_batch_job(path, out, model=str(tiny_job_model), max_tokens=4, batch_size=4,
                            kv_cache_bytes=4 << 20, progress=False, scheduler="static")
    return summary, out


def test_the_job_writes_its_report_and_prints_its_path(job):
    summary, out = job
    assert summary.report == str(out / REPORT_NAME)
    assert (out / REPORT_NAME).is_file()
    assert f"report: {out / REPORT_NAME}" in summary.format().splitlines()


def test_report_data_match_the_manifest_and_the_parts(job):
    summary, out = job
    data = embedded_data((out / REPORT_NAME).read_text())
    manifest = Manifest.load(out)
    table = ds.dataset(out).to_table().to_pylist()
    assert data["totals"]["spans"] == len(manifest.done)
    assert data["totals"]["rows"] == manifest.rows_done == len(ROWS)
    assert data["summary"]["rows"] == len(table)
    errors = [r for r in table if r["finish_reason"] == "error"]
    assert data["totals"]["error_rows"] == data["summary"]["error_rows"] == len(errors)
    assert data["error_causes"] == CAUSES
    assert data["totals"]["output_tokens"] == sum(r["num_generated_tokens"] for r in table)
    # Spans came from workers: every row that reached one, each in one span.
    spans, bins = data["spans"], data["time_bins"]
    assert spans["rows"] == len(ROWS) - sum(CAUSES.values())
    assert 0 <= spans["first_s"] <= spans["last_s"] <= summary.wall_time_s
    assert sum(bins["rows"]) == spans["rows"] and sum(bins["spans"]) == spans["count"]
    assert sum(bins["output_tokens"]) == data["totals"]["output_tokens"]
    assert sum(map(sum, bins["rows_by_worker"].values())) == spans["rows"]
    assert len(bins["rows"]) * bins["width_s"] > spans["last_s"]
    assert sum(data["shard_fill"]["spans"]) == spans["count"]
    # Rows of one batch asked for 1..4 tokens: the static batch ran to its longest row.
    assert data["totals"]["early_finish_waste"] > 0
    assert data["totals"]["padding_waste"] == pytest.approx(summary.padding_waste)
    # The engine has a prefix cache (on by default): the page's rate is the summary's.
    assert summary.prefix_hit_rate is not None
    assert data["totals"]["prefix_cache_hit_rate"] == pytest.approx(summary.prefix_hit_rate)
    assert list(data["phases"]) == list(summary.timings)


def test_a_rerun_keeps_the_folder_resumable(job, tiny_job_model):
    """The report is one of the folder's own files: a rerun resumes, it is not refused."""
    summary, out = job
    again = run_batch_job(out.parent / "in.jsonl", out, model=str(tiny_job_model), max_tokens=4,
                          batch_size=4, kv_cache_bytes=4 << 20, progress=False)
    assert again.rows == 0 and again.rows_resumed == len(ROWS)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("NANOSERVE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not installed (.ci/run installs Debian's package)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def _headless(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", *args],
        capture_output=True, text=True, timeout=180, cwd=tmp_path)


def test_the_report_renders_in_headless_chromium(job, tmp_path):
    """A real browser draws the page (not blank: many colours, ink on a good share of it)
    and, from the DOM it built, shows the manifest's numbers."""
    from PIL import Image

    _, out = job
    url = (out / REPORT_NAME).as_uri()
    shot = tmp_path / "report.png"
    proc = _headless(tmp_path, f"--screenshot={shot}", "--window-size=1200,2400", url)
    assert shot.is_file(), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape == (2400, 1200, 3)
    colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    assert len(colours) > 50  # text, axes and several series colours
    assert tuple(colours[counts.argmax()]) == (255, 255, 255)  # the page's background
    assert 1 - counts.max() / counts.sum() > 0.03  # ink on a good share of it
    flat = pixels.reshape(-1, 3)
    for name, colour in PLOT_COLOURS.items():  # each plot's bars were drawn
        assert (flat == colour).all(axis=1).sum() > 1000, name

    dom = _headless(tmp_path, "--dump-dom", url).stdout
    manifest = Manifest.load(out)
    cells = dict(re.findall(r'<td data-key="(\w+)">([^<]*)</td>', dom))
    assert int(cells["rows"]) == manifest.rows_done
    errors = sum(r["finish_reason"] == "error" for r in ds.dataset(out).to_table().to_pylist())
    assert int(cells["error_rows"]) == errors
    data = embedded_data(dom)
    assert data["totals"]["spans"] == len(manifest.done)
    assert dom.count("<svg") >= 5  # throughput, workers, fill, waste, errors, phases


def _record(shard_id, worker, t, cached):
    return SpanRecord(shard_id, worker, t, rows=4, error_rows=0, prompt_tokens=40,
                       output_tokens=12, prefill_slots=48, prefill_real_tokens=40,
                       decode_row_steps=16, finished_row_steps=4, prompt_tokens_cached=cached)


def _log(*spans):
    log = ReportLog()
    for p in spans:
        log.add(p)
    return log


def test_prefix_cache_hit_rate_only_when_the_tables_carry_it(job):
    summary, _ = job
    log = _log(_record(0, 0, 1.0, None), _record(1, 1, 2.0, None))
    page = render_html(report_data(log, summary, {}, 4))
    assert "Prefix-cache hit rate" not in page
    log = _log(_record(0, 0, 1.0, 10), _record(1, 1, 2.0, 30))
    page = render_html(report_data(log, summary, {}, 4))
    assert "Prefix-cache hit rate" in page
    assert embedded_data(page)["totals"]["prefix_cache_hit_rate"] == pytest.approx(40 / 80)
    assert embedded_data(page)["totals"]["early_finish_waste"] == pytest.approx(8 / 32)


@pytest.mark.parametrize("message, cause", [
    ("empty prompt (column 'prompt')", "empty prompt"),
    ("prompt has 9003 tokens; the model's context is 512 tokens", "prompt has N tokens"),
    ("invalid sampling values: temperature must be >= 0", "invalid sampling values"),
    ("does not fit the worker's KV cache even alone: 300 prompt tokens", "does not fit the "
     "worker's KV cache even alone"),
])
def test_error_causes_drop_the_rows_details(message, cause):
    assert error_cause(message) == cause


def test_the_report_stays_the_same_size_whatever_the_number_of_shards(job):
    """A ReportLog fed 100,000 spans (a 12.8M-row job's shards) keeps bins, not records:
    its data and page are no bigger than for 100 spans, and its totals are the exact sums."""
    summary, _ = job
    rng = np.random.default_rng(0)

    def fed(n):
        log, sums = ReportLog(), dict.fromkeys(("rows", "output_tokens", "slots", "real",
                                                "steps", "finished", "prompt", "cached"), 0)
        for b in range(n):
            rows = int(rng.integers(1, 129))
            real = int(rng.integers(1, 1000)) * rows
            slots = real + int(rng.integers(0, 100)) * rows
            steps = rows * int(rng.integers(1, 64))
            finished = int(rng.integers(0, steps))
            cached = int(rng.integers(0, real + 1))
            p = SpanRecord(b, b % 8, b * 0.037, rows=rows, error_rows=0, prompt_tokens=real,
                            output_tokens=steps // 2, prefill_slots=slots,
                            prefill_real_tokens=real, decode_row_steps=steps,
                            finished_row_steps=finished, prompt_tokens_cached=cached)
            log.add(p)
            log.written(b, [{"finish_reason": "length", "error": None}] * rows
                        + [{"finish_reason": "error", "error": f"cause {b % 300}: row {b}"}])
            for k, v in (("rows", rows), ("output_tokens", steps // 2), ("slots", slots),
                         ("real", real), ("steps", steps), ("finished", finished),
                         ("prompt", real), ("cached", cached)):
                sums[k] += v
        return log, sums

    small, _ = fed(100)
    big, sums = fed(100_000)
    data = report_data(big, summary, {}, 128)
    small_data = report_data(small, summary, {}, 128)
    size, small_size = len(json.dumps(data)), len(json.dumps(small_data))
    assert size < 2 * small_size and size < 30_000
    bins = data["time_bins"]
    assert MAX_TIME_BINS // 2 <= len(bins["rows"]) <= MAX_TIME_BINS
    assert all(len(v) == len(bins["rows"]) for v in bins["rows_by_worker"].values())
    assert len(bins["rows_by_worker"]) == 8
    assert len(data["error_causes"]) <= MAX_ERROR_CAUSES + 1
    page = render_html(data)
    assert len(page) < 2 * len(render_html(small_data))
    assert embedded_data(page) == json.loads(json.dumps(data))
    # Exact totals.
    t, p = data["totals"], data["spans"]
    assert (t["rows"], t["error_rows"], t["spans"]) == (sums["rows"] + 100_000, 100_000,
                                                           100_000)
    assert sum(data["error_causes"].values()) == 100_000
    assert (p["count"], p["rows"], t["output_tokens"]) == (100_000, sums["rows"],
                                                           sums["output_tokens"])
    assert p["last_s"] == pytest.approx(99_999 * 0.037)
    assert t["padding_waste"] == 1 - sums["real"] / sums["slots"]
    assert t["early_finish_waste"] == sums["finished"] / sums["steps"]
    assert t["prefix_cache_hit_rate"] == sums["cached"] / sums["prompt"]
    # The bins add up to the totals.
    assert sum(bins["rows"]) == sum(map(sum, bins["rows_by_worker"].values())) == sums["rows"]
    assert sum(bins["output_tokens"]) == sums["output_tokens"]
    assert sum(bins["prompt_tokens_cached"]) == sums["cached"]
    assert (sum(data["shard_fill"]["spans"]) == sum(data["waste"]["padding"])
            == sum(data["waste"]["early_finish"]) == 100_000)
