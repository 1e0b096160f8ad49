"""Stage dispatch: which Ray a job runs on, a cluster it joins or a private single-machine
Ray it starts and stops itself (`RaySession`); `start_local_ray` / `stop_local_ray` for
that private Ray.

A private Ray lives in its own temp folder (`/tmp/ns-ray-*`, short so Ray's socket paths
stay under 108 characters) and listens on 127.0.0.1 only, with no dashboard. The folder
names its owner (`OWNER_FILE`: the driver's pid and process start time); a driver killed
before it could remove its folder leaves it behind, and the next private Ray started on the
machine removes every such folder whose owner process is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from nanoserve.errors import NanoserveError
from ray_jobs.input.storage import process_alive, process_start_time


class RaySession:
    """Join the Ray cluster the job should use, or start a private local one.

    Order: an already initialized Ray (kept as it is); `address` (or RAY_ADDRESS); a running
    cluster started with `ray start` on this machine; else a private local Ray
    (`start_local_ray`). `address="local"` always starts the private local Ray."""

    def __init__(self, address: str | None) -> None:
        self.address = address
        self.owned = False
        self.temp_dir: str | None = None

    def __enter__(self) -> RaySession:
        import ray

        if ray.is_initialized():
            return self
        address = self.address or os.environ.get("RAY_ADDRESS") or None
        if address is None and _running_cluster_address() is not None:
            address = "auto"
        if address not in (None, "local"):
            try:
                ray.init(address=address, logging_level=logging.WARNING)
                self.owned = True
                return self
            except ConnectionError as e:
                if self.address or os.environ.get("RAY_ADDRESS"):
                    raise NanoserveError(f"cannot connect to Ray at {address}: {e}") from None
                print(f"nanoserve: no running Ray cluster ({e}); starting a local one",
                      file=sys.stderr)
        self.temp_dir = start_local_ray()
        self.owned = True
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        if self.temp_dir is not None:
            stop_local_ray(self.temp_dir)
        elif self.owned:
            ray.shutdown()


SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray on 127.0.0.1 only
TEMP_PREFIX = "ns-ray-"  # short: socket paths stay < 108 chars
OWNER_FILE = "nanoserve-owner"  # "<pid> <process start time>" of the driver that made the folder
OMP_WAIT_POLICY_ENV = "OMP_WAIT_POLICY"  # read by OpenMP when a process loads it


def start_local_ray(num_cpus: int | None = None, num_gpus: int | None = None,
                    object_store_memory: int | None = None) -> str:
    """Start a private single-machine Ray in this process and return its temp dir (the
    caller removes it after `ray.shutdown()`).

    Every Ray process listens on 127.0.0.1 only: Ray's single-machine mode
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, inherited by the processes it starts) keeps it from
    swapping 127.0.0.1 for the machine's network address. So token authentication can be
    off (RAY_AUTH_MODE=disabled unless set), and nothing is written under ~/.ray or /tmp/ray.
    No dashboard.

    The workers share this machine's cores with the driver, Ray's own processes and
    whatever else runs here, so their OpenMP threads sleep between parallel regions instead
    of spinning (OMP_WAIT_POLICY=PASSIVE unless set, inherited by every process Ray starts):
    a spinning team stalls whenever one of its threads loses its core, which on a busy
    2-core machine made a CPU worker's batch several times slower than in a lone process."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault(SINGLE_MACHINE_ENV, "0")
    os.environ.setdefault(OMP_WAIT_POLICY_ENV, "PASSIVE")
    import ray
    import ray._private.ray_constants as ray_constants

    # Read once when ray is imported, which may have been before the line above.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ[SINGLE_MACHINE_ENV].lower() in ("1", "true")
    remove_stale_temp_dirs()
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    Path(temp_dir, OWNER_FILE).write_text(_owner_line(os.getpid()))
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
             object_store_memory=object_store_memory,
             _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir,
             logging_level=logging.WARNING)
    return temp_dir


def stop_local_ray(temp_dir: str) -> None:
    """Stop the private local Ray `start_local_ray` started in this process, and remove
    its temp dir.

    `ray.shutdown()` stops Ray's processes one after another, each with SIGTERM and up to
    1 s to exit. The autoscaler monitor, stopped after the GCS, spends that whole second
    trying to report its own SIGTERM to the GCS that is already gone; it holds nothing a
    private single-machine Ray needs at its end, so it is SIGKILLed first. Every other
    process is stopped by `ray.shutdown()` as usual."""
    import ray

    for process in _monitor_processes():
        process.kill()
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def remove_stale_temp_dirs(parent: str | None = None) -> list[str]:
    """Remove the private-Ray folders (`TEMP_PREFIX*` in `parent`, by default the temp
    folder) that belong to this user and whose owner process is gone; return their paths.

    A folder is left alone when its owner file is missing or unreadable (not ours to judge),
    or when the process it names still runs: a pid that is alive with the same start time,
    or alive where start times cannot be read. A pid reused by another process has another
    start time, so its folder counts as stale."""
    parent_dir = Path(parent or tempfile.gettempdir())
    removed = []
    for folder in parent_dir.glob(TEMP_PREFIX + "*"):
        try:
            if not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
            pid_text, _, started = (folder / OWNER_FILE).read_text().strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if process_alive(pid, started):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    return removed


def _owner_line(pid: int) -> str:
    return f"{pid} {process_start_time(pid) or ''}".strip()


def _monitor_processes() -> list[Any]:
    """The autoscaler monitor process(es) of the Ray this process started ([] if none, or
    if this Ray version keeps them elsewhere: then `ray.shutdown()` alone stops them)."""
    import ray._private.ray_constants as ray_constants
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    infos = getattr(node, "all_processes", {}).get(ray_constants.PROCESS_TYPE_MONITOR, [])
    return [info.process for info in infos if getattr(info, "process", None) is not None]


def _running_cluster_address() -> str | None:
    """The address `ray start` left on this machine for `ray.init(address='auto')`, if any."""
    from ray._private.services import find_bootstrap_address

    try:
        return find_bootstrap_address(None)
    except Exception:  # an unreadable bootstrap file means no usable cluster
        return None


__all__ = ["OWNER_FILE", "SINGLE_MACHINE_ENV", "TEMP_PREFIX", "RaySession", "remove_stale_temp_dirs",
           "start_local_ray", "stop_local_ray"]
