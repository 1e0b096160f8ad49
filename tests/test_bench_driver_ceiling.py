"""benchmarks/driver_ceiling.py --smoke: the real command on a few thousand rows, in a child
driver; the table's counts are the child's own (its CPU time and peak memory)."""

from benchmarks.driver_ceiling import SMOKE_ROWS, main, table


def test_smoke_run_measures_the_driver_and_prints_a_table(capsys):
    results = main(["--smoke"])
    (r,) = results.values()
    assert list(results) == [SMOKE_ROWS]
    assert 0 < r["cpu_s"] < r["wall_s"] * 4 and r["peak_kib"] > 10_000
    out = capsys.readouterr().out
    assert "driver CPU s / 1M rows" in out and f"{SMOKE_ROWS:,}" in out


def test_table_gives_cpu_seconds_per_million_rows():
    text = table({2_000_000: {"wall_s": 10.0, "cpu_s": 5.0, "peak_kib": 1024 * 300}})
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    assert ["2,000,000", "10", "200,000", "5.0", "2.5", "300"] in cells
