"""One checkpoint rule for every continuation: before an automatic restart the master applies
the planner's resume_point (the rule of `-e resume=true`: the latest step whose checkpoint is
complete on every node) to what each node holds; every node then moves its newer checkpoints
aside (never deleting one) and resumes from that step, passed to its command explicitly."""

from __future__ import annotations

import os
import re
from typing import Any

from ..planner.checkpoints import resume_point

NAME = re.compile(r"^checkpoint-(\d+)$")
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


def restart_point(
    found: dict[str, list[dict[str, Any]]], job: str, directory: str, attempt: int, sharded: bool
) -> dict[str, Any]:
    """resume_point for the restart to `attempt`: ok, checkpoint, set_aside (node: names),
    set_aside_dir (beside the checkpoints' directory), message; `none` when no node holds a
    complete checkpoint yet (the attempt starts from the beginning)."""
    run_dir = os.path.dirname(directory.rstrip("/"))
    point = resume_point(found, job, run_dir, f"restart-{attempt}", sharded)
    point["none"] = not any(point["complete"].values())
    return point


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
