"""Stage report: a job's phases and when each ended (`JobSummary.timings`)."""

from __future__ import annotations

import time

# A run's phases, in order, as `JobSummary.timings` names them (and as `format` says them).
PHASES = {
    "prepare": "prepare",  # scan the input, load the tokenizer, open the output, first shard
    "ray": "Ray",  # start or join Ray
    "workers": "workers",  # start the actors until each has loaded the model (or is late)
    "first_shard": "first shard",  # until the first shard's result is back
    "generate": "generate",  # until the last result is back
    "shutdown": "shutdown",  # stop the actors (and a private Ray), mark the output complete
}


class Timeline:
    """When each phase of a run ended, in seconds from the job's start (the first mark of
    a phase counts); `timings` turns the marks into the phases' lengths."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.marks: dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.start

    def mark(self, phase: str) -> None:
        self.marks.setdefault(phase, self.now())

    def timings(self) -> dict[str, float]:
        out: dict[str, float] = {}
        before = 0.0
        for phase in PHASES:
            if phase in self.marks:
                out[phase] = self.marks[phase] - before
                before = self.marks[phase]
        return out


__all__ = ["PHASES", "Timeline"]
