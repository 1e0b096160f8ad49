"""Stage dispatch: one pass of the driver over the job's shards (`_JobRun`): admit, send,
collect, record, and the progress bar.

A shard goes to a worker whole, as one span (the rows sent in one call); a shard whose worker
keeps dying is cut into spans (`_Span`: halves, then halves of those) until the row at fault
stands alone. The driver (`ray_jobs.dispatch.driver.run_pipeline`) builds a `_JobRun`, calls
`execute` on the input's shards, and makes the job's summary from its counts.

Progress: the bar counts input rows as they finish; for the spans in flight the driver asks
each worker every PROGRESS_POLL_S how many of their rows its engine has finished
(`ShardWorker.progress`), so it moves inside a shard, not only when the shard comes back.

Nothing lost, nothing duplicated (`_JobRun` has the bookkeeping):
- a worker that dies is replaced and the shards it held run again; a shard that kills
  its worker every time is cut in halves until the row at fault stands alone, and that
  row alone becomes an `error` row;
- a worker that cannot load the model fails the job with one line; no wait for a worker
  is unbounded (`worker_start_timeout_s`); more workers than the cluster has GPUs (or
  CPUs) are capped, with a warning;
- a driver killed at any moment resumes on rerun: parts on disk are kept (see
  `ray_jobs.output.manifest`), the rest is computed, each row written exactly once; Ctrl-C
  stops the run with its summary and the report of the whole job (`run_pipeline`);
- rows too big for a worker's KV pool are split into sub-batches by the engine, or become
  `error` rows when even one alone cannot fit; a device out-of-memory error makes the
  engine halve the batch, and the count is reported.

Invariants: a shard is recorded in the manifest once, when every row of it is answered
(`_write`, the one place); a span is sent in one place (`_submit`) and handled in one
(`_collect_one`, `_worker_died`); a wrong guess at which span killed a worker never cuts
a span or makes an error row.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pyarrow as pa

from nanoserve import InputError, NanoserveError
from ray_jobs.dispatch.pool import WorkerPool, first_line, log
from ray_jobs.input.shards import Shard
from ray_jobs.input.storage import OutputDir
from ray_jobs.output.manifest import Manifest, adopt_part, part_name
from ray_jobs.report.report import ReportLog
from ray_jobs.report.timeline import Timeline
from ray_jobs.workers.options import JobOptions
from ray_jobs.workers.tasks import ShardOutcome, ShardRunner, TaskKind
from ray_jobs.workers.worker import (
    ENGINE_KEY,
    OOM_KEY,
    PREFILL_SLOTS_KEY,
    PREFILL_TOKENS_KEY,
    PROMPT_TOKENS_CACHED_KEY,
)

PROGRESS_POLL_S = 1.0  # how often the driver asks its workers how far their rows are
FAULT_HOLD_AFTER_PARTS = "NANOSERVE_FAULT_HOLD_AFTER_PARTS"  # testing hook: `_fault_hold_after_parts`
MAX_SHARD_ATTEMPTS = 2  # deaths of its worker a shard may cause before it is cut in halves
PREFIX_KEY_TOKENS = 32  # leading prompt tokens that name a span's prefix for dispatch
DEATH_SETTLE_TIMEOUT_S = 60.0  # wait for the other tasks of a dead actor to end


@dataclass
class _Pending:
    """A shard sent to the workers whose rows are not all answered yet."""

    shard: Shard
    left: int  # rows without an answer
    tables: dict[int, pa.Table] = field(default_factory=dict)  # spans' rows, by first row


@dataclass
class _Span:
    """Rows [rows[0], rows[1]) of one shard that go to a worker in one call: the whole shard
    (its worker writes the part), or, once the shard killed its worker MAX_SHARD_ATTEMPTS
    times, a half of it (then a half of that...), whose rows come back to the driver, which
    writes the shard's part when every span is answered.

    A suspect span was in flight on a worker that died. It runs alone on an idle worker
    (nothing else is sent there until it ends), so if that worker dies, the span did it."""

    pending: _Pending
    rows: tuple[int, int]
    split: bool = False  # a half (of a half...) of a shard that kept killing its worker
    suspect: bool = False
    deaths: int = 0  # worker deaths blamed on this span

    def size(self) -> int:
        return self.rows[1] - self.rows[0]

    def prefix(self) -> tuple[int, ...]:
        """No tokens on the driver: spans go to the least-loaded worker."""
        return ()

    def samples(self) -> int:
        return self.size()


@dataclass
class _Sent:
    span: _Span
    worker: int
    seq: int  # order of sending: an actor runs its tasks in that order


class _JobRun:
    """One pass over the shards: admit, submit, collect, record.

    Bookkeeping: `queue` holds spans waiting for a worker (retries first, in order),
    `in_flight` maps each call's ObjectRef to what was sent. `_submit` is the one place a
    span is sent; `_collect_one` (with `_worker_died` for deaths) the one place a finished
    or failed span is handled; `_write` the one place a shard's part is recorded in the
    manifest (written by its worker, or here from its spans). A shard is recorded once,
    when all its rows are answered: no row is lost or written twice, whatever dies (a
    worker that wrote a part and died before answering wrote it under the shard's name:
    the shard's next run replaces it whole).

    Failures:
    - the task raising on a span (a Python exception in `run_shard`): its rows become
      `error` rows, made here (`local`: the same walk without an engine); an input that
      became unreadable since the scan stops the job (InputError);
    - a worker dying (its process killed, crashed, its node lost): every span in flight
      on it ends, and the worker is replaced. The earliest sent of those that failed was
      most likely running (an actor runs its calls in order; the one before may have
      finished with its reply lost) and is blamed for the death; all that failed become
      suspects, which run alone from then on, so every later death is blamed exactly. A
      span blamed MAX_SHARD_ATTEMPTS times (once, if already a half) is cut in halves; a
      single row blamed becomes an `error` row saying the worker died while processing it.
      The guess (earliest sent) only ever blames a span that was not yet a suspect, i.e. a
      whole shard with no death yet, and one death is below MAX_SHARD_ATTEMPTS: a wrong
      guess never cuts a span or makes an error row;
    - more than `max_deaths_in_a_row` deaths without any span finishing on a worker between
      them stop the job (NanoserveError): workers that die on everything are not a row's
      fault.
    """

    def __init__(self, opts: JobOptions, folder: OutputDir, manifest: Manifest,
                 start_pool: Callable[[], WorkerPool], total_rows: int,
                 timeline: Timeline, retry: set[int], local: ShardRunner, kind: TaskKind) -> None:
        """`start_pool` is called when the first span is sent: a rerun with nothing left
        to compute starts neither Ray nor a worker. `retry`: shard ids an earlier run wrote
        that are computed again (their parts are replaced), never adopted. `local`: the
        shard walk without an engine, for error rows made here. `kind`: the task (its
        progress rates, its summary's finish reasons)."""
        self.opts = opts
        self.kind = kind
        self.retry = retry
        self.local = local
        self.folder = folder
        self.manifest = manifest
        self.start_pool = start_pool
        self.pool: WorkerPool | None = None
        self.queue: deque[_Span] = deque()
        self.in_flight: dict[Any, _Sent] = {}
        self.sent = 0
        self.deaths_in_a_row = 0
        self.rows = self.error_rows = self.num_shards = 0
        self.rows_resumed = manifest.rows_done  # output rows earlier runs wrote and kept
        self.written: set[int] = set()  # shard ids whose parts this run recorded
        self.input_rows = 0
        self.truncated_rows = 0
        self.finish_reasons: Counter = Counter()
        self.cut_constrained: Counter = Counter()  # constrained rows ended by length, by max_tokens
        self.empty_answers = 0  # rows that ended at 'stop' with no text
        self.results_back = 0  # answers (or deaths) of spans collected
        self.input_tokens = self.output_tokens = 0
        self.padded_slots = self.padded_real = 0
        self.cached_tokens = self.cached_prompt_tokens = 0  # spans from prefix-caching engines
        self.any_prefix_cache = False
        self.oom_errors = 0
        self.report = ReportLog()  # what the job report shows (`ray_jobs.report.report`)
        self.timeline = timeline
        self.t0 = time.perf_counter()
        # The bar (`opts.progress`), shown from when the workers are ready, so that its clock,
        # rate and time left are the generation's, not Ray's start and the model's load: input
        # rows answered (`bar_rows`: spans back, shards resumed) plus, for the spans in
        # flight, the rows their workers' engines have finished so far (`partial`, and their
        # output tokens, by the span's ref), asked every PROGRESS_POLL_S.
        self.total_rows = total_rows
        self.bar: Any = None
        self.bar_rows = 0
        self.partial: dict[Any, int] = {}
        self.partial_tokens: dict[Any, int] = {}
        self.progress_asks: dict[Any, int] = {}  # `progress` calls sent: ref -> worker
        self.next_ask = 0.0

    def execute(self, shards: Iterator[Shard]) -> None:
        """Hold what each live worker may take (`hold_limits`) plus the queue; take the next
        shard from `shards` only when the queue is empty and a worker has room."""
        source = iter(shards)
        more = True
        try:
            while True:
                while self.queue and (index := self._worker_for(self.queue[0])) is not None:
                    self._submit(self.queue.popleft(), index)
                if more and not self.queue and self._has_room():
                    shard = next(source, None)
                    if shard is None:
                        more = False
                    else:
                        self._admit(shard)
                    continue
                if not self.in_flight:
                    break  # every worker idle, so any span could go: the queue is empty too
                self._collect_one()
            self.timeline.mark("prepare")  # (marked already unless no worker was needed)
            if "first_shard" in self.timeline.marks:
                if self.results_back == 1:  # the first result was the only one: one phase
                    del self.timeline.marks["first_shard"]
                self.timeline.mark("generate")
        finally:
            if self.bar is not None:
                self.bar.close()

    def _has_room(self) -> bool:
        """Whether a new shard could be sent now (before the pool starts: yes)."""
        if self.pool is None:
            return True
        return self.pool.pick(False) is not None

    def _worker_for(self, span: _Span) -> int | None:
        """The worker `span` goes to now, or None while none can take it. Starts the pool
        when the first span is ready to go."""
        if self.pool is None:
            self.pool = self.start_pool()
            self._open_bar()
        return self.pool.pick(span.suspect, span.prefix())

    def _open_bar(self) -> None:
        """The progress bar, from now (the workers are ready), starting at the rows resumed."""
        if not self.opts.progress:
            return
        from tqdm import tqdm

        self.t0 = time.perf_counter()
        self.bar = tqdm(total=self.total_rows, initial=self.bar_rows, unit="row",
                        file=sys.stderr, dynamic_ncols=True,
                        desc=f"nanoserve {self.kind.command}")

    def _admit(self, shard: Shard) -> None:
        """Skip a shard an earlier run wrote (unless it is to be retried), or queue it."""
        if shard.shard_id not in self.retry:
            before = self.manifest.rows_done
            if shard.shard_id in self.manifest.done or adopt_part(
                    self.folder, self.manifest, shard.shard_id, shard.digest(),
                    beside=self.local.beside_part(shard.shard_id)):
                self.rows_resumed += self.manifest.rows_done - before
                self.bar_rows += shard.num_rows
                self._show()
                return
        self.queue.append(_Span(_Pending(shard, shard.num_rows), (0, shard.num_rows)))

    def _submit(self, span: _Span, index: int) -> None:
        """The one place a span is sent to a worker (`index`, from `_worker_for`)."""
        worker = self.pool.workers[index]
        shard = span.pending.shard
        whole = not span.split
        ref = worker.handle.run_shard.remote(shard, None if whole else span.rows, whole)
        worker.in_flight += 1
        worker.rows_in_flight += span.samples()
        worker.holds_suspect = span.suspect
        worker.last_prefix = span.prefix()
        self.sent += 1
        self.in_flight[ref] = _Sent(span, index, self.sent)

    def _collect_one(self) -> None:
        """The one place a finished or failed span is handled: wait for any span in
        flight, then count and record its rows, or handle its worker's death."""
        import ray

        self.pool.grow()  # workers on GPUs that joined the cluster (ray_jobs.dispatch.autoscale)
        timeout = self.pool.poll_s
        if self.bar is not None:  # wake to ask the workers how far their rows are
            timeout = PROGRESS_POLL_S if timeout is None else min(timeout, PROGRESS_POLL_S)
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=timeout)
        self._ask_progress()
        if not ready:
            return  # nothing finished within the poll: look for joining GPUs again
        sent = self._pop(ready[0])
        outcome, value = _fetch(ready[0])
        self.timeline.mark("first_shard")
        self.results_back += 1
        if outcome == "died":
            self._worker_died(sent, value)
        else:
            self._settle(sent, outcome, value)

    def _pop(self, ref: Any) -> _Sent:
        sent = self.in_flight.pop(ref)
        self.partial.pop(ref, None)
        self.partial_tokens.pop(ref, None)
        worker = self.pool.workers[sent.worker]
        worker.in_flight -= 1
        worker.rows_in_flight -= sent.span.samples()
        if sent.span.suspect:
            worker.holds_suspect = False
        return sent

    def _settle(self, sent: _Sent, outcome: str, value: Any) -> None:
        """A span the worker answered: with its `ShardOutcome`, or with an exception."""
        worker = self.pool.workers[sent.worker]
        span = sent.span
        if outcome == "raised":
            cause = value.cause if isinstance(value.cause, Exception) else None
            if isinstance(cause, InputError):
                raise cause
            message = f"{self.local.task.verb} failed: {first_line(str(cause or value))}"
            self._answer(span, self.local.run(span.pending.shard, span.rows, write=False,
                                              error=message))
            return
        meta = value.meta
        if ENGINE_KEY in meta:  # the actor's counters so far (its answers come in any order)
            counters = json.loads(meta[ENGINE_KEY])
            if counters.get("up_s", 0) >= worker.engine.get("up_s", 0):
                worker.engine = counters
        self.padded_slots += int(meta.get(PREFILL_SLOTS_KEY, 0))
        self.padded_real += int(meta.get(PREFILL_TOKENS_KEY, 0))
        if PROMPT_TOKENS_CACHED_KEY in meta:
            self.any_prefix_cache = True
            self.cached_tokens += int(meta[PROMPT_TOKENS_CACHED_KEY])
            self.cached_prompt_tokens += value.answered_prompt_tokens
        ooms = int(meta.get(OOM_KEY, 0))
        if ooms:
            self.oom_errors += ooms
            log(f"nanoserve: worker {sent.worker} ran out of device memory {ooms} time(s) on "
                f"shard {span.pending.shard.shard_id}; the engine retried it in smaller "
                f"sub-batches")
        worker.spans += 1
        worker.rows += span.size()
        worker.last_result_s = self.timeline.now()
        worker.result_s.append(worker.last_result_s)
        if value.record is not None:
            self.report.add(dataclasses.replace(value.record, worker=sent.worker,
                                                finished_s=worker.last_result_s))
        self.deaths_in_a_row = 0
        self._answer(span, value)

    def _worker_died(self, sent: _Sent, error: Exception) -> None:
        """Every span in flight on the dead worker ends now: those that ran before the
        death have their results, the others failed with it. Blame the earliest sent of
        the failed ones, make them all suspects, replace the worker, send them again."""
        import ray

        index = sent.worker
        others = [ref for ref, s in self.in_flight.items() if s.worker == index]
        if others:
            ray.wait(others, num_returns=len(others), timeout=DEATH_SETTLE_TIMEOUT_S)
        failed = [sent]
        for ref in others:
            other = self._pop(ref)
            outcome, value = _fetch(ref, timeout=0)
            if outcome == "died":
                failed.append(other)
            else:
                self._settle(other, outcome, value)
        failed.sort(key=lambda s: s.seq)
        for s in failed:
            s.span.suspect = True
        suspect = failed[0].span
        cause = first_line(str(error))
        self.deaths_in_a_row += 1
        if self.deaths_in_a_row > self.opts.max_deaths_in_a_row:
            raise NanoserveError(
                f"workers died {self.deaths_in_a_row} times in a row without answering a "
                f"shard (last: {cause}); the job stopped (rerun it to resume)"
            )
        shard = suspect.pending.shard
        log(f"nanoserve: worker {index} died while running shard {shard.shard_id} "
            f"({suspect.size()} of its {shard.num_rows} rows): {cause}; replacing it")
        self.pool.replace(index)
        retry = [s.span for s in failed[1:]] + self._blame(suspect, cause)
        self.queue.extendleft(reversed(retry))

    def _blame(self, span: _Span, cause: str) -> list[_Span]:
        """A span that was running when its worker died: what to send again (itself, or
        its two halves), or nothing when it is one row, which becomes an `error` row."""
        span.deaths += 1
        if span.deaths < (1 if span.split else MAX_SHARD_ATTEMPTS):
            return [span]
        lo, hi = span.rows
        if hi - lo > 1:
            mid = lo + (hi - lo) // 2
            return [_Span(span.pending, (lo, mid), split=True, suspect=True),
                    _Span(span.pending, (mid, hi), split=True, suspect=True)]
        message = (f"the worker died while processing this row ({cause}); isolated after its "
                   f"shard killed the worker {MAX_SHARD_ATTEMPTS} times")
        self._answer(span, self.local.run(span.pending.shard, span.rows, write=False,
                                          error=message))
        return []

    def _answer(self, span: _Span, outcome: ShardOutcome) -> None:
        """Count a span's rows; record its shard once every row is answered (the worker
        wrote the part of a whole shard; the spans of a cut one are joined here)."""
        pending = span.pending
        self._count(outcome)
        pending.left -= span.size()
        if outcome.table is not None:
            pending.tables[span.rows[0]] = outcome.table
        if pending.left == 0:
            self._write(pending.shard, pending.tables)

    def _write(self, shard: Shard, tables: dict[int, pa.Table]) -> None:
        """The one place a shard's part is recorded in the manifest: written by its worker
        (`tables` empty), or written here first from its spans' rows, in input order (with
        its OpenAI fragments, in a job that has them: `ShardRunner.commit`)."""
        if tables:
            table = pa.concat_tables([tables[k] for k in sorted(tables)])
            self.local.commit(shard, table)
            rows = table.num_rows
        else:
            rows = self.folder.parquet_num_rows(part_name(shard.shard_id))
        self.manifest.record(shard.shard_id, rows)
        self.manifest.save(self.folder)
        self.num_shards += 1
        self.written.add(shard.shard_id)
        _fault_hold_after_parts(len(self.written))

    def _count(self, out: ShardOutcome) -> None:
        self.rows += out.rows
        self.input_rows += out.input_rows
        self.error_rows += out.error_rows
        self.finish_reasons.update(out.finish_reasons)
        self.cut_constrained.update(out.cut_constrained)
        self.empty_answers += out.empty_answers
        self.input_tokens += out.input_tokens
        self.output_tokens += out.output_tokens
        self.truncated_rows += out.truncated
        self.report.written_rows(out.rows, out.errors)
        self.bar_rows += out.input_rows
        self._show()

    def _ask_progress(self) -> None:
        """With the bar on: read the workers' answers to `progress` (`ShardWorker.progress`)
        that are back, and ask each worker with spans in flight again every
        PROGRESS_POLL_S. A worker that died answers nothing: its spans count when they
        come back from another."""
        if self.bar is None or self.pool is None:
            return
        import ray

        if self.progress_asks:
            ready, _ = ray.wait(list(self.progress_asks), num_returns=len(self.progress_asks),
                                timeout=0)
            spans = {(s.worker, s.span.pending.shard.shard_id, *s.span.rows): ref
                     for ref, s in self.in_flight.items()}
            for ask in ready:
                worker = self.progress_asks.pop(ask)
                try:
                    answer = ray.get(ask)
                except ray.exceptions.RayError:
                    continue
                for shard_id, lo, hi, rows, tokens in answer:
                    ref = spans.get((worker, shard_id, lo, hi))
                    if ref is not None:  # (not back yet: its rows still count here)
                        self.partial[ref] = min(rows, hi - lo)
                        self.partial_tokens[ref] = tokens
        now = time.perf_counter()
        if now >= self.next_ask:
            self.next_ask = now + PROGRESS_POLL_S
            asked = set(self.progress_asks.values())
            for index, w in enumerate(self.pool.workers):
                if w.alive and w.in_flight and w.handle is not None and index not in asked:
                    self.progress_asks[w.handle.progress.remote()] = index
        self._show()

    def _show(self) -> None:
        """Move the bar to the rows answered so far (never back: a dead worker's finished
        rows are counted again when they come back) and show the rates."""
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        shown = SimpleNamespace(
            kind=self.kind, output_tokens=self.output_tokens + sum(self.partial_tokens.values()),
            input_rows=self.input_rows + sum(self.partial.values()),
            input_tokens=self.input_tokens)
        self.bar.set_postfix_str(_JobRun._rates(shown, elapsed), refresh=False)
        rows = self.bar_rows + sum(self.partial.values())
        if rows > self.bar.n:
            self.bar.update(rows - self.bar.n)  # (tqdm's rate and time left follow the rows)
        else:
            self.bar.refresh()  # the time since the start moves on

    def _rates(self, elapsed: float) -> str:
        """The progress bar's rates after `elapsed` seconds (the task's), from the counts
        `self` has (the run's, or those shown: the spans in flight included)."""
        return self.kind.progress(self, elapsed)

    def _warnings(self) -> tuple[str, ...]:
        out = []
        if cut := sum(self.cut_constrained.values()):
            low, high = min(self.cut_constrained), max(self.cut_constrained)
            limit = f"max_tokens {low}" if low == high else f"max_tokens {low}-{high}"
            out.append(f"warning: {cut} constrained row(s) ended by length ({limit}): their "
                       f"text is cut short and need not match its constraint (JSON schema, "
                       f"regex or choice); raise --max-tokens")
        if self.empty_answers:
            out.append(f"warning: {self.empty_answers} row(s) ended with an empty answer "
                       f"(finish_reason 'stop', generated_text ''): the model ended them at "
                       f"once, as a chat model given a raw 'prompt' often does (give it "
                       f"'messages')")
        return tuple(out)


def _fault_hold_after_parts(at: int | str) -> None:
    """Testing hook `NANOSERVE_FAULT_HOLD_AFTER_PARTS=<k>:<path>`: once this run has recorded
    its k-th part (`at`, or "last": once the walk has recorded every part of the job), the
    driver appends its pid to `<path>.holding` and waits while `<path>` exists (a test sends
    Ctrl-C at that moment)."""
    spec = os.environ.get(FAULT_HOLD_AFTER_PARTS)
    if not spec:
        return
    k, _, path = spec.partition(":")
    if k != str(at) or not os.path.exists(path):
        return
    with open(f"{path}.holding", "a") as f:
        f.write(f"{os.getpid()}\n")
    while os.path.exists(path):
        time.sleep(0.05)


def _fetch(ref: Any, timeout: float | None = None) -> tuple[str, Any]:
    """A call's outcome: ('ok', outcome), ('raised', RayTaskError) when `run_shard` raised,
    or ('died', error) when its worker died (or did not answer within `timeout`)."""
    import ray

    try:
        return "ok", ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        return "raised", e
    except ray.exceptions.RayError as e:  # actor died, unreachable, killed for memory, timeout
        return "died", e
