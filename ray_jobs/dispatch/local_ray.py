"""Stage dispatch: which Ray a job runs on, a cluster it joins or a private single-machine
Ray it starts and stops itself (`RaySession`); `start_local_ray` / `stop_local_ray` for
that private Ray.

A private Ray lives in its own temp folder (`/tmp/ns-ray-*`, short so Ray's socket paths
stay under 108 characters) and listens on 127.0.0.1 only, with no dashboard. The folder
names its owner (`OWNER_FILE`: the driver's pid and process start time); a driver killed
before it could remove its folder leaves it behind, and the next private Ray started on the
machine removes every such folder whose owner process is gone.

A private Ray starts only what a job needs, and survives a busy machine (`start_local_ray`):
Ray 2.60's raylet waits at most 15 s for each of its agents to write its port into a file,
a limit no option changes, and on a loaded 2-core machine the dashboard agent (importing
every dashboard module) missed it in 4 of 21 job starts. So the agents' ports are chosen
before the start and their files written as soon as the GCS has named the node
(`_AgentPortFiles`): the raylet starts without waiting for the agents, which come up when
the machine lets them. Less is started (no autoscaler monitor, no workers started ahead of
need, no metrics), the timeouts that can be set are long, a failed start is tried once
more after a note, and a second failure is one `NanoserveError` naming what timed out and
what to try.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nanoserve import NanoserveError
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
START_ATTEMPTS_ENV = "NANOSERVE_RAY_START_ATTEMPTS"  # starts tried (default 2: one retry)
START_ATTEMPTS = 2

# Ray's settings (`_system_config`) for the private Ray: what a job on one machine needs.
LOCAL_SYSTEM_CONFIG = {
    # Python workers start when an actor needs one: the raylet would otherwise start one per
    # CPU with itself, each importing Ray while the dashboard agent must start in 15 s.
    "enable_worker_prestart": False,
    "prestart_worker_first_driver": False,
    # No metrics: nothing reads them (no dashboard, no Prometheus), and every process would
    # record and export them.
    "enable_metrics_collection": False,
    # A worker process has this long to start and register (default 60 s); on a busy
    # machine importing Ray can take longer, and the job bounds the wait itself
    # (--worker-start-timeout).
    "worker_register_timeout_seconds": 600,
}
# Ray's node options that `ray.init` does not take but `ray start --head` does
# (`--no-monitor`): the autoscaler monitor has nothing to do on one machine.
LOCAL_NODE_OPTIONS = {"no_monitor": True}
# The agents' ports, chosen before the start (`ray start --metrics-agent-port` and the like)
# so that the raylet need not wait for the agents to say them (`_AgentPortFiles`).
AGENT_PORT_FIELDS = ("metrics_agent_port", "metrics_export_port", "runtime_env_agent_port")
# Testing hook (never set it in production): "1" starts Ray as Ray alone would, the raylet
# waiting up to 15 s for each agent's port file, so a slow agent fails the start (the
# tests' way to a real failed start: the retry and the error line).
FAULT_AGENT_WAIT = "NANOSERVE_FAULT_RAY_AGENT_WAIT"
# What each of Ray's port files names, for the error line (the raylet waits for each).
_PORT_FILE_OWNERS = {
    "metrics_agent_port": "Ray's dashboard agent",
    "metrics_export_port": "Ray's dashboard agent",
    "dashboard_agent_listen_port": "Ray's dashboard agent",
    "runtime_env_agent_port": "Ray's runtime-env agent",
}


def start_local_ray(num_cpus: int | None = None, num_gpus: int | None = None,
                    object_store_memory: int | None = None) -> str:
    """Start a private single-machine Ray in this process and return its temp dir (the
    caller removes it after `ray.shutdown()`).

    Every Ray process listens on 127.0.0.1 only: Ray's single-machine mode
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, inherited by the processes it starts) keeps it from
    swapping 127.0.0.1 for the machine's network address. So token authentication can be
    off (RAY_AUTH_MODE=disabled unless set), and nothing is written under ~/.ray or /tmp/ray.
    No dashboard, no autoscaler monitor, no metrics, no workers started ahead of need
    (`LOCAL_SYSTEM_CONFIG`, `LOCAL_NODE_OPTIONS`); the raylet does not wait for the agents
    (`_AgentPortFiles`).

    A start that fails is stopped, whatever of it was running, and tried once more after a line on
    stderr (`NANOSERVE_RAY_START_ATTEMPTS` starts in all, default 2); when the last fails,
    NanoserveError says what timed out and what to try, and that attempt's folder is kept
    for its logs (the next private Ray removes it).

    The workers share this machine's cores with the driver, Ray's own processes and
    whatever else runs here, so their OpenMP threads sleep between parallel regions instead
    of spinning (OMP_WAIT_POLICY=PASSIVE unless set, inherited by every process Ray starts;
    `nanoserve.cpu_threads`)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault(SINGLE_MACHINE_ENV, "0")
    os.environ.setdefault(OMP_WAIT_POLICY_ENV, "PASSIVE")
    import ray
    import ray._private.ray_constants as ray_constants

    # Read once when ray is imported, which may have been before the line above.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ[SINGLE_MACHINE_ENV].lower() in ("1", "true")
    remove_stale_temp_dirs()
    attempts = start_attempts()
    for attempt in range(1, attempts + 1):
        temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        Path(temp_dir, OWNER_FILE).write_text(_owner_line(os.getpid()))
        before = _descendant_pids()
        ports = {} if os.environ.get(FAULT_AGENT_WAIT) == "1" else _agent_ports()
        try:
            with _node_options({**LOCAL_NODE_OPTIONS, **ports}), _AgentPortFiles(temp_dir, ports):
                ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                         object_store_memory=object_store_memory,
                         _node_ip_address="127.0.0.1", include_dashboard=False,
                         _temp_dir=temp_dir, logging_level=logging.WARNING,
                         _system_config=dict(LOCAL_SYSTEM_CONFIG))
            return temp_dir
        except Exception as e:  # any failure of Ray's start: stop what it left running
            reason = start_failure(temp_dir, e)
            _stop_failed_start(before, temp_dir)
        if attempt < attempts:
            print(f"nanoserve: Ray's local start failed ({reason}); trying once more",
                  file=sys.stderr)
            shutil.rmtree(temp_dir, ignore_errors=True)
    raise NanoserveError(
        f"could not start a local Ray ({reason}; {attempts} attempt(s), logs in "
        f"{Path(temp_dir, 'session_latest', 'logs')}): run the job again when the machine "
        f"is less busy, or start Ray once with `ray start --head` (jobs on this machine join "
        f"a running Ray instead of starting their own){_bytecode_hint()}")


def _bytecode_hint() -> str:
    """What to try when Ray's modules have no bytecode (an install without it, and
    PYTHONDONTWRITEBYTECODE set): each of Ray's processes then compiles them as it starts,
    about a third more CPU for each (1.7 against 3.0 CPU-s for the dashboard agent)."""
    import importlib.util

    import ray.dashboard.agent as agent

    if os.path.exists(importlib.util.cache_from_source(agent.__file__)):
        return ""
    return (f"; Ray's modules have no bytecode here, so each of its processes compiles them "
            f"as it starts: `{sys.executable} -m compileall -q "
            f"{Path(agent.__file__).parents[1]}` once makes its start lighter")


def _agent_ports() -> dict[str, int]:
    """Free ports on 127.0.0.1 for the agents' servers, chosen here (RayParams' fields)."""
    import socket

    ports = {}
    for field in AGENT_PORT_FIELDS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[field] = s.getsockname()[1]
    return ports


class _AgentPortFiles:
    """Write, while `ray.init` runs, the port files the raylet waits for (Ray's own
    `persist_port`, as its agents write them), as soon as the GCS has named the node and
    before the raylet starts: the agents' ports chosen in advance (they bind to them when
    they are up), and -1 ("not served") for the dashboard agent's HTTP port, which a
    private Ray without a dashboard does not use. The raylet then starts without waiting
    for the agents (Ray 2.60 allows them 15 s, which a busy 2-core machine can exceed), and
    the agents write the same files again when they are up. A file already there is left
    as it is."""

    def __init__(self, temp_dir: str, ports: dict[str, int]) -> None:
        from ray._raylet import (
            DASHBOARD_AGENT_LISTEN_PORT_NAME,
            METRICS_AGENT_PORT_NAME,
            METRICS_EXPORT_PORT_NAME,
            RUNTIME_ENV_AGENT_PORT_NAME,
        )

        self.temp_dir = Path(temp_dir)
        self.ports = ports  # {}: write none (FAULT_AGENT_WAIT)
        self.files = {METRICS_AGENT_PORT_NAME: ports.get("metrics_agent_port"),
                      METRICS_EXPORT_PORT_NAME: ports.get("metrics_export_port"),
                      RUNTIME_ENV_AGENT_PORT_NAME: ports.get("runtime_env_agent_port"),
                      DASHBOARD_AGENT_LISTEN_PORT_NAME: -1}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanoserve-ray-ports", daemon=True)

    def __enter__(self) -> _AgentPortFiles:
        if self.ports:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        if self.ports:
            self.thread.join()

    def _run(self) -> None:
        from ray._raylet import GCS_SERVER_PORT_NAME, get_port_filename, persist_port

        prefix = GCS_SERVER_PORT_NAME + "_"
        while not self.done.wait(0.05):
            found = [f for f in self.temp_dir.glob(f"session_*/{prefix}*")
                     if not f.name.startswith(".")]
            if not found:
                continue
            session, node_id = found[0].parent, found[0].name[len(prefix):]
            for name, port in self.files.items():
                with contextlib.suppress(Exception):  # the agent's own write wins
                    if not (session / get_port_filename(node_id, name)).exists():
                        persist_port(str(session), node_id, name, port)
            return


def start_attempts() -> int:
    """How many times `start_local_ray` tries (NANOSERVE_RAY_START_ATTEMPTS, default 2)."""
    try:
        return max(1, int(os.environ.get(START_ATTEMPTS_ENV, START_ATTEMPTS)))
    except ValueError:
        return START_ATTEMPTS


def start_failure(temp_dir: str, error: BaseException) -> str:
    """Why a private Ray's start failed, in a few words: the agent the raylet waited for
    when its raylet.out says so, else the first line of `error`; with the machine's load
    when it is busy."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    for log in sorted(Path(temp_dir).glob("session_*/logs/raylet.out")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        if m := re.search(r"Timed out waiting for file (\S+)", text):
            port = re.sub(r"_[0-9a-f]{16,}$", "", Path(m.group(1)).name)
            who = _PORT_FILE_OWNERS.get(port, f"the process that writes {port}")
            reason = f"{who} did not start within the raylet's time limit"
            break
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return reason
    if load >= cores:
        reason += f"; the machine is busy: load average {load:.1f} on {cores} CPU(s)"
    return reason


@contextlib.contextmanager
def _node_options(options: dict[str, Any]) -> Iterator[None]:
    """Give the node `ray.init` starts these fields of Ray's `RayParams` (options of `ray
    start` that `ray.init` does not take), for the duration of the block. A field this Ray's
    RayParams does not have is left out (the option then has no effect)."""
    import ray._private.parameter as parameter

    original = parameter.RayParams.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        for name, value in options.items():
            if hasattr(self, name):
                setattr(self, name, value)

    parameter.RayParams.__init__ = init
    try:
        yield
    finally:
        parameter.RayParams.__init__ = original


def _descendant_pids() -> set[int]:
    import psutil  # Ray's own copy once ray is imported

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _stop_failed_start(before: set[int], temp_dir: str) -> None:
    """After a failed `ray.init`: forget its state and SIGKILL every process it started, so
    a retry does not compete with them and nothing is left running: the descendants of this
    process that were not there before, and any process still naming `temp_dir` on its
    command line (an agent whose raylet died has left this process's tree)."""
    import psutil
    import ray

    with contextlib.suppress(Exception):
        ray.shutdown()
    started = []
    with contextlib.suppress(psutil.Error):
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    pids = {p.pid for p in started}
    for process in psutil.process_iter(["cmdline", "uids"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if (process.pid not in pids and process.info["uids"].real == os.getuid()
                    and any(temp_dir in part for part in process.info["cmdline"] or ())):
                started.append(process)
    for process in started:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(started, timeout=5)


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


__all__ = ["AGENT_PORT_FIELDS", "FAULT_AGENT_WAIT", "LOCAL_NODE_OPTIONS", "LOCAL_SYSTEM_CONFIG",
           "OWNER_FILE", "SINGLE_MACHINE_ENV",
           "START_ATTEMPTS_ENV", "TEMP_PREFIX", "RaySession", "remove_stale_temp_dirs",
           "start_failure", "start_local_ray", "stop_local_ray"]
