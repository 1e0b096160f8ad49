"""Helpers shared by the CPU benchmarks: thread setup, machine description, model loading,
timing and Markdown tables (the tables paste into `benchmarks/RESULTS.md` as printed).

Run the scripts from the repository root, as `python benchmarks/<name>.py` or
`python -m benchmarks.<name>`.
"""

from __future__ import annotations

import os
import pathlib
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]


def set_threads(n: int) -> int:
    """Fix torch's intra-op threads (and interop to 1); returns what torch reports."""
    import torch

    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once in this process
        pass
    return torch.get_num_threads()


def cpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def mem_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def git_commit(tree: pathlib.Path = ROOT) -> str:
    """The short commit a checkout (this one by default) is at."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def describe_run(threads: int) -> str:
    """Lines naming the machine, software and settings of this run."""
    import torch

    return "\n".join([
        f"commit: {git_commit()}",
        f"machine: {os.cpu_count()}-core {platform.machine()} CPU ({cpu_model_name()}), "
        f"{mem_gib():.0f} GiB",
        f"python {platform.python_version()}, torch {torch.__version__}, torch threads {threads}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        f"load average at start (1/5/15 min): {load_average()}",
    ])


def load_nanoserve(model: str):
    """(model, tokenizer, path): the engine's model in float32 on the CPU."""
    import torch

    from nanoserve.model.model import build_model
    from nanoserve.weights.model_store import resolve_model
    from nanoserve.weights.tokenizer import Tokenizer
    from nanoserve.weights.weights import load_checkpoint

    path = resolve_model(model)
    config, state_dict = load_checkpoint(path)
    net = build_model(config, state_dict, torch.float32, "cpu")
    return net, Tokenizer.from_path(path), path


def timed(fn: Callable[..., object], *args) -> tuple[float, object]:
    """(seconds, result) of `fn(*args)`, by the monotonic clock."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats keep the formatting the caller gave them as strings."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join([line, rule, *body])


def own_peak_kib() -> int:
    """This process's peak resident set in KiB: `VmHWM` of /proc/self/status, the high-water
    mark of this program's own memory. (`ru_maxrss` is not: Linux carries it over from the
    parent through fork and exec, so a child of a parent that loaded torch reports at least
    the parent's size.) `ru_maxrss` where /proc is missing."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
