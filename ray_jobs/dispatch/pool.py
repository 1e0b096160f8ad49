"""Stage dispatch: the job's workers. One actor per GPU (or CPU actors without GPUs), of
the task's class (`ray_jobs.tasks.generate.RayBatchWorker`,
`ray_jobs.tasks.embed.RayEmbedWorker`), how they are started and replaced, which one takes
the next span (a shard, or a half of one), and what each did (`WorkerReport`).

How much work a worker holds (`hold_limits`) follows its engine, not a count of shards: a
continuous engine is sent shards until it holds HOLD_FACTOR times the rows it runs at once.
A shard comes back only when its longest row ends, so about half the rows of the shards a
worker holds have finished while their shard waits for its last; three times the engine's
running rows keeps it full, with a queue to refill it as rows end, whatever the shards'
size. A static engine (one batch at a time) and a prefill-only worker hold two shards. A
user's `max_in_flight_per_worker` overrides this, with a warning when it would starve the
engine.

The pool never lets Ray restart an actor or retry a task behind the driver's back
(max_restarts=0, max_task_retries=0): the driver alone decides what runs again.

A worker that dies while it loads the model (its process killed: the kernel's
out-of-memory killer, a crash; or its node lost: a spot node reclaimed) is replaced by a
fresh actor, as one that dies mid-shard is, and the job goes on; `died_while_loading`
tells such a death from a load that fails (the loader raised: a bad checkpoint, an
unsupported model, no device memory for the weights), which stops the job at once with its
cause. A slot whose actors die while loading more than `max_deaths_in_a_row` times in a row
is given up, with a line naming the likely cause (the node's host memory, or the node).
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve import CPU_DEFAULT_ROWS, MAX_DEFAULT_ROWS, ModelError, NanoserveError, first_line
from ray_jobs.dispatch.autoscale import (
    GROW_POLL_S,
    LostNode,
    node_lost,
    wait_for_gpus,
)
from ray_jobs.options import JOB
from ray_jobs.workers.options import parse_num_workers
from ray_jobs.workers.worker import FAULT_ENV_PREFIX

if TYPE_CHECKING:
    from ray_jobs.report.timeline import Timeline
    from ray_jobs.workers.options import JobOptions


HOLD_FACTOR = 3  # a continuous engine's worker holds this many times its running rows
MAX_ACTOR_THREADS = 256  # calls one actor runs at once (each a thread waiting on its engine)


# The object stores' client settings forwarded from the driver's environment to its actors
# (through Ray's runtime_env, so visible to whoever can read the cluster's job metadata):
# the workers reach the store the driver reached. Nodes with their own credentials (an
# instance role) need none of these set on the driver.
STORAGE_ENV = frozenset({
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_EC2_METADATA_DISABLED", "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"})


def _shards_for(rows: int, opts: JobOptions) -> int:
    """Shards that hold HOLD_FACTOR x `rows` rows, plus one."""
    return min(MAX_ACTOR_THREADS, max(2, -(-HOLD_FACTOR * rows // max(1, opts.batch_size)) + 1))


def actor_threads(opts: JobOptions, on_gpu: bool = False) -> int:
    """Calls an actor runs at once (Ray's max_concurrency): the spans it may hold. Sized
    before its engine loads: from the user's running rows, else the most the engine's
    default can be on its device (`nanoserve.scheduling.running_rows`)."""
    if opts.max_in_flight_per_worker is not None:
        return max(1, opts.max_in_flight_per_worker)
    return _shards_for(opts.max_running_rows
                        or (MAX_DEFAULT_ROWS if on_gpu else CPU_DEFAULT_ROWS), opts)


def hold_limits(info: dict[str, Any], opts: JobOptions) -> tuple[int, int | None]:
    """(spans, rows) a worker whose actor answered `info` may hold at once (rows None: no
    bound but the spans'); see the module docstring."""
    if opts.max_in_flight_per_worker is not None:
        return max(1, opts.max_in_flight_per_worker), None
    if info.get("scheduler") == "continuous" and info.get("max_rows"):
        rows = int(info["max_rows"])
        return _shards_for(rows, opts), HOLD_FACTOR * rows
    return 2, None


def starve_warning(opts: JobOptions) -> str | None:
    """One line when a user's `max_in_flight_per_worker` lets a worker hold fewer rows than
    keep a continuous engine full (HOLD_FACTOR times its running rows: a shard waits for
    its longest row). The depth sized from the engine does not starve it (short of shards
    so small that MAX_ACTOR_THREADS of them hold fewer rows)."""
    if opts.scheduler == "static" or opts.max_in_flight_per_worker is None:
        return None
    held = opts.batch_size * opts.max_in_flight_per_worker
    rows = opts.max_running_rows or CPU_DEFAULT_ROWS  # (the engine's default is at least that)
    if held >= HOLD_FACTOR * rows:
        return None
    return (f"nanoserve: warning: batch_size {opts.batch_size} x max_in_flight_per_worker "
            f"{opts.max_in_flight_per_worker} = {held} rows a worker, fewer than the "
            f"{HOLD_FACTOR} x {rows} that keep its engine full (it runs "
            f"{rows} at once, and a shard waits for its longest row): the "
            f"engine will run part empty; leave max_in_flight_per_worker unset (it is then "
            f"sized from the engine)")


@dataclass(frozen=True)
class WorkerReport:
    index: int
    gpu_ids: tuple
    device: str
    host: str
    spans: int  # spans this worker answered in this run (shards, or halves of cut ones)
    rows: int
    restarts: int = 0  # times it died and was replaced by a fresh actor
    ready_s: float | None = None  # seconds from the job's start to its first actor's model loaded
    last_result_s: float | None = None  # seconds from the job's start to its last result
    result_s: tuple[float, ...] = ()  # seconds from the job's start to each of its results
    node_id: str = ""  # the Ray node its (last) actor ran on
    # Its engines' counters (`BatchWorker.engine_counters`), summed over its actors: seconds
    # up (from the model loaded to its last answer) and busy (the engine had rows), decode
    # steps and the rows in them; max_rows: the most rows its engine runs at once.
    up_s: float = 0.0
    busy_s: float = 0.0
    decode_steps: int = 0
    decode_row_steps: int = 0
    max_rows: int = 0
    load_s: dict[str, float] = field(default_factory=dict)  # its (last) actor's start, by part

    @property
    def busy_fraction(self) -> float | None:
        """Time its engine had rows / time it was up (None before any answer)."""
        return self.busy_s / self.up_s if self.up_s > 0 else None

    @property
    def rows_per_step(self) -> float | None:
        """Rows its engine decoded a step, on average (None: no decode step counted)."""
        return self.decode_row_steps / self.decode_steps if self.decode_steps else None


ENGINE_COUNTERS = ("up_s", "busy_s", "decode_steps", "decode_row_steps")


@dataclass
class WorkerSlot:
    handle: Any  # its actor (None until its first actor has loaded the model)
    info: dict[str, Any]  # its actor's info() ({} until then)
    in_flight: int = 0  # spans sent and not answered
    rows_in_flight: int = 0  # their samples
    max_spans: int = 2  # `hold_limits`, set when its actor has loaded
    max_rows_held: int | None = None
    spans: int = 0  # spans this slot answered (a whole shard is one span)
    rows: int = 0
    restarts: int = 0  # times its actor died (mid-shard or while loading) and was replaced
    ready_s: float | None = None  # seconds from the job's start to the first actor ready
    last_result_s: float | None = None  # seconds from the job's start to its last result
    result_s: list[float] = field(default_factory=list)  # ... to each of its results
    alive: bool = True
    holds_suspect: bool = False  # running a suspect span, which it runs alone
    last_prefix: tuple[int, ...] = ()  # the leading tokens of the last span sent to it
    engine: dict[str, float] = field(default_factory=dict)  # its actor's latest counters
    engine_past: dict[str, float] = field(default_factory=dict)  # its dead actors' last ones

    def can_take(self) -> bool:
        """Whether it holds fewer spans and rows than `hold_limits` allow."""
        return self.in_flight < self.max_spans and (
            self.max_rows_held is None or self.rows_in_flight < self.max_rows_held)

    def engine_total(self, key: str) -> float:
        return self.engine.get(key, 0) + self.engine_past.get(key, 0)

    def new_actor(self) -> None:
        """Its actor was replaced: fold the dead one's counters into the past."""
        for k in ENGINE_COUNTERS:
            self.engine_past[k] = self.engine_total(k)
        self.engine = {}


@dataclass
class _Loading:
    """An actor loading the model: its `info()` call, the slot it fills (None: a worker that
    joins, taking the next index once loaded), how many actors before it in that slot died
    while loading, in a row, and when waiting for it ends. `blocking`: the job waits for it
    (a worker the job starts with, the first replacement of one that died mid-shard); else
    it joins the pool when loaded (`grow`) and is waited for only while no worker is alive
    (the replacement of one that died while loading, a worker on a GPU that joined)."""

    handle: Any
    ref: Any
    slot: int | None
    deaths: int
    deadline: float
    blocking: bool


LOAD_DEATH_CAUSE = ("the likely cause is too little host memory on its node for the model (the "
                    "kernel's out-of-memory killer: see dmesg there), or a failing node")


class WorkerPool:
    """The job's actors: one per GPU (num_gpus=1), or CPU actors (num_cpus=1) when the
    cluster has no GPUs. `start` returns when every model is loaded; a worker that dies is
    replaced by a fresh actor (`replace`), never restarted by Ray behind the driver's back
    (max_restarts=0, max_task_retries=0: the driver alone decides what runs again).

    No wait is unbounded: an actor not ready within `worker_start_timeout_s` (the cluster
    has no room for it, or the model loads too slowly) is given up; a worker that cannot
    load the model fails the job with one line (ModelError).

    A worker that dies while loading (`died_while_loading`: at the start, as a replacement,
    or joining) is replaced by a fresh actor in its slot, with one line saying so; the
    replacement is waited for only while no worker is alive, else it joins when loaded
    (`grow`). After `max_load_deaths` such deaths in a row the slot is given up (one line
    naming the likely cause); when that leaves no worker the job stops with that line. A
    slot given up is not refilled by `grow`.

    Nodes come and go (ray_jobs.dispatch.autoscale): a worker whose node is lost is not replaced
    on the spot (`replace`; the driver sends its shards to the others); on GPUs the pool
    then asks the cluster every GROW_POLL_S for GPUs beyond its workers (`grow`): up to
    `--num-workers`' MAX for a range or `auto`, up to the number started for a plain number
    (so a lost worker comes back when a GPU is free or a node joins). A started actor is
    `pending` until its model is loaded, and joins the pool then; it holds no work before."""

    def __init__(self, actor_cls: Any, kwargs: dict[str, Any], timeout_s: float,
                 timeline: Timeline,
                 max_load_deaths: int = JOB["max_deaths_in_a_row"].default,
                 opts: JobOptions | None = None) -> None:
        """`opts`: what `hold_limits` reads (None: two spans a worker)."""
        self.opts = opts
        self.actor_cls = actor_cls
        self.kwargs = kwargs
        self.timeout_s = timeout_s
        self.timeline = timeline
        self.max_load_deaths = max_load_deaths  # deaths while loading in a row, per slot
        self.workers: list[WorkerSlot] = []
        self.grows = False  # GPU workers: `grow` asks the cluster for GPUs beyond the workers
        self.max_workers: int | None = None  # grow up to this many live workers (None: all GPUs)
        self.pending: list[_Loading] = []  # actors still loading that the job does not wait for
        self.nodes_lost: list[LostNode] = []
        self.given_up = 0  # slots given up after their actors kept dying while loading
        self.gave_up: str | None = None  # the last such slot: who, how often, Ray's reason
        self._next_check = 0.0

    @property
    def poll_s(self) -> float | None:
        """How long the driver waits for a result before calling `grow` again (None: until
        a result comes, for a pool that neither grows nor has actors loading)."""
        return GROW_POLL_S if self.grows or self.pending else None

    @classmethod
    def start(cls, opts: JobOptions, timeline: Timeline, actor: type,
              actor_kwargs: dict[str, Any] | None = None) -> WorkerPool:
        """`actor`: the task's actor class (`tasks.generate.RayBatchWorker`,
        `tasks.embed.RayEmbedWorker`), built with the job's worker arguments and
        `actor_kwargs`."""
        import ray

        wanted = parse_num_workers(opts.num_workers)
        if wanted is not None and wanted.grows:  # GPU workers only: wait for the first GPUs
            wait_for_gpus(wanted, opts.worker_start_timeout_s, log)
        resources = ray.cluster_resources()
        num_gpus = int(resources.get("GPU", 0))
        num_cpus = int(resources.get("CPU", 0))
        if wanted is not None and wanted.grows:
            count = min(num_gpus, wanted.high or num_gpus)
        else:
            count = wanted.low if wanted is not None else max(1, num_gpus)
        if getattr(opts, "quantization", None) and not num_gpus:
            raise ModelError(f"quantization={opts.quantization!r} needs FP8 compute: GPUs of "
                             f"compute capability 8.9 or newer, and the cluster has none")
        slots, unit = (num_gpus, "GPU") if num_gpus else (num_cpus, "CPU")
        if 1 <= slots < count:
            log(f"nanoserve: {count} workers asked for, but the cluster has {slots} {unit}(s) "
                 f"for one worker each; starting {slots}")
            count = slots
        if num_gpus:
            actor_options: dict[str, Any] = {"num_gpus": 1}
            num_threads = None
        else:
            actor_options = {"num_cpus": 1}
            num_threads = max(1, num_cpus // count)
        # Testing hooks (see ray_jobs.workers.worker), and the object store's settings: the workers
        # read the input and write the parts with the driver's store (`STORAGE_ENV`).
        env = {k: v for k, v in os.environ.items()
               if k.startswith(FAULT_ENV_PREFIX) or k in STORAGE_ENV}
        if env:
            actor_options["runtime_env"] = {"env_vars": env}
        # Threaded actor: a worker holds several shards at once (`hold_limits`), so its
        # engine (continuous scheduler) admits the next shards' rows as rows finish. A
        # static engine still runs one batch at a time (a lock). One thread more answers
        # the driver's `progress` calls while every shard's thread waits on the engine.
        actor_cls = ray.remote(actor).options(
            max_restarts=0, max_task_retries=0,
            max_concurrency=actor_threads(opts, bool(num_gpus)) + 1, **actor_options)
        kwargs = {"model": opts.model, "dtype": opts.dtype,
                  "kv_cache_fraction": opts.kv_cache_fraction,
                  "kv_cache_bytes": opts.kv_cache_bytes, "num_threads": num_threads,
                  "kv_cache_dtype": opts.kv_cache_dtype,
                  "max_batch_size": opts.max_running_rows,
                  "scheduler": opts.scheduler, "prefix_caching": opts.prefix_caching,
                  "reasoning_parser": opts.reasoning_parser or "none",
                  **({"quantization": opts.quantization} if opts.quantization else {}),
                  **({"lora": opts.lora} if opts.lora else {}),
                  **(actor_kwargs or {})}
        pool = cls(actor_cls, kwargs, opts.worker_start_timeout_s, timeline,
                   opts.max_deaths_in_a_row, opts)
        if actor.admits_rows and (warning := starve_warning(opts)) is not None:
            log(warning)
        if opts.progress:
            where = f"{num_gpus} GPU(s)" if num_gpus else "CPU"
            log(f"nanoserve: starting {count} worker(s) on {where}, loading {opts.model}")
        # A range or `auto` goes as soon as MIN are ready; the others join when loaded
        # (`grow`), so a GPU the cluster lists but cannot place on (a node lost, not yet
        # noticed) holds nothing up.
        waited = min(count, wanted.low) if wanted is not None and wanted.grows else count
        pool.workers = [WorkerSlot(None, {}, alive=False) for _ in range(waited)]
        loading = [pool._launch(i, blocking=True) for i in range(waited)]
        loading += [pool._launch(None, blocking=False) for _ in range(count - waited)]
        late = pool._wait_loaded(loading)
        if not pool.num_alive():
            pool.shutdown()
            if pool.gave_up is not None:
                raise NanoserveError(pool.none_left())
            raise NanoserveError(
                f"no worker was ready within {opts.worker_start_timeout_s:g} s: the cluster has "
                f"no free {unit} for one, or the model loads more slowly than that"
            )
        if opts.progress:
            log(ready_line([w.info for w in pool.workers if w.alive]))
        if late:
            log(f"nanoserve: {late} of {count} workers were not ready within "
                 f"{opts.worker_start_timeout_s:g} s (no free {unit}?); going on with "
                 f"{pool.num_alive()}")
        if num_gpus:
            pool.grows = True
            pool.max_workers = wanted.high if wanted is not None and wanted.grows else count
        return pool

    def _launch(self, slot: int | None, blocking: bool, deaths: int = 0) -> _Loading:
        """Start an actor (it loads the model in its constructor) and ask for its `info()`."""
        handle = self.actor_cls.remote(**self.kwargs)
        return _Loading(handle, handle.info.remote(), slot, deaths,
                        time.monotonic() + self.timeout_s, blocking)

    def _wait_loaded(self, loading: list[_Loading]) -> int:
        """Wait for these actors' models to load; each fills its slot as it answers, one
        that dies while loading is replaced (`_died_loading`). Returns once no blocking
        actor is left and a worker is alive (the others join later: `pending`), or nothing
        is left. A blocking actor not ready by its deadline is killed, its slot left empty; a
        non-blocking one goes to `pending`. Returns how many were killed so. The first
        actor that cannot load the model raises ModelError at once (every actor killed),
        without waiting for the others or the timeout."""
        import ray

        waiting = {e.ref: e for e in loading}
        late = 0
        while waiting and (not self.num_alive() or any(e.blocking for e in waiting.values())):
            first = min(waiting.values(), key=lambda e: e.deadline)
            done, _ = ray.wait(list(waiting), num_returns=1,
                               timeout=max(0.0, first.deadline - time.monotonic()))
            if not done:  # the timeout: `first` is late
                del waiting[first.ref]
                if first.blocking:
                    ray.kill(first.handle, no_restart=True)
                    late += 1
                else:
                    self.pending.append(first)
                continue
            entry = waiting.pop(done[0])
            again = self._settle_loading(entry, list(waiting.values()))
            if again is not None:
                waiting[again.ref] = again
        self.pending.extend(waiting.values())
        return late

    def _settle_loading(self, entry: _Loading, others: list[_Loading] = ()) -> _Loading | None:
        """An actor that answered `info()`: loaded (it fills its slot, or joins as a new
        worker), or dead while loading (returns its replacement, or None when the slot is
        given up). A load that failed raises ModelError, after killing every actor of the
        pool and `others`."""
        import ray

        try:
            info = ray.get(entry.ref)
        except ray.exceptions.RayError as e:
            if died_while_loading(e):
                return self._died_loading(entry, e)
            self._kill([entry.handle] + [o.handle for o in others])
            self.shutdown()
            raise ModelError(f"a worker could not load the model: {first_line(str(e))}") \
                from None
        if "load_error" in info:
            self._kill([entry.handle] + [o.handle for o in others])
            self.shutdown()
            raise ModelError(f"a worker could not load the model: {info['load_error']}")
        now = self.timeline.now()
        node = str(info.get("node_id", "?"))[:12]
        spans, rows = hold_limits(info, self.opts) if self.opts is not None else (2, None)
        if entry.slot is None:
            self.workers.append(WorkerSlot(entry.handle, info, ready_s=now, max_spans=spans,
                                           max_rows_held=rows))
            log(f"nanoserve: worker {len(self.workers) - 1} joined on node {node} (GPU ids "
                f"{info.get('gpu_ids')}); {self.num_alive()} worker(s) now")
            return None
        worker = self.workers[entry.slot]
        worker.new_actor()
        worker.handle, worker.info, worker.alive = entry.handle, info, True
        worker.max_spans, worker.max_rows_held = spans, rows
        if worker.ready_s is None:
            worker.ready_s = now
        if entry.deaths:
            log(f"nanoserve: worker {entry.slot} loaded the model on node {node} after "
                f"{entry.deaths} death(s) while loading; {self.num_alive()} worker(s) now")
        return None

    def _died_loading(self, entry: _Loading, error: Exception) -> _Loading | None:
        """An actor that died while loading: start a fresh one in its slot (a joining
        worker gets a slot now), not waited for while another worker is alive; or, after
        `max_load_deaths` deaths in a row, give the slot up (None)."""
        import ray

        ray.kill(entry.handle, no_restart=True)
        deaths = entry.deaths + 1
        slot = entry.slot
        who = f"worker {slot}"
        if slot is None:  # a slot of its own from now on: its restarts count, as any worker's
            self.workers.append(WorkerSlot(None, {}, alive=False))
            slot = len(self.workers) - 1
            who = f"a joining worker (worker {slot})"
        reason = death_reason(error)
        if deaths > self.max_load_deaths:
            self.given_up += 1
            self.gave_up = (f"{who} died {deaths} times in a row while loading the model "
                            f"(last: {reason})")
            log(f"nanoserve: {self.gave_up}; giving it up: {LOAD_DEATH_CAUSE} "
                f"({self.num_alive()} worker(s) left)")
            return None
        log(f"nanoserve: {who} died while loading the model ({reason}); replacing it "
            f"(restart {deaths} of at most {self.max_load_deaths})")
        self.workers[slot].restarts += 1
        return self._launch(slot, blocking=False, deaths=deaths)

    def none_left(self) -> str:
        """The job-level line when no worker is left."""
        if self.gave_up is not None:
            return (f"{self.gave_up}, and no worker is left: {LOAD_DEATH_CAUSE}; the job "
                    f"stopped (rerun it to resume)")
        return "no worker is left; the job stopped (rerun it to resume)"

    def replace(self, index: int) -> None:
        """Kill worker `index` (it died or failed) and start a fresh actor in its place,
        waiting for it to load (a replacement of that one, if it dies while loading, is
        waited for only while no other worker is alive). If the new one is not ready in
        time the slot is left dead (the job goes on with the others, or stops when none is
        left); a load failure is a ModelError."""
        import ray

        worker = self.workers[index]
        ray.kill(worker.handle, no_restart=True)
        worker.alive = False
        lost = node_lost(worker.info.get("node_id", ""), index) if "node_id" in worker.info \
            else None
        if lost is not None:  # nothing to restart there; `grow` may start one elsewhere
            self.nodes_lost.append(lost)
            log(f"nanoserve: {lost.describe()} was lost; its shards run again on the "
                f"other workers ({self.num_alive()} left)")
            return
        worker.restarts += 1
        if self._wait_loaded([self._launch(index, blocking=True)]):
            log(f"nanoserve: worker {index} died and its replacement was not ready within "
                 f"{self.timeout_s:g} s; going on without it")

    def grow(self) -> None:
        """Take in the pending actors that answered (loaded: they join the pool; dead while
        loading: replaced, see `_died_loading`), then, on GPUs (at most every GROW_POLL_S),
        start one pending actor per GPU the cluster has beyond the live and pending workers
        and the slots given up, up to `max_workers`. One that cannot load the model fails
        the job (ModelError)."""
        import ray

        if self.pending:
            refs = [e.ref for e in self.pending]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for entry in [e for e in self.pending if e.ref in done]:
                self.pending.remove(entry)
                self._adopt(entry)
        if not self.grows:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + GROW_POLL_S
        gpus = int(ray.cluster_resources().get("GPU", 0))
        target = gpus if self.max_workers is None else min(gpus, self.max_workers)
        for _ in range(target - self.num_alive() - len(self.pending) - self.given_up):
            self.pending.append(self._launch(None, blocking=False))

    def _adopt(self, entry: _Loading) -> None:
        """A pending actor that answered: it joins the pool, or is replaced (`grow`)."""
        again = self._settle_loading(entry)
        if again is not None:
            self.pending.append(again)

    def pick(self, alone: bool, prefix: tuple[int, ...] = ()) -> int | None:
        """The live worker with the fewest spans in flight that can take one more: `alone`,
        an idle one; else one below its `hold_limits` holding no suspect. Ties go to
        the worker whose last span began with the same `prefix` tokens (its prefix cache
        likely holds them), then to the lowest index. None if none can now;
        NanoserveError when none is alive (`none_left`)."""
        alive = [i for i, w in enumerate(self.workers) if w.alive]
        if not alive:
            raise NanoserveError(self.none_left())
        if alone:
            free = [i for i in alive if self.workers[i].in_flight == 0]
        else:
            free = [i for i in alive
                    if self.workers[i].can_take() and not self.workers[i].holds_suspect]
        return min(free, key=lambda i: (self.workers[i].in_flight,
                                        not prefix or self.workers[i].last_prefix != prefix,
                                        i)) if free else None

    def lost_nodes(self) -> tuple[str, ...]:
        """One line per node lost with workers on it, e.g. 'node 3f2a9c1e07b4 (10.0.0.7,
        workers 1, 2)', in the order they were found lost."""
        workers: dict[tuple[str, str], list[int]] = {}
        for lost in self.nodes_lost:
            workers.setdefault((lost.node_id, lost.address), []).append(lost.worker)
        return tuple(f"node {node[:12]} ({address}, worker{'s' if len(ws) > 1 else ''} "
                     f"{', '.join(map(str, ws))})" for (node, address), ws in workers.items())

    def num_alive(self) -> int:
        return sum(w.alive for w in self.workers)

    def reports(self) -> tuple[WorkerReport, ...]:
        return tuple(WorkerReport(i, tuple(w.info.get("gpu_ids", ())), w.info.get("device", "?"),
                                  w.info.get("host", "?"), w.spans, w.rows, w.restarts,
                                  w.ready_s, w.last_result_s, tuple(w.result_s),
                                  w.info.get("node_id", ""),
                                  up_s=w.engine_total("up_s"), busy_s=w.engine_total("busy_s"),
                                  decode_steps=int(w.engine_total("decode_steps")),
                                  decode_row_steps=int(w.engine_total("decode_row_steps")),
                                  max_rows=int(w.info.get("max_rows") or 0),
                                  load_s=dict(w.info.get("load_s") or {}))
                     for i, w in enumerate(self.workers))

    def shutdown(self) -> None:
        self._kill([w.handle for w in self.workers if w.handle is not None]
                   + [e.handle for e in self.pending])
        self.pending = []

    @staticmethod
    def _kill(handles: list[Any]) -> None:
        import ray

        for h in handles:
            ray.kill(h, no_restart=True)


def died_while_loading(error: Exception) -> bool:
    """Whether `error`, raised by Ray for an actor's first call, says the actor's process
    or node went away (it is replaced): ActorDiedError (unless its constructor raised) or
    ActorUnavailableError, NodeDiedError, WorkerCrashedError, LocalRayletDiedError, or
    Ray's OutOfMemoryError (its memory monitor killed the process). Otherwise the load
    failed: a RayTaskError (the constructor or `info()` raised), a runtime environment
    that could not be set up, ..."""
    import ray

    exc = ray.exceptions
    if isinstance(error, exc.RayTaskError):
        return False
    if isinstance(error, exc.RayActorError):
        return not error.actor_init_failed
    return isinstance(error, (exc.NodeDiedError, exc.WorkerCrashedError,
                              exc.LocalRayletDiedError, exc.OutOfMemoryError))


def death_reason(error: Exception) -> str:
    """Ray's reason for a death in a few words ('its worker process has died', 'its node
    has died'), else the first line of its message."""
    for line in str(error).splitlines():
        match = re.search(r"\bbecause (its [^.]+)", line)
        if match:
            return match.group(1).strip()
    return first_line(str(error))


def ready_line(infos: list[dict[str, Any]]) -> str:
    """One progress line for the workers that loaded: their batching, how their decode
    steps run (CUDA graphs, their memory and capture time, or why not) and their KV pool.
    Values are the first worker's; workers whose graphs failed are counted."""
    first = infos[0]
    parts = [f"{first.get('scheduler', 'static')} batching"
             + (f" of up to {first['max_rows']:,} rows" if first.get("max_rows") else "")]
    steps = first.get("steps")
    if steps:
        captured = [i for i in infos if (i.get("steps") or {}).get("graphs")]
        if captured:
            s = captured[0]["steps"]
            parts.append(f"decode steps as {s['graphs']} CUDA graphs a worker "
                         f"({s['graph_mib']:,.0f} MiB, captured in {s['capture_s']:.1f} s)")
            if s.get("prefill_graphs"):
                parts.append(f"{s['prefill_graphs']} prefill graphs (captured in "
                             f"{s.get('prefill_capture_s', 0):.1f} s)")
        failed = [i["steps"]["capture_error"] for i in infos
                  if (i.get("steps") or {}).get("capture_error")]
        if failed:
            parts.append(f"CUDA graphs not captured on {len(failed)} of {len(infos)} "
                         f"worker(s) ({failed[0]}): their decode steps run uncaptured, slower")
    if "kv_blocks" in first and "block_size" in first:
        parts.append(f"KV pool {first['kv_blocks'] * first['block_size']:,} tokens a worker")
    return f"nanoserve: {len(infos)} worker(s) ready: " + "; ".join(parts)


def log(message: str) -> None:
    """One line on stderr that does not break the progress bar."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


__all__ = ["HOLD_FACTOR", "WorkerPool", "WorkerReport", "WorkerSlot",
           "actor_threads", "death_reason", "died_while_loading", "first_line", "hold_limits",
           "log", "ready_line", "starve_warning"]
