"""One checkpoint rule for every continuation, applied by the master's agent: before an
automatic restart, and before the first attempt of a run resumed with `-e resume=true` (the job
spec's `resume`), it applies resume_point (resume.py) (the latest step whose checkpoint is
complete on every node) to what each node holds; every node then moves its newer checkpoints
aside (never deleting one) and continues from that step, passed to its command explicitly."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import time
from typing import Any

from .resume import resume_point
from .whole import checkpoint_problem, markers_declared, open_folder, read_json

NAME = re.compile(r"^checkpoint-(\d+)$")
# Where a continuation sets checkpoints aside, under <run dir>/set-aside/: restart-<attempt>, or
# resume-<UTC time> (a resumed run starts again at attempt 1).
STAMP = re.compile(r"^(restart-\d{1,6}|resume-\d{8}-\d{6})$")
MAX_LISTED = 40  # the newest checkpoints a node reports (a message is at most 64 KiB)


def _steps(directory: str) -> list[tuple[int, str]]:
    """The checkpoint-N directories (not links) of `directory`, oldest first."""
    try:
        names = os.listdir(directory) if directory else []
    except OSError:
        return []
    return sorted(
        (int(found.group(1)), name)
        for name in names
        if (found := NAME.match(name)) and _is_directory(os.path.join(directory, name))
    )


def listing(directory: str) -> list[dict[str, Any]]:
    """A node's checkpoints for resume_point (the newest MAX_LISTED): each checkpoint-N
    directory (not a link) and, where it is whole (whole.py: checkpoint_problem, with a marker
    required where the run declares markers), its trainer_state.json; one that does not count
    says why (`problem`)."""
    marker = markers_declared(directory) is not None
    entries: list[dict[str, Any]] = []
    for _step, name in _steps(directory)[-MAX_LISTED:]:
        path = os.path.join(directory, name)
        problem = checkpoint_problem(path, marker)
        if problem:
            entries.append({"path": path, "isdir": True, "problem": problem})
        else:
            entries.append({"path": path, "isdir": True})
            entries.append({"path": os.path.join(path, "trainer_state.json"), "isdir": False})
    return entries


def _best(directory: str, newest: str) -> str:
    """The best checkpoint's name, as the newest whole checkpoint's trainer_state.json says
    (load_best_model_at end), or ''."""
    folder = open_folder(None, os.path.join(directory, newest))
    if folder is None:
        return ""
    try:
        _, state = read_json(folder, "trainer_state.json")
    finally:
        os.close(folder)
    best = state.get("best_model_checkpoint") if isinstance(state, dict) else None
    return os.path.basename(str(best).rstrip("/")) if best else ""


def rotation(directory: str, nodes: int) -> list[str]:
    """The checkpoints a rotation deletes now: those older than the newest `save_total_limit`
    whole checkpoints (the run's declaration, MARKERS; at least 2 on several nodes, so that a
    node stopped during a save still shares one with the others), the best one kept; nothing
    while fewer whole ones than that exist. So the last whole checkpoint is never deleted, and
    an older one only once the newer ones count (the Trainer's own rotation deleted the older
    ones as soon as its save returned, whole or not)."""
    limit = (markers_declared(directory) or {}).get("save_total_limit")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return []
    keep = max(limit, 2) if nodes > 1 else limit
    steps = _steps(directory)
    whole = [(s, n) for s, n in steps if not checkpoint_problem(os.path.join(directory, n), True)]
    if len(whole) < keep:
        return []
    oldest_kept = whole[-keep][0]
    best = _best(directory, whole[-1][1])
    return [n for s, n in steps if s < oldest_kept and n != best]


def rotate(directory: str, nodes: int) -> list[str]:
    """Delete what `rotation` names (never through a link); the names deleted."""
    deleted = []
    for name in rotation(directory, nodes):
        path = os.path.join(directory, name)
        if not _is_directory(path):
            continue
        try:
            shutil.rmtree(path)
        except OSError:
            continue
        deleted.append(name)
    return deleted


def _is_directory(path: str) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


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
        why = point["why"]
        named = "; ".join(
            f"{name} on {host} ({reason})"
            for host, names in why.items()
            for name, reason in names.items()
        )
        return {
            "ok": True,
            "checkpoint": None,
            "set_aside": {h: list(names) for h, names in why.items()},
            "stamp": stamp,
            "message": "no node holds a complete checkpoint: from the beginning"
            + (f"; setting aside {named}" if named else ""),
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


def set_aside(directory: str, names: list[str], target: str) -> dict[str, str]:
    """Move this node's checkpoints `names` out of `directory` into `target`; where the
    checkpoints' directory is a filesystem of its own (a rename cannot leave it), into
    <directory>/set-aside/<the same stamp> instead, beside them (a continuation never reads
    below `directory`'s own checkpoint-N). What was moved, each to where."""
    moved = {}
    for name in names:
        source = os.path.join(directory, name)
        if not NAME.match(name) or not _is_directory(source):
            continue  # only checkpoint-N directories of this node's output are ever moved
        for folder in (target, os.path.join(directory, "set-aside", os.path.basename(target))):
            os.makedirs(folder, mode=0o750, exist_ok=True)
            destination = os.path.join(folder, name)
            suffix = 1
            while os.path.lexists(destination):
                destination = os.path.join(folder, f"{name}.{suffix}")
                suffix += 1
            try:
                os.rename(source, destination)
            except OSError as err:
                if err.errno != errno.EXDEV:
                    raise
                continue
            moved[name] = folder
            break
    return moved


def resume_argument(template: str, directory: str, checkpoint: str | None) -> list[str]:
    """The argument that hands the checkpoint to the command (none without one)."""
    if not template or not checkpoint or not NAME.match(checkpoint):
        return []
    return [template.replace("{checkpoint}", os.path.join(directory, checkpoint))]
