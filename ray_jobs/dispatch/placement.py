"""Stage dispatch: where a job's output goes on a multi-node cluster, checked before any
work.

The driver writes every output part and the manifest itself (workers return Arrow tables
to it; they never touch the output folder), so OUTPUT_DIR must be writable from the
machine the driver runs on: the machine where `nanoserve batch` was typed, or the head
node under `ray job submit`. Worker nodes need no access to it.

Refused before Ray starts (one `error:` line):
- an output folder inside the working dir Ray unpacked for a submitted job
  (`.../runtime_resources/working_dir_files/...`, what a relative `-o out` becomes under
  `ray job submit --working-dir .`): Ray deletes that copy when it is no longer used, so the
  output would be lost when the job ends;
- an output folder that cannot be created or written where the driver runs (its nearest
  existing ancestor is not a writable folder).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from nanoserve import InputError

RAY_WORKING_DIR_MARK = ("runtime_resources", "working_dir_files")  # Ray's unpacked job dirs


def check_output_reachable(folder: Path) -> None:
    """InputError if the driver could not keep its output in `folder` (see the module
    docstring); nothing is created."""
    resolved = Path(os.path.abspath(folder))
    parts = resolved.parts
    for i in range(len(parts) - 1):
        if (parts[i], parts[i + 1]) == RAY_WORKING_DIR_MARK:
            raise InputError(
                f"output folder {folder} is {resolved}, inside the copy of the working dir "
                f"Ray unpacked for this job, which Ray deletes after the job: give an absolute "
                f"path on the head node (where the driver of `ray job submit` runs) or on "
                f"storage the nodes share, e.g. -o /shared/out")
    if resolved.exists() and not resolved.is_dir():
        return  # `hold_output_dir` says so: "exists and is not a folder"
    ancestor = resolved
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        what = "is not a folder" if not ancestor.is_dir() else "is not writable"
        raise InputError(
            f"output folder {folder} cannot be written from {socket.gethostname()}, where the "
            f"driver runs and writes every part: {ancestor} {what}")


__all__ = ["check_output_reachable"]
