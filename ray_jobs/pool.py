"""The job's workers: one `BatchWorker` actor per GPU (or CPU actors without GPUs), how
they are started and replaced, which one takes the next piece of work, and what each did
(`WorkerReport`).

The pool never lets Ray restart an actor or retry a task behind the driver's back
(max_restarts=0, max_task_retries=0): the driver alone decides what runs again.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.errors import ModelError, NanoserveError
from ray_jobs.autoscale import GROW_POLL_S, LostNode, node_lost, parse_num_workers, wait_for_gpus
from ray_jobs.worker import FAULT_ENV_PREFIX, BatchWorker

if TYPE_CHECKING:
    from ray_jobs.options import JobOptions
    from ray_jobs.timeline import Timeline


@dataclass(frozen=True)
class WorkerReport:
    index: int
    gpu_ids: tuple
    device: str
    host: str
    batches: int  # batches (or pieces of batches) this worker generated in this run
    rows: int
    restarts: int = 0  # times it died and was replaced by a fresh actor
    ready_s: float | None = None  # seconds from the job's start to its first actor's model loaded
    last_result_s: float | None = None  # seconds from the job's start to its last result
    result_s: tuple[float, ...] = ()  # seconds from the job's start to each of its results
    node_id: str = ""  # the Ray node its (last) actor ran on


class RayBatchWorker(BatchWorker):
    """The actor form of `BatchWorker`: a model that fails to load is reported by `info()`
    as a message (a clean job-level error) rather than as a crashed actor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.load_error: str | None = None
        try:
            super().__init__(*args, **kwargs)
        except NanoserveError as e:
            self.load_error = str(e)
        except Exception as e:  # torch, CUDA, files: whatever stops the model loading here
            self.load_error = f"{type(e).__name__}: {first_line(str(e))}"

    def info(self) -> dict[str, Any]:
        import ray

        if self.load_error is not None:
            return {"load_error": self.load_error}
        return {**super().info(), "node_id": ray.get_runtime_context().get_node_id()}


@dataclass
class WorkerSlot:
    handle: Any
    info: dict[str, Any]
    in_flight: int = 0
    batches: int = 0  # pieces of batches this slot generated (a whole batch is one piece)
    rows: int = 0
    restarts: int = 0  # times the actor died and was replaced
    ready_s: float | None = None  # seconds from the job's start to the first actor ready
    last_result_s: float | None = None  # seconds from the job's start to its last result
    result_s: list[float] = field(default_factory=list)  # ... to each of its results
    alive: bool = True
    holds_suspect: bool = False  # running a suspect piece, which it runs alone
    last_prefix: tuple[int, ...] = ()  # the leading tokens of the last piece sent to it


class WorkerPool:
    """The job's actors: one per GPU (num_gpus=1), or CPU actors (num_cpus=1) when the
    cluster has no GPUs. `start` returns when every model is loaded; a worker that dies is
    replaced by a fresh actor (`replace`), never restarted by Ray behind the driver's back
    (max_restarts=0, max_task_retries=0: the driver alone decides what runs again).

    No wait is unbounded: an actor not ready within `worker_start_timeout_s` (the cluster
    has no room for it, or the model loads too slowly) is given up; a worker that cannot
    load the model fails the job with one line (ModelError).

    Nodes come and go (ray_jobs.autoscale): a worker whose node is lost is not replaced
    on the spot (`replace`; the driver sends its batches to the others); on GPUs the pool
    then asks the cluster every `poll_s` for GPUs beyond its workers (`grow`): up to
    `--num-workers`' MAX for a range or `auto`, up to the number started for a plain number
    (so a lost worker comes back when a GPU is free or a node joins). A started actor is
    `pending` until its model is loaded, and joins the pool then; it holds no work before."""

    def __init__(self, actor_cls: Any, kwargs: dict[str, Any], timeout_s: float,
                 timeline: Timeline) -> None:
        self.actor_cls = actor_cls
        self.kwargs = kwargs
        self.timeout_s = timeout_s
        self.timeline = timeline
        self.workers: list[WorkerSlot] = []
        self.poll_s: float | None = None  # None: the pool never grows (CPU workers)
        self.max_workers: int | None = None  # grow up to this many live workers (None: all GPUs)
        self.pending: list[tuple[Any, Any]] = []  # (actor, its info() ref) still loading
        self.nodes_lost: list[LostNode] = []
        self._next_check = 0.0

    @classmethod
    def start(cls, opts: JobOptions, timeline: Timeline) -> WorkerPool:
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
        fault_env = {k: v for k, v in os.environ.items() if k.startswith(FAULT_ENV_PREFIX)}
        if fault_env:  # testing hooks (see ray_jobs.worker), forwarded to the actors
            actor_options["runtime_env"] = {"env_vars": fault_env}
        # Threaded actor: a worker holds up to max_in_flight_per_worker batches at once, so
        # its engine (continuous scheduler) admits the next batch's rows as the current
        # batch's rows finish. A static engine still runs one batch at a time (a lock).
        actor_cls = ray.remote(RayBatchWorker).options(
            max_restarts=0, max_task_retries=0,
            max_concurrency=max(1, opts.max_in_flight_per_worker), **actor_options)
        kwargs = {"model": opts.model, "dtype": opts.dtype,
                  "kv_cache_fraction": opts.kv_cache_fraction,
                  "kv_cache_bytes": opts.kv_cache_bytes, "num_threads": num_threads,
                  "scheduler": opts.scheduler, "prefix_caching": opts.prefix_caching}
        pool = cls(actor_cls, kwargs, opts.worker_start_timeout_s, timeline)
        if opts.progress:
            where = f"{num_gpus} GPU(s)" if num_gpus else "CPU"
            log(f"nanoserve: starting {count} worker(s) on {where}, loading {opts.model}")
        handles = [actor_cls.remote(**kwargs) for _ in range(count)]
        if wanted is not None and wanted.grows and count > wanted.low:
            # Go as soon as MIN are ready; the others join when loaded (`grow`), so a GPU
            # the cluster lists but cannot place on (a node lost, not yet noticed) holds
            # nothing up.
            pool.pending = [(h, h.info.remote()) for h in handles[wanted.low:]]
            handles = handles[:wanted.low]
        ready = pool._wait_ready(handles)
        late = [h for h, r in zip(handles, ready) if r is None]
        for h in late:
            ray.kill(h, no_restart=True)
        for h, r in zip(handles, ready):
            if r is not None:
                pool.workers.append(WorkerSlot(h, r[0], ready_s=r[1]))
        if not pool.workers:
            raise NanoserveError(
                f"no worker was ready within {opts.worker_start_timeout_s:g} s: the cluster has "
                f"no free {unit} for one, or the model loads more slowly than that"
            )
        if opts.progress and pool.workers:
            log(ready_line([w.info for w in pool.workers]))
        if late:
            log(f"nanoserve: {len(late)} of {count} workers were not ready within "
                 f"{opts.worker_start_timeout_s:g} s (no free {unit}?); going on with "
                 f"{len(pool.workers)}")
        if num_gpus:
            pool.poll_s = GROW_POLL_S
            pool.max_workers = wanted.high if wanted is not None and wanted.grows else count
        return pool

    def _wait_ready(self, handles: list[Any]) -> list[tuple[dict[str, Any], float] | None]:
        """Each actor's `info()` once its model is loaded, with when that was (seconds from
        the job's start); None for one not ready within the timeout. Answers are taken as
        they come: the first worker that cannot load the model raises ModelError at once
        (after killing these actors), without waiting for the others or the timeout."""
        import ray

        refs = [h.info.remote() for h in handles]
        ready: dict[Any, tuple[dict[str, Any], float]] = {}
        deadline = time.monotonic() + self.timeout_s
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=1,
                                     timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break  # the timeout: the rest are late
            try:
                info = ray.get(done[0])
            except ray.exceptions.RayError as e:
                self._kill(handles)
                raise ModelError(f"a worker died while loading the model: "
                                 f"{first_line(str(e))}") from None
            if "load_error" in info:
                self._kill(handles)
                raise ModelError(f"a worker could not load the model: {info['load_error']}")
            ready[done[0]] = (info, self.timeline.now())
        return [ready.get(ref) for ref in refs]

    def replace(self, index: int) -> None:
        """Kill worker `index` (it died or failed) and start a fresh actor in its place.
        If the new one is not ready in time the slot is left dead (the job goes on with
        the others, or stops when none is left); a load failure is a ModelError."""
        import ray

        worker = self.workers[index]
        ray.kill(worker.handle, no_restart=True)
        lost = node_lost(worker.info.get("node_id", ""), index) if "node_id" in worker.info \
            else None
        if lost is not None:  # nothing to restart there; `grow` may start one elsewhere
            worker.alive = False
            self.nodes_lost.append(lost)
            log(f"nanoserve: {lost.describe()} was lost; its batches run again on the "
                f"other workers ({self.num_alive()} left)")
            return
        handle = self.actor_cls.remote(**self.kwargs)
        (ready,) = self._wait_ready([handle])
        worker.restarts += 1
        if ready is None:
            ray.kill(handle, no_restart=True)
            worker.alive = False
            log(f"nanoserve: worker {index} died and its replacement was not ready within "
                 f"{self.timeout_s:g} s; going on without it")
            return
        worker.handle, worker.info = handle, ready[0]

    def grow(self) -> None:
        """Take in the pending actors whose model is loaded, then (at most every `poll_s`)
        start one pending actor per GPU the cluster has beyond the live and pending
        workers, up to `max_workers`. A pending actor that dies (its node lost while it
        loaded) is dropped; one that cannot load the model fails the job (ModelError)."""
        import ray

        if self.poll_s is None:
            return
        if self.pending:
            refs = [ref for _, ref in self.pending]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for handle, ref in [p for p in self.pending if p[1] in done]:
                self.pending.remove((handle, ref))
                self._adopt(handle, ref)
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.poll_s
        gpus = int(ray.cluster_resources().get("GPU", 0))
        target = gpus if self.max_workers is None else min(gpus, self.max_workers)
        for _ in range(target - self.num_alive() - len(self.pending)):
            handle = self.actor_cls.remote(**self.kwargs)
            self.pending.append((handle, handle.info.remote()))

    def _adopt(self, handle: Any, ref: Any) -> None:
        import ray

        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as e:
            ray.kill(handle, no_restart=True)
            log(f"nanoserve: a joining worker died while loading the model "
                f"({first_line(str(e))}); going on without it")
            return
        if "load_error" in info:
            self.shutdown()
            raise ModelError(f"a worker could not load the model: {info['load_error']}")
        self.workers.append(WorkerSlot(handle, info, ready_s=self.timeline.now()))
        log(f"nanoserve: worker {len(self.workers) - 1} joined on node "
            f"{str(info.get('node_id', '?'))[:12]} (GPU ids {info.get('gpu_ids')}); "
            f"{self.num_alive()} worker(s) now")

    def pick(self, alone: bool, limit: int, prefix: tuple[int, ...] = ()) -> int | None:
        """The live worker with the fewest pieces in flight that can take one more: `alone`,
        an idle one; else one holding fewer than `limit` pieces and no suspect. Ties go to
        the worker whose last piece began with the same `prefix` tokens (its prefix cache
        likely holds them), then to the lowest index. None if none can now;
        NanoserveError when none is alive."""
        alive = [i for i, w in enumerate(self.workers) if w.alive]
        if not alive:
            raise NanoserveError("no worker is left; the job stopped (rerun it to resume)")
        if alone:
            free = [i for i in alive if self.workers[i].in_flight == 0]
        else:
            free = [i for i in alive
                    if self.workers[i].in_flight < limit and not self.workers[i].holds_suspect]
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
                                  w.info.get("host", "?"), w.batches, w.rows, w.restarts,
                                  w.ready_s, w.last_result_s, tuple(w.result_s),
                                  w.info.get("node_id", ""))
                     for i, w in enumerate(self.workers))

    def shutdown(self) -> None:
        self._kill([w.handle for w in self.workers] + [h for h, _ in self.pending])
        self.pending = []

    @staticmethod
    def _kill(handles: list[Any]) -> None:
        import ray

        for h in handles:
            ray.kill(h, no_restart=True)


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else text


def ready_line(infos: list[dict[str, Any]]) -> str:
    """One progress line for the workers that loaded: their batching, how their decode
    steps run (CUDA graphs, their memory and capture time, or why not) and their KV pool.
    Values are the first worker's; workers whose graphs failed are counted."""
    first = infos[0]
    parts = [f"{first.get('scheduler', 'static')} batching"]
    steps = first.get("steps")
    if steps:
        captured = [i for i in infos if (i.get("steps") or {}).get("graphs")]
        if captured:
            s = captured[0]["steps"]
            parts.append(f"decode steps as {s['graphs']} CUDA graphs a worker "
                         f"({s['graph_mib']:,.0f} MiB, captured in {s['capture_s']:.1f} s)")
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


__all__ = ["RayBatchWorker", "WorkerPool", "WorkerReport", "WorkerSlot", "first_line", "log",
           "ready_line"]
