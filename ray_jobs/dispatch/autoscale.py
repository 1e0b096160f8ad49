"""Stage dispatch: a job on a cluster whose nodes come and go. Waiting for the cluster's
first GPUs (`wait_for_gpus`, for the workers `--num-workers N | MIN-MAX | auto` asks for: a
`ray_jobs.workers.options.WorkerRange`), and telling a node that was lost from a worker
process that died (`node_lost`, `LostNode`).

Growing the pool as GPUs join is `WorkerPool.grow` (ray_jobs.dispatch.pool), which uses these.

Invariants:
- a range or `auto` asks for GPU workers only: a cluster without GPUs is waited on (with a
  message) up to the stated timeout and then refused, never run on the CPU silently;
- a node is lost when Ray's control store (GCS) marks it dead, or when its raylet, the
  node's own Ray process, no longer accepts a connection: the GCS notices a dead node only
  after its health checks fail (seconds to a minute), while the raylet's socket closes the
  moment the node goes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoserve import NanoserveError
from ray_jobs.workers.options import WorkerRange

GROW_POLL_S = 2.0  # how often a job that can grow asks the cluster for its GPUs
RAYLET_PROBE_TIMEOUT_S = 3.0  # a raylet that does not accept a connection in this is gone
WAIT_POLL_S = 1.0  # how often a job waiting for its first GPUs asks again


def cluster_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def wait_for_gpus(wanted: WorkerRange, timeout_s: float,
                  log: Callable[[str], None]) -> int:
    """The cluster's GPU count once it has at least `wanted.low` (at once if it has them
    now). Otherwise say so in one line and ask again every WAIT_POLL_S, up to `timeout_s`;
    then NanoserveError: a job that asked for GPU workers never runs on the CPU instead."""
    gpus = cluster_gpus()
    if gpus >= wanted.low:
        return gpus
    log(f"nanoserve: --num-workers {wanted.describe()} needs {wanted.low} GPU(s); the cluster "
        f"has {gpus}; waiting up to {timeout_s:g} s for GPU nodes to join")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(min(WAIT_POLL_S, max(0.0, deadline - time.monotonic())))
        gpus = cluster_gpus()
        if gpus >= wanted.low:
            log(f"nanoserve: the cluster has {gpus} GPU(s) now; starting")
            return gpus
    raise NanoserveError(
        f"--num-workers {wanted.describe()}: the cluster had {gpus} GPU(s), fewer than "
        f"{wanted.low}, after waiting {timeout_s:g} s; no GPU node joined (start one, or give "
        f"a number of workers to run on what the cluster has)")


@dataclass(frozen=True)
class LostNode:
    """A node that went away while one of the job's workers ran on it."""

    node_id: str  # Ray's hex node id
    address: str  # the node's IP address, as Ray knows it
    worker: int  # the job's worker index that ran there

    def describe(self) -> str:
        return f"node {self.node_id[:12]} ({self.address}, worker {self.worker})"


def node_lost(node_id: str, worker: int) -> LostNode | None:
    """A `LostNode` if the node `node_id` is gone (see the module docstring), else None."""
    import ray

    for node in ray.nodes():
        if node.get("NodeID") != node_id:
            continue
        address = str(node.get("NodeManagerAddress", "?"))
        if node.get("Alive") and _raylet_answers(address, node.get("NodeManagerPort")):
            return None
        return LostNode(node_id, address, worker)
    return LostNode(node_id, "?", worker)  # the cluster no longer knows it


def _raylet_answers(address: str, port: Any) -> bool:
    if not port:
        return True  # nothing to probe: trust the GCS
    try:
        with socket.create_connection((address, int(port)), timeout=RAYLET_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


__all__ = ["GROW_POLL_S", "LostNode", "cluster_gpus", "node_lost", "wait_for_gpus"]
