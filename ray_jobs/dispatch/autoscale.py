"""A job on a cluster whose nodes come and go: how many workers it wants (`WorkerRange`,
from `--num-workers N | MIN-MAX | auto`), waiting for the cluster's first GPUs
(`wait_for_gpus`), and telling a node that was lost from a worker process that died
(`node_lost`, `LostNode`).

Stage 2, dispatch of the job pipeline (docs/modules.md).

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

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nanoserve.errors import NanoserveError

GROW_POLL_S = 2.0  # how often a job that can grow asks the cluster for its GPUs
RAYLET_PROBE_TIMEOUT_S = 3.0  # a raylet that does not accept a connection in this is gone
WAIT_POLL_S = 1.0  # how often a job waiting for its first GPUs asks again


@dataclass(frozen=True)
class WorkerRange:
    """`--num-workers`: `low` workers at least, `high` at most (None: every GPU the cluster
    has or gains). `grows`: a range or `auto`, which starts with the GPUs present (waiting
    for `low` of them) and takes each GPU that joins later, up to `high`; else a plain
    number, as many workers as that (capped to the cluster, on its GPUs or else its CPUs)."""

    low: int
    high: int | None
    grows: bool

    def describe(self) -> str:
        if not self.grows:
            return str(self.low)
        return "auto" if self.high is None and self.low == 1 else \
            f"{self.low}-{'' if self.high is None else self.high}"


def parse_num_workers(value: int | str | None) -> WorkerRange | None:
    """None (one worker per GPU of the cluster, 1 without GPUs), a number, 'MIN-MAX', or
    'auto' (= '1-': every GPU the cluster has or gains). NanoserveError otherwise."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == "auto":
        return WorkerRange(1, None, True)
    if re.fullmatch(r"-?\d+", text):
        n = int(text)
        if n < 1:
            raise NanoserveError(f"num_workers must be >= 1, got {n}")
        return WorkerRange(n, n, False)
    match = re.fullmatch(r"(\d+)-(\d*)", text)
    if match is None:
        raise NanoserveError(f"num_workers must be a number, MIN-MAX or auto, got {value!r}")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) else None
    if low < 1 or (high is not None and high < low):
        raise NanoserveError(f"num_workers range must have 1 <= MIN <= MAX, got {value!r}")
    return WorkerRange(low, high, True)


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


__all__ = ["GROW_POLL_S", "LostNode", "WorkerRange", "cluster_gpus", "node_lost",
           "parse_num_workers", "wait_for_gpus"]
