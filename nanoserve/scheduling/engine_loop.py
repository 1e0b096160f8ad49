"""One continuous batch that outlives any caller: a thread that owns a
`ContinuousScheduler` and takes work from other threads.

    loop = llm.start_loop()                 # an EngineLoop(llm)
    future = loop.submit(prompts, params)   # from any thread
    future.progress()                       # (rows finished, rows, their tokens) so far
    completions = future.result()           # when the group's last row finishes

Rows submitted while others run join the running batch as rows finish, so a caller that
keeps two groups submitted (a group: the rows of one `submit`, a job worker's batch, while
it holds several of the driver's shards) never lets the batch drain between groups.

Under the LLM's reasoning parser, a group's completions come back split like `LLM.generate`'s
(`nanoserve.sampling.reasoning.split_completions`: `reasoning`, `text` the answer).

Failures: if a step raises (the device ran out of memory, say), every row then queued or
running is dropped with its blocks freed, and every unfinished group's future gets the
exception; the loop goes on with later submissions. `submit(..., alone=True)` runs a
group by itself: it starts once nothing else runs, and nothing else is admitted until it
ends, so its failure is its own (how a caller isolates a bad row).

Counters (`counters()`, read from any thread): how long the loop has been up, how long its
engine had rows (queued or running: `busy_s`), and the scheduler's decode steps and the rows
in them over the loop's life, so a caller can tell a full engine from a starved one.

Invariant: only the loop's thread touches the scheduler, the runner and the pool; while a
loop runs over an `LLM`, that LLM's own `generate` must not be called (it would drive the
same runner and pool from another thread).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from nanoserve.sampling.params import SamplingParams
from nanoserve.sampling.reasoning import split_completions
from nanoserve.sampling.sequence import SequenceOutput
from nanoserve.scheduling.scheduler import ContinuousScheduler
from nanoserve.static.generate import BatchStats


class GroupFuture(Future):
    """The future of a submitted group; `progress()` tells how far its rows are while it
    runs (read from any thread: the loop's thread is the only writer)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size  # the group's rows: its samples (a row asking for n counts n)
        self._group: Any = None  # the scheduler's group, once the loop took it

    def progress(self) -> tuple[int, int, int]:
        """(rows finished, rows, output tokens of the finished rows) so far."""
        group = self._group
        if group is None:
            return 0, self.size, 0
        outputs = list(group.outputs)
        return (self.size - group.left, self.size,
                sum(len(o.token_ids) for o in outputs if o is not None))


class EngineLoop:
    def __init__(self, llm) -> None:
        """llm: a `nanoserve.llm.LLM` built with the continuous scheduler (it has a runner)."""
        if llm.runner is None:
            raise ValueError("an engine loop needs an LLM with the continuous scheduler")
        self.llm = llm
        self._cv = threading.Condition()
        self._inbox: deque[tuple[list, list, GroupFuture, bool, list | None]] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # `call`s to run
        self._live: list[Future] = []  # futures of groups in the scheduler
        self._alone = False  # an alone group is in the scheduler
        self._closed = False
        self._started = time.perf_counter()
        self._busy_s = 0.0  # closed stretches of time with rows in the scheduler
        self._busy_since: float | None = None  # start of the open stretch, if any
        self._past = BatchStats()  # the counts of schedulers replaced after a failure
        self.sched = self._new_scheduler()
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    def _new_scheduler(self) -> ContinuousScheduler:
        llm = self.llm
        return ContinuousScheduler(llm.model, llm.pool, llm.runner, llm.eos_token_ids,
                                   llm.tokenizer, llm.max_batch_size,
                                   prefix_caching=llm.enable_prefix_caching,
                                   grammars=getattr(llm, "grammars", None))

    def submit(self, prompts: list[list[int]], params: list[SamplingParams],
               alone: bool = False, lora: list[str | None] | None = None) -> Future:
        """Queue a group of rows; the future's result is their completions, in order (and
        its `progress()` how many have finished so far). `lora`: each prompt's LoRA adapter
        (None: the base model; an unknown name fails the group with a ValueError)."""
        future = GroupFuture(sum(p.n for p in params))
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            self._inbox.append((prompts, params, future, alone, lora))
            self._cv.notify()
        return future

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the loop's thread between two steps (work on the engine's model and
        pool beside the running rows, e.g. label scores); the future holds its result."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine loop is closed")
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def counters(self) -> dict[str, float]:
        """`up_s` (since the loop started), `busy_s` (of which its engine had rows), the
        decode steps and rows in them (`decode_steps`, `decode_row_steps`) and the rows sent
        back to the queue for room (`preemptions`), over the loop's life."""
        now = time.perf_counter()
        since = self._busy_since
        stats = BatchStats()
        stats.add(self._past)
        stats.add(self.sched.stats)
        return {"up_s": now - self._started,
                "busy_s": self._busy_s + (now - since if since is not None else 0.0),
                "decode_steps": stats.decode_steps, "decode_row_steps": stats.decode_row_steps,
                "preemptions": stats.preemptions}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()

    def _take_new(self) -> list[tuple[list, list, Future, bool, list | None]]:
        """What may join now: an alone group only into an empty scheduler, nothing while an
        alone group runs; otherwise every queued group up to the first alone one."""
        taken = []
        if self._alone:
            return taken
        while self._inbox:
            prompts, params, future, alone, _ = self._inbox[0]
            if alone and (taken or self.sched.has_work):
                break
            taken.append(self._inbox.popleft())
            if alone:
                break
        return taken

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    if not self.sched.has_work and self._busy_since is not None:
                        self._busy_s += time.perf_counter() - self._busy_since
                        self._busy_since = None
                    while (not self._closed and not self.sched.has_work and not self._inbox
                           and not self._calls):
                        self._cv.wait()
                    calls, self._calls = list(self._calls), deque()
                    if self._closed and not self.sched.has_work and not calls:
                        return
                    new = self._take_new()
                for fn, future in calls:
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - the caller's to handle
                        future.set_exception(exc)
                for prompts, params, future, alone, lora in new:
                    self._add(prompts, params, future, alone, lora)
                if not self.sched.has_work:
                    continue
                if self._busy_since is None:
                    self._busy_since = time.perf_counter()
                try:
                    self.sched.step()
                except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
                    self.sched.abort()
                    failed, self._live = self._live, []
                    self._alone = False
                    self._past.add(self.sched.stats)
                    self.sched = self._new_scheduler()
                    for f in failed:
                        if not f.done():
                            f.set_exception(exc)

    def _add(self, prompts: list, params: list, future: GroupFuture, alone: bool,
             lora: list | None = None) -> None:
        def done(outputs: list[SequenceOutput]) -> None:
            self._live.remove(future)
            if alone:
                self._alone = False
            future.set_result(split_completions(getattr(self.llm, "reasoning", None), prompts,
                                                params, outputs))

        self._live.append(future)
        self._alone = self._alone or alone
        try:
            future._group = self.sched.add(prompts, params, done, lora)  # empty: done at once
        except Exception as exc:  # noqa: BLE001 - a bad row or one too big: the caller's
            done_already = future not in self._live
            if not done_already:
                self._live.remove(future)
                self._alone = self._alone and not alone
            future.set_exception(exc)


__all__ = ["EngineLoop", "GroupFuture"]
