"""What the training processes tell their node's agent beyond the trainer log, through files
in the node's marks directory (LLAMA_JOB_MARKS in their environment, emptied before each
attempt; written by the job's trainer callback, roles/run_config's llama_launcher.py):

- `activity.json` (rank 0): whether it is saving a checkpoint or evaluating, and since which
  step. A save is bounded by the checkpoint's planned size and the disk's measured write speed
  (`save_allowance`) on top of the stall limit, instead of the stall floor alone; an evaluation
  rewrites the file as it goes, and each rewrite is a sign of life.
- `finished-rank<R>.json` (every rank, at the end of training): the rank reached the last step,
  and which checkpoint it saved last. A run whose every rank reached it and whose final
  checkpoint is whole has finished (`finished`): a failure in its teardown is a warning.

Stdlib only, Python 3.10 (it runs on the nodes, in the zipapp)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable
from typing import Any

from .untrusted import read_json_untrusted
from .whole import checkpoint_problem, markers_declared

ACTIVITY = "activity.json"
FINISHED = re.compile(r"^finished-rank(\d+)\.json$")
# A save may take this many times the time the disk needs to write the planned checkpoint.
SAVE_FACTOR = 3.0
# A disk whose speed could not be measured is taken to write this many bytes a second.
SLOW_DISK_BPS = 50 << 20
PROBE_BYTES = 32 << 20  # what the write speed is measured with (written, synced, removed)


def marks_dir(state: str, host: str) -> str:
    """This node's marks directory: beside the agent's state file."""
    return os.path.join(os.path.dirname(state), f"{host}.marks")


def clear_marks(path: str) -> None:
    """The marks directory made (0750) and emptied: an earlier attempt's marks never count."""
    os.makedirs(path, mode=0o750, exist_ok=True)
    for name in os.listdir(path):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(path, name))


def _owners() -> tuple[int, ...]:
    return (os.getuid(),)


def activity(path: str) -> dict[str, Any]:
    """Rank 0's activity record ({} when none)."""
    return read_json_untrusted(os.path.join(path, ACTIVITY), _owners())


def activity_stamp(path: str) -> tuple[int, int] | None:
    """The activity file's identity (changes with each rewrite), None when absent."""
    try:
        found = os.stat(os.path.join(path, ACTIVITY), follow_symlinks=False)
    except OSError:
        return None
    return (found.st_ino, found.st_mtime_ns)


def measure_write_speed(directory: str, size: int = PROBE_BYTES) -> float | None:
    """Bytes a second this directory's disk writes and syncs (None where it cannot be
    measured: no such directory, or too little free space to write the probe)."""
    try:
        found = os.statvfs(directory)
    except OSError:
        return None
    if found.f_bavail * found.f_frsize < 4 * size:
        return None
    path = os.path.join(directory, f".llama-job-speed.{os.getpid()}")
    chunk = os.urandom(1 << 20)
    started = time.monotonic()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            for _ in range(max(1, size >> 20)):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return max(size, 1 << 20) / max(time.monotonic() - started, 1e-3)


def save_allowance(checkpoint_bytes: int, write_bps: float | None) -> float:
    """Seconds a save may take beyond the stall limit: SAVE_FACTOR x the planned checkpoint's
    bytes over the disk's speed (SLOW_DISK_BPS where it was not measured); 0 for a run whose
    checkpoint size is not planned."""
    if checkpoint_bytes <= 0:
        return 0.0
    return SAVE_FACTOR * checkpoint_bytes / (write_bps or SLOW_DISK_BPS)


def _finished_marks(path: str) -> dict[int, dict[str, Any]]:
    try:
        names = os.listdir(path)
    except OSError:
        return {}
    found = {}
    for name in names:
        if match := FINISHED.match(name):
            found[int(match.group(1))] = read_json_untrusted(os.path.join(path, name), _owners())
    return found


def finished(path: str, ranks: Iterable[int], checkpoints_dir: str) -> str:
    """'' unless every rank of this node reached the last step of training (its finished mark)
    and the checkpoint they saved last is whole on this node: then a line that says so."""
    wanted = list(ranks)
    marks = _finished_marks(path)
    if not wanted or any(r not in marks for r in wanted):
        return ""
    steps = {(marks[r].get("step"), marks[r].get("max_steps")) for r in wanted}
    checkpoints = {marks[r].get("checkpoint") for r in wanted}
    if len(steps) != 1 or len(checkpoints) != 1:
        return ""
    ((step, last),) = steps
    (checkpoint,) = checkpoints
    if not isinstance(step, int) or not isinstance(last, int) or step < last:
        return ""
    if checkpoint is not None:
        name = str(checkpoint)
        declared = markers_declared(checkpoints_dir) is not None
        if "/" in name or checkpoint_problem(os.path.join(checkpoints_dir, name), declared):
            return ""
        return f"every rank reached the last step ({step}) and {name} is whole"
    return f"every rank reached the last step ({step})"
