"""The batch job on a real multi-node Ray cluster on this machine: run by
tests/test_multinode.py in a process of its own (a driver joins one Ray only, and the
tests' session Ray is another), with one `ray.cluster_utils.Cluster` for every scenario.

    python tests/multinode_cluster.py MODEL_DIR RESULTS_DIR

The head node has no GPU; each worker node is started with its own logical GPUs
(`num_gpus`, no CUDA: its workers run on the CPU) and added or removed per scenario. A node
is removed the way a node is lost: its raylet and workers SIGKILLed
(`Cluster.remove_node(allow_graceful=False)`). Where a scenario needs batches in flight when
a node leaves or joins, the workers hold them with the worker's testing hook
`NANOSERVE_FAULT_HOLD_WHILE_FILE` until the scenario deletes that file; where a node must
leave while workers load the model, they wait in their constructor on
`NANOSERVE_FAULT_HOLD_LOAD_WHILE_FILE`, which also names their pids and nodes.

For each scenario NAME it writes RESULTS_DIR/NAME/in.jsonl (the input), NAME/out (the job's
output folder) and NAME/result.json: the summary (workers with their node ids, nodes lost,
`format()`), the job's stderr lines, the cluster's node ids and, for a job that failed,
its error. The test checks the rows against the engine itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

RAY_TMP = tempfile.mkdtemp(prefix="ns-mn-")  # short: socket paths stay < 108 chars
# Private to this cluster: Ray writes the address of the cluster it starts under
# RAY_TMPDIR, where no other Ray user on the machine would find and join it.
os.environ["RAY_TMPDIR"] = RAY_TMP
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node on 127.0.0.1 only
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import ray_jobs.dispatch.job_run as job_run  # noqa: E402
import ray_jobs.dispatch.pool as pool  # noqa: E402
from ray_jobs import run_batch_job  # noqa: E402

MAX_TOKENS = 3
NODE = {"node_ip_address": "127.0.0.1", "include_dashboard": False,
        "object_store_memory": 80 << 20}
HOLD = "NANOSERVE_FAULT_HOLD_WHILE_FILE"
HOLD_LOAD = "NANOSERVE_FAULT_HOLD_LOAD_WHILE_FILE"
HOLD_LIMIT_S = 120  # a safety valve only: batches held longer are let go (see node_added)
WORKER_START_S = 60  # as --worker-start-timeout: a replacement that is never placed is given up
# The GCS marks a node dead after its health checks fail: by default after about half a
# minute, here after a few seconds, so that the scenarios after a removal start sooner (the
# job itself does not wait for it: it probes the lost node's raylet).
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                 "health_check_failure_threshold": 3}


def gpu_node(cluster: Cluster, gpus: int):
    return cluster.add_node(num_cpus=gpus, num_gpus=gpus, **NODE)


class Scenario:
    """One job on the cluster: its input, output folder and what it reported."""

    def __init__(self, root: Path, name: str, rows: int) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.input = self.dir / "in.jsonl"
        self.input.write_text("".join(
            json.dumps({"prompt": f"Row {i}: the {w} fox jumps over {i * 7} lazy dogs"}) + "\n"
            for i, w in zip(range(rows), ["quick", "slow", "red", "blue", "tall", "small",
                                          "old", "new", "calm", "loud", "shy", "bold"] * 4)))
        self.hold = self.dir / "hold"  # workers wait while it exists
        self.record: dict = {"nodes": {}}

    def run(self, **options) -> None:
        # Two batches held a worker (the scenarios count them), not the engine-sized depth.
        options = {"model": MODEL, "max_tokens": MAX_TOKENS, "batch_size": 2,
                   "max_in_flight_per_worker": 2, "kv_cache_bytes": 32 << 20,
                   "progress": False, **options}
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                summary = run_batch_job(self.input, self.dir / "out", **options)
            self.record["summary"] = {
                "workers": [dataclasses.asdict(w) for w in summary.workers],
                "nodes_lost": list(summary.nodes_lost), "rows": summary.rows,
                "error_rows": summary.error_rows, "format": summary.format()}
        except Exception as e:  # the test reads it
            self.record["error"] = f"{type(e).__name__}: {e}"
            self.record["traceback"] = traceback.format_exc()
        finally:
            self.record["stderr"] = err.getvalue().splitlines()
            (self.dir / "result.json").write_text(json.dumps(self.record, indent=1))

    def hold_batches(self) -> None:
        self.hold.write_text("held")
        os.environ[HOLD] = str(self.hold)

    def release_batches(self) -> None:
        self.hold.unlink(missing_ok=True)
        os.environ.pop(HOLD, None)

    def hold_loads(self, now: bool = True) -> None:
        """Workers started from now on wait in their constructor while `hold_load` exists
        (created now, or later with `now=False`)."""
        self.hold_load = self.dir / "hold-load"
        if now:
            self.hold_load.write_text("held")
        os.environ[HOLD_LOAD] = str(self.hold_load)

    def loading(self, n: int, timeout_s: float = 120.0) -> list[tuple[int, str]]:
        """(pid, node id) of the first `n` workers held in their constructor."""
        path = Path(f"{self.hold_load}.holding")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = path.read_text().splitlines() if path.exists() else []
            if len(lines) >= n:
                return [(int(pid), node) for pid, node in (ln.split() for ln in lines[:n])]
            time.sleep(0.05)
        raise RuntimeError(f"fewer than {n} workers reached the load hold in {timeout_s:g} s")

    def release_loads(self) -> None:
        self.hold_load.unlink(missing_ok=True)
        os.environ.pop(HOLD_LOAD, None)


@contextlib.contextmanager
def patched(obj, name, make):
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Wait until none of these processes is alive (a killed node's actors die as their
    raylet's socket closes, a moment after the raylet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the removed node's worker processes {pids} are still alive")


def remove_node_of_worker_when(cluster, scenario, workers_full):
    """Patch the driver's `_submit`: once `workers_full(pool)` holds after a submission,
    remove (kill) the node whose workers hold the most spans in flight (ties: the last
    such node), then let the held batches go."""
    def make(original):
        def submit(self, span, index):
            original(self, span, index)
            if "removed" in scenario.record or not workers_full(self.pool):
                return
            held: dict[str, int] = {}
            for w in self.pool.workers:
                held[w.info["node_id"]] = held.get(w.info["node_id"], 0) + w.in_flight
            node_id = max(reversed(list(held)), key=held.__getitem__)
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            scenario.record["removed"] = {
                "node_id": node_id,
                "in_flight": {i: w.in_flight for i, w in enumerate(self.pool.workers)},
                "workers_there": [i for i, w in enumerate(self.pool.workers)
                                  if w.info["node_id"] == node_id]}
            pids = [w.info["pid"] for w in self.pool.workers if w.info["node_id"] == node_id]
            cluster.remove_node(node, allow_graceful=False)
            _wait_gone(pids)  # else a held batch may finish before its process dies
            scenario.release_batches()
        return submit
    return make


def remove_node_while_loading(cluster, scenario, holding: int):
    """In a thread: once `holding` workers wait in their constructor, kill the node of the
    last of them (raylet and workers), then let the loads go (also on failure)."""
    def remove():
        try:
            pid, node_id = scenario.loading(holding)[-1]
            node = next(n for n in cluster.worker_nodes if n.node_id == node_id)
            scenario.record["removed"] = {"node_id": node_id, "pid": pid}
            cluster.remove_node(node, allow_graceful=False)
            _wait_gone([pid])
        except Exception:  # the scenario's record says so; the test fails on it
            scenario.record["remover_error"] = traceback.format_exc()
        finally:
            scenario.release_loads()
    thread = threading.Thread(target=remove, daemon=True)
    thread.start()
    return thread


def main(model: str, results: Path) -> None:
    global MODEL
    MODEL = model
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={"num_cpus": 1, "_system_config": HEALTH_CHECKS, **NODE})
    try:
        a, b = gpu_node(cluster, 1), gpu_node(cluster, 1)

        # A job spread over two worker nodes, one GPU each.
        s = Scenario(results, "spread", 8)
        s.record["nodes"] = {"a": a.node_id, "b": b.node_id}
        s.run(num_workers=2)

        # A node lost mid-job: each worker holds two batches; the node of one is killed.
        s = Scenario(results, "node_lost", 8)
        s.record["nodes"] = {"a": a.node_id, "b": b.node_id}
        s.hold_batches()
        full = lambda p: all(w.in_flight == 2 for w in p.workers)  # noqa: E731
        with patched(job_run._JobRun, "_submit", remove_node_of_worker_when(cluster, s, full)):
            s.run(num_workers=2, worker_start_timeout_s=WORKER_START_S)
        s.release_batches()

        # The lost node held the most batches: two GPUs (4 in flight) against one (2).
        cluster.wait_for_nodes(timeout=120)  # the GCS knows B is gone
        (survivor,) = cluster.worker_nodes  # A or B, whichever was not removed
        c = gpu_node(cluster, 2)
        s = Scenario(results, "busiest_node_lost", 16)
        s.record["nodes"] = {"first": survivor.node_id, "c": c.node_id}
        s.hold_batches()
        with patched(job_run._JobRun, "_submit", remove_node_of_worker_when(cluster, s, full)):
            s.run(num_workers=3, worker_start_timeout_s=WORKER_START_S)
        s.release_batches()

        # A node added: the job starts on the one GPU node left (1-2 workers) and takes
        # D's GPU once D joins. D is added at the first submission, while the first node's
        # batches are held; they go once D's worker is in the pool, so D's worker is idle
        # when the next batch is sent. (If it never joins, they go after HOLD_LIMIT_S and
        # the test fails on its rows' workers rather than waiting forever.)
        cluster.wait_for_nodes(timeout=120)  # ... and C
        s = Scenario(results, "node_added", 8)
        s.hold_batches()

        def add_at_first_submit(original):
            def submit(self, span, index):
                original(self, span, index)
                if self.sent == 1:
                    s.record["nodes"] = {"first": survivor.node_id,
                                         "d": gpu_node(cluster, 1).node_id}
                    valve = threading.Timer(HOLD_LIMIT_S, s.release_batches)
                    valve.daemon = True
                    valve.start()
            return submit

        def release_on_adopt(original):
            def adopt(self, entry):
                original(self, entry)
                s.release_batches()
            return adopt

        with patched(job_run._JobRun, "_submit", add_at_first_submit), \
                patched(pool.WorkerPool, "_adopt", release_on_adopt):
            s.run(num_workers="1-2")
        s.release_batches()

        # A node lost while its worker loads the model: two one-GPU nodes, both workers held
        # in their constructor; one node is killed. Its worker is replaced (the replacement
        # waits for a GPU and holds nothing up); the job runs on the other.
        cluster.wait_for_nodes(timeout=120)
        s = Scenario(results, "node_lost_while_loading", 8)
        s.record["nodes"] = {n.node_id[:12]: n.node_id for n in cluster.worker_nodes}
        s.hold_loads()
        remover = remove_node_while_loading(cluster, s, 2)
        s.run(num_workers=2, worker_start_timeout_s=WORKER_START_S)
        remover.join(timeout=HOLD_LIMIT_S)
        s.release_loads()
        (s.dir / "result.json").write_text(json.dumps(s.record, indent=1))  # + the remover's

        # A joining worker's node lost while it loads: `--num-workers 1-2` starts on the one
        # GPU node left; a second joins at the first submission, with batches held, and its
        # worker is held in its constructor; that node is killed. The joining worker is
        # replaced (it waits for a GPU); the batches go once the driver has said so.
        cluster.wait_for_nodes(timeout=120)
        s = Scenario(results, "joiner_lost_while_loading", 8)
        (first,) = cluster.worker_nodes
        s.hold_batches()
        s.hold_loads(now=False)
        removers = []

        def add_node_at_first_submit(original):
            def submit(self, span, index):
                original(self, span, index)
                if self.sent == 1:
                    s.hold_load.write_text("held")
                    s.record["nodes"] = {"first": first.node_id,
                                         "joined": gpu_node(cluster, 1).node_id}
                    removers.append(remove_node_while_loading(cluster, s, 1))
                    valve = threading.Timer(HOLD_LIMIT_S, s.release_batches)
                    valve.daemon = True
                    valve.start()
            return submit

        def release_on_load_death(original):
            def log(message):
                original(message)
                if "died while loading" in message:
                    s.release_batches()
            return log

        with patched(job_run._JobRun, "_submit", add_node_at_first_submit), \
                patched(pool, "log", release_on_load_death):
            s.run(num_workers="1-2", worker_start_timeout_s=WORKER_START_S)
        for remover in removers:
            remover.join(timeout=HOLD_LIMIT_S)
        s.release_batches()
        s.release_loads()
        (s.dir / "result.json").write_text(json.dumps(s.record, indent=1))  # + the remover's

        # No GPU node at the start: `auto` waits for one, then fails after its timeout.
        for node in list(cluster.worker_nodes):
            cluster.remove_node(node)
        cluster.wait_for_nodes(timeout=120)
        s = Scenario(results, "no_gpu_timeout", 2)
        s.run(num_workers="auto", worker_start_timeout_s=3)

        # ... or runs on the GPU node that joins while it waits.
        s = Scenario(results, "gpu_joins_while_waiting", 2)

        def add_when_waiting(original):
            def log(message):
                original(message)
                if "waiting up to" in message:
                    s.record["nodes"] = {"e": gpu_node(cluster, 1).node_id}
            return log

        with patched(pool, "log", add_when_waiting):
            s.run(num_workers="auto", worker_start_timeout_s=300)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(RAY_TMP, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
