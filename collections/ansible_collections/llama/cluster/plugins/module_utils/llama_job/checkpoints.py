"""One checkpoint rule for every continuation, applied by the master's agent: before an
automatic restart, and before the first attempt of a run resumed with `-e resume=true` (the job
spec's `resume`), it applies the planner's resume_point (the latest step whose checkpoint is
complete on every node) to what each node holds; every node then moves its newer checkpoints
aside (never deleting one) and continues from that step, passed to its command explicitly."""

from __future__ import annotations

import os
import re
import time
from typing import Any

from ..planner.checkpoints import resume_point

NAME = re.compile(r"^checkpoint-(\d+)$")
# Where a continuation sets checkpoints aside, under <run dir>/set-aside/: restart-<attempt>, or
# resume-<UTC time> (a resumed run starts again at attempt 1).
STAMP = re.compile(r"^(restart-\d{1,6}|resume-\d{8}-\d{6})$")
MAX_LISTED = 40  # the newest checkpoints a node reports (a message is at most 64 KiB)


def listing(directory: str) -> list[dict[str, Any]]:
    """A node's checkpoints as `find` lists them for resume_point: each checkpoint-N directory
    and, where the Trainer finished writing it, its trainer_state.json (the newest MAX_LISTED)."""
    try:
        names = os.listdir(directory) if directory else []
    except OSError:
        return []
    steps = sorted(
        (int(found.group(1)), name)
        for name in names
        if (found := NAME.match(name)) and os.path.isdir(os.path.join(directory, name))
    )
    entries: list[dict[str, Any]] = []
    for _step, name in steps[-MAX_LISTED:]:
        path = os.path.join(directory, name)
        entries.append({"path": path, "isdir": True})
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            entries.append({"path": os.path.join(path, "trainer_state.json"), "isdir": False})
    return entries


def restart_stamp(attempt: int) -> str:
    """The set-aside directory's name for the restart that starts `attempt`."""
    return f"restart-{attempt}"


def resume_stamp(now: float | None = None) -> str:
    """The set-aside directory's name for a resumed run's start."""
    return "resume-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))


def continue_plan(
    found: dict[str, list[dict[str, Any]]],
    job: str,
    directory: str,
    stamp: str,
    *,
    sharded: bool,
    from_scratch: bool,
) -> dict[str, Any]:
    """The checkpoint every node continues from, given what each holds (node: `listing`), as
    the message that carries it to the workers: ok, checkpoint (None: from the beginning),
    set_aside (node: names), stamp and message. With `from_scratch` (a restart) a run with no
    complete checkpoint anywhere starts again from the beginning, its cut-off ones set aside;
    a resumed run is refused instead. No checkpoint on every node: ok False, the message says
    why and what to do."""
    if not directory:
        return {"ok": True, "checkpoint": None, "set_aside": {}, "stamp": stamp, "message": ""}
    run_dir = os.path.dirname(directory.rstrip("/"))
    point = resume_point(found, job, run_dir, stamp, sharded)
    if from_scratch and not any(point["complete"].values()):
        cut = {h: [f"checkpoint-{s}" for s in steps] for h, steps in point["incomplete"].items()}
        return {
            "ok": True,
            "checkpoint": None,
            "set_aside": {h: names for h, names in cut.items() if names},
            "stamp": stamp,
            "message": "no node holds a complete checkpoint: from the beginning",
        }
    return {
        "ok": point["ok"],
        "checkpoint": point["checkpoint"] or None,
        "set_aside": point["set_aside"],
        "stamp": stamp,
        "message": point["message"],
    }


def set_aside_dir(directory: str, stamp: object) -> str | None:
    """Where this node sets its checkpoints aside for a continuation named `stamp`: beside its
    checkpoints' directory, <run dir>/set-aside/<stamp> (None for a stamp that is not one)."""
    if not isinstance(stamp, str) or not STAMP.match(stamp):
        return None
    return os.path.join(os.path.dirname(directory.rstrip("/")), "set-aside", stamp)


def set_aside(directory: str, names: list[str], target: str) -> list[str]:
    """Move this node's checkpoints `names` out of `directory` into `target` (what was moved)."""
    moved = []
    for name in names:
        source = os.path.join(directory, name)
        if not NAME.match(name) or not os.path.isdir(source):
            continue  # only checkpoint-N directories of this node's output are ever moved
        os.makedirs(target, mode=0o750, exist_ok=True)
        destination = os.path.join(target, name)
        suffix = 1
        while os.path.exists(destination):
            destination = os.path.join(target, f"{name}.{suffix}")
            suffix += 1
        os.rename(source, destination)
        moved.append(name)
    return moved


def resume_argument(template: str, directory: str, checkpoint: str | None) -> list[str]:
    """The argument that hands the checkpoint to the command (none without one)."""
    if not template or not checkpoint or not NAME.match(checkpoint):
        return []
    return [template.replace("{checkpoint}", os.path.join(directory, checkpoint))]
