"""How the engine's CPU threads are set up: once, here, for every entry point (`nanoserve
generate`, `nanoserve.llm.LLM`, the batch job's Ray workers).

Two settings, both for a CPU shared with other work (the driver, Ray's own processes, a test
suite, a browser):
- OpenMP's wait policy. torch runs its CPU operators on an OpenMP team whose threads, by
  default, spin between parallel regions waiting for the next one. When a spinning thread
  holds a core that the thread with the work needs, every region waits for the scheduler:
  on a busy 2-core machine `nanoserve generate` ran 3-8x slower than with
  OMP_WAIT_POLICY=PASSIVE (threads sleep between regions). OpenMP reads the variable once,
  when torch loads it, so `nanoserve/__init__.py` sets it (`prefer_passive_wait`, unless the
  user set it) before any module of nanoserve imports torch; processes started from this one
  (Ray's workers) inherit it.
- The number of intra-op threads (`configure_torch_threads`): the cores this process may
  run on (its CPU affinity), or fewer when asked (a Ray worker: its share of the node's
  CPUs). torch's own default depends on the environment (Ray sets OMP_NUM_THREADS=1 in its
  workers), so it is set explicitly, the same way everywhere.

This module imports no torch until `configure_torch_threads` is called.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"  # read by OpenMP when a process loads it
PASSIVE = "PASSIVE"

# Whether this process's OpenMP was loaded (by an `import torch` before nanoserve's) without
# a wait policy: its threads spin, and nothing done now changes that. Set at import of
# nanoserve (`prefer_passive_wait`).
_spinning_team = False
_warned = False


def prefer_passive_wait() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment sets a policy. Call before torch is
    imported (nanoserve's package `__init__` does); when torch was imported first without a
    policy, the variable still goes to child processes, and `configure_torch_threads` says
    once that this process's threads spin."""
    global _spinning_team
    if WAIT_POLICY_ENV in os.environ:
        return
    _spinning_team = "torch" in sys.modules
    os.environ[WAIT_POLICY_ENV] = PASSIVE


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cpu_thread_count(num_threads: int | None = None) -> int:
    """The intra-op threads for the CPU engine: `num_threads` capped to the available cores,
    or all of them when None."""
    cores = available_cores()
    return cores if num_threads is None else max(1, min(int(num_threads), cores))


def configure_torch_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads for the CPU engine (`cpu_thread_count`) and return the
    count. Says once on stderr when this process's OpenMP team spins (torch was imported
    before nanoserve, with no OMP_WAIT_POLICY), since that makes CPU generation several
    times slower on a busy machine."""
    global _warned
    import torch

    n = cpu_thread_count(num_threads)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if _spinning_team and not _warned and n > 1:
        _warned = True
        print("nanoserve: torch was imported before nanoserve with OMP_WAIT_POLICY unset, so "
              "its CPU threads spin between operations, which is several times slower on a "
              "busy machine: import nanoserve first, or set OMP_WAIT_POLICY=PASSIVE in the "
              "environment", file=sys.stderr)
    return n


__all__ = ["PASSIVE", "WAIT_POLICY_ENV", "available_cores", "configure_torch_threads",
           "cpu_thread_count", "prefer_passive_wait"]
