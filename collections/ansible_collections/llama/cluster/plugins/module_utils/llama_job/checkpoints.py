"""One checkpoint rule for every continuation, applied by the master's agent: before an
automatic restart, and before the first attempt of a run resumed with `-e resume=true` (the job
spec's `resume`), it applies resume_point (resume.py) (the latest step whose checkpoint is
complete on every node) to what each node holds; every node then moves its newer checkpoints
aside (never deleting one) and continues from that step, passed to its command explicitly."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import time
from typing import Any

from .resume import resume_point

NAME = re.compile(r"^checkpoint-(\d+)$")
# Where a continuation sets checkpoints aside, under <run dir>/set-aside/: restart-<attempt>, or
# resume-<UTC time> (a resumed run starts again at attempt 1).
STAMP = re.compile(r"^(restart-\d{1,6}|resume-\d{8}-\d{6})$")
MAX_LISTED = 40  # the newest checkpoints a node reports (a message is at most 64 KiB)


# What a checkpoint's own files are read to (never past these bounds, never through a link).
MAX_JSON = 64 << 20  # trainer_state.json and a weight index (their log history can be long)
MAX_HEADER = 16 << 20  # a safetensors file's JSON header
MAX_PROBLEM = 160  # characters of a problem sent to the master (a message is at most 64 KiB)
_verdicts: dict[tuple[Any, ...], str] = {}  # a checkpoint's verdict by its files' identity
UNREAD = object()  # a JSON file too long to read here: taken as written


def _open_file(folder: int, name: str) -> int | None:
    """A regular file of the checkpoint, opened without following a link (None otherwise)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _read_json(folder: int, name: str) -> tuple[bool, object]:
    """(present, the JSON value or None where it does not parse)."""
    fd = _open_file(folder, name)
    if fd is None:
        return False, None
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_size > MAX_JSON:
            return True, UNREAD
        try:
            return True, json.loads(handle.read(MAX_JSON))
        except (ValueError, RecursionError):
            return True, None


def _safetensors_problem(folder: int, name: str) -> str:
    """'' unless a safetensors file is shorter than its own header says it is (cut off)."""
    fd = _open_file(folder, name)
    if fd is None:
        return f"{name} is not a regular file"
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) < 8:
            return f"{name} holds {size} bytes, not even its header (cut off)"
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            return ""  # a header this long is not read here
        try:
            header = json.loads(handle.read(length))
            ends = [
                int(entry["data_offsets"][1])
                for key, entry in header.items()
                if key != "__metadata__"
            ]
        except (ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError):
            return f"{name}'s header does not parse (cut off)"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"{name} holds {size:,} of its {expected:,} bytes (cut off)"
    return ""


def _index_problem(folder: int, name: str, names: set[str]) -> str:
    """'' unless a weight index does not parse or names a shard that is not there."""
    _, index = _read_json(folder, name)
    if index is UNREAD:
        return ""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        return f"{name} does not parse (cut off)"
    missing = sorted({str(shard) for shard in weight_map.values()} - names)
    if missing:
        return f"{name} names {missing[0]}, which is missing" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        )
    return ""


def _problem(folder: int) -> str:
    """What makes a checkpoint incomplete ('' when its files parse and match their index)."""
    names = set(os.listdir(folder))
    present, state = _read_json(folder, "trainer_state.json")
    if not present:
        return "no trainer_state.json (cut off while being written)"
    if not isinstance(state, dict) and state is not UNREAD:
        return "trainer_state.json is empty or does not parse (a save cut off, e.g. by a full disk)"
    for name in sorted(names):
        if name.endswith(".index.json"):
            problem = _index_problem(folder, name, names)
        elif name.endswith(".safetensors"):
            problem = _safetensors_problem(folder, name)
        else:
            continue
        if problem:
            return problem
    if "latest" in names:  # DeepSpeed's: the tag (global_stepN) of its per-rank state
        fd = _open_file(folder, "latest")
        tag = os.read(fd, 256).decode("utf-8", "replace").strip() if fd is not None else ""
        if fd is not None:
            os.close(fd)
        if not tag or tag not in names:
            return f"latest names {tag or 'nothing'}, which is missing (DeepSpeed's state)"
    return ""


def checkpoint_problem(path: str) -> str:
    """Why checkpoint-N at `path` is not complete, or '' when it is: its trainer_state.json
    (written last) parses, every weight index parses and every shard it names is there, every
    safetensors file holds the bytes its header says, and DeepSpeed's `latest` names a state
    that is there. Nothing is read through a link. A verdict is kept while the directory and
    its trainer_state.json stay as they are (a worker lists its checkpoints with every heartbeat
    while it is idle; the Trainer writes trainer_state.json last, and nothing rewrites a saved
    checkpoint)."""
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return "not a directory"
    try:
        itself = os.fstat(folder)
        key: tuple[Any, ...] = (path, itself.st_ino, itself.st_mtime_ns)
        try:
            state = os.stat("trainer_state.json", dir_fd=folder, follow_symlinks=False)
            key += (state.st_ino, state.st_mtime_ns, state.st_size)
        except OSError:
            key += (None,)
        if key not in _verdicts:
            if len(_verdicts) > 4 * MAX_LISTED:
                _verdicts.clear()
            _verdicts[key] = _problem(folder)[:MAX_PROBLEM]
        return _verdicts[key]
    finally:
        os.close(folder)


def listing(directory: str) -> list[dict[str, Any]]:
    """A node's checkpoints for resume_point (the newest MAX_LISTED): each checkpoint-N
    directory (not a link) and, where it is complete (checkpoint_problem), its
    trainer_state.json; an incomplete one says why (`problem`)."""
    try:
        names = os.listdir(directory) if directory else []
    except OSError:
        return []
    steps = sorted(
        (int(found.group(1)), name)
        for name in names
        if (found := NAME.match(name)) and _is_directory(os.path.join(directory, name))
    )
    entries: list[dict[str, Any]] = []
    for _step, name in steps[-MAX_LISTED:]:
        path = os.path.join(directory, name)
        problem = checkpoint_problem(path)
        if problem:
            entries.append({"path": path, "isdir": True, "problem": problem})
        else:
            entries.append({"path": path, "isdir": True})
            entries.append({"path": os.path.join(path, "trainer_state.json"), "isdir": False})
    return entries


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
