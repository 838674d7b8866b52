"""Whether a checkpoint is whole (`checkpoint_problem`): the one rule every continuation, every
rotation and every report applies. A checkpoint counts only when every file it should hold is
whole: its trainer_state.json parses, torch's zip files (optimizer, scheduler, RNG states,
DeepSpeed's shards, `*.bin`) end with their end-of-archive record, safetensors files hold the
bytes their header says and every shard a weight index names is there, DeepSpeed's `latest`
names a state with every rank's shards, and, where the run declares markers (the output
directory's MARKERS file, written by the job's trainer callback: roles/run_config's
llama_launcher.py), its MARKER lists every file with its size, written after the files and
the directory were synced. Nothing is read through a link, and never past the bounds below.
Stdlib only, Python 3.10 (it runs on the nodes, in the zipapp)."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from typing import Any

# The run's declaration, in its output directory: its checkpoints carry MARKER, and the
# save_total_limit llama-job rotates them by (the Trainer's own rotation is switched off).
MARKERS = "llama_job_markers.json"
# In a checkpoint, written last, after every file and the directory were synced.
MARKER = "llama_job_saved.json"
MAX_JSON = 64 << 20  # trainer_state.json and a weight index (their log history can be long)
MAX_HEADER = 16 << 20  # a safetensors file's JSON header
MAX_PROBLEM = 160  # characters of a problem sent to the master (a message is at most 64 KiB)
ZIP_END = b"PK\x05\x06"  # the end-of-central-directory record, the last of a zip archive
ZIP_END_LEN = 22
ZIPS = (".pt", ".pth", ".bin")  # what torch.save writes (a zip archive since torch 1.6)
RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt$")
UNREAD = object()  # a JSON file too long to read here: taken as written
_verdicts: dict[tuple[Any, ...], str] = {}  # a checkpoint's verdict by its files' identity
MAX_VERDICTS = 160


def open_file(folder: int, name: str) -> int | None:
    """A regular file under the directory `folder`, opened without following a link (None
    otherwise)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def open_folder(folder: int | None, name: str) -> int | None:
    """A directory (under `folder`, or a path), opened without following a link."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
    except OSError:
        return None


def read_json(folder: int, name: str) -> tuple[bool, object]:
    """(present, the JSON value or None where it does not parse; UNREAD past MAX_JSON)."""
    fd = open_file(folder, name)
    if fd is None:
        return False, None
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_size > MAX_JSON:
            return True, UNREAD
        try:
            return True, json.loads(handle.read(MAX_JSON))
        except (ValueError, RecursionError):
            return True, None


def _zip_problem(folder: int, name: str) -> str:
    """'' unless a torch file is empty or lacks its zip archive's end record (cut off)."""
    fd = open_file(folder, name)
    if fd is None:
        return f"{name} is not a regular file"
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return f"{name} is empty (0 bytes: its data never reached the disk)"
        span = min(size, ZIP_END_LEN + 0xFFFF)
        tail = os.pread(fd, span, size - span)
    finally:
        os.close(fd)
    at = tail.rfind(ZIP_END)
    while at >= 0:
        comment = struct.unpack("<H", tail[at + 20 : at + 22])[0] if at + 22 <= len(tail) else -1
        if at + ZIP_END_LEN + comment == len(tail):
            return ""
        at = tail.rfind(ZIP_END, 0, at)
    return f"{name} lacks its zip archive's end (cut off at {size:,} bytes)"


def _safetensors_problem(folder: int, name: str) -> str:
    """'' unless a safetensors file is shorter than its own header says it is (cut off)."""
    fd = open_file(folder, name)
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
    _, index = read_json(folder, name)
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


def _files_problem(folder: int, names: set[str], where: str = "") -> str:
    """'' unless a weight index, safetensors or torch file of a directory is not whole."""
    for name in sorted(names):
        if name.endswith(".index.json"):
            problem = _index_problem(folder, name, names)
        elif name.endswith(".safetensors"):
            problem = _safetensors_problem(folder, name)
        elif name.endswith(ZIPS):
            problem = _zip_problem(folder, name)
        else:
            continue
        if problem:
            return where + problem
    return ""


def _deepspeed_problem(folder: int, names: set[str]) -> str:
    """'' unless DeepSpeed's `latest` names a state that is missing, empty, cut off, or whose
    ranks' optimizer and model shards do not match (a rank's file missing)."""
    fd = open_file(folder, "latest")
    tag = os.read(fd, 256).decode("utf-8", "replace").strip() if fd is not None else ""
    if fd is not None:
        os.close(fd)
    state = open_folder(folder, tag) if tag and "/" not in tag and tag in names else None
    if state is None:
        return f"latest names {tag or 'nothing'}, which is missing (DeepSpeed's state)"
    try:
        inside = set(os.listdir(state))
        shards = [n for n in inside if n.endswith(ZIPS)]
        if not shards:
            return f"{tag} holds no shard (DeepSpeed's state, cut off)"
        problem = _files_problem(state, inside, f"{tag}/")
    finally:
        os.close(state)
    if problem:
        return problem
    ranks: dict[str, set[int]] = {"optim": set(), "model": set()}
    for name in shards:
        if found := RANK_FILE.search(name):
            ranks[found.group(2)].add(int(found.group(1)))
    if ranks["model"] and ranks["optim"] and ranks["model"] != ranks["optim"]:
        lacking = sorted(ranks["model"] ^ ranks["optim"])
        return f"{tag} lacks a shard of rank {lacking[0]} (DeepSpeed's state, cut off)"
    return ""


def _marker_problem(folder: int) -> str:
    """'' unless the save's marker is missing, or a file it lists is missing or of another
    size than it had when the save was synced."""
    present, marker = read_json(folder, MARKER)
    if not present:
        return f"no {MARKER} (the save never finished: its files were not all synced)"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict):
        return f"{MARKER} does not parse"
    for name, size in sorted(files.items()):
        parts = str(name).split("/")
        if len(parts) > 2 or any(p in ("", ".", "..") for p in parts):
            return f"{MARKER} names {name!r}, not a file of the checkpoint"
        where = open_folder(folder, parts[0]) if len(parts) == 2 else folder
        fd = open_file(where, parts[-1]) if where is not None else None
        found = os.fstat(fd).st_size if fd is not None else None
        for opened in {fd, where} - {None, folder}:
            os.close(opened)  # type: ignore[arg-type]
        if found is None:
            return f"{name} is missing (listed by {MARKER})"
        if found != size:
            return f"{name} holds {found:,} bytes, not the {size:,} synced (changed or cut off)"
    return ""


def problem(folder: int, marker: bool) -> str:
    """What keeps an open checkpoint directory from counting ('' when it is whole)."""
    names = set(os.listdir(folder))
    present, state = read_json(folder, "trainer_state.json")
    if not present:
        return "no trainer_state.json (cut off while being written)"
    if not isinstance(state, dict) and state is not UNREAD:
        return "trainer_state.json is empty or does not parse (a save cut off, e.g. by a full disk)"
    found = _files_problem(folder, names)
    if not found and "latest" in names:
        found = _deepspeed_problem(folder, names)
    if not found and marker:
        found = _marker_problem(folder)
    return found


def markers_declared(directory: str) -> dict[str, Any] | None:
    """The run's declaration in its output directory (MARKERS), or None: a run without one
    (started before markers, or not a trainer's) is judged without markers."""
    folder = open_folder(None, directory) if directory else None
    if folder is None:
        return None
    try:
        present, declared = read_json(folder, MARKERS)
    finally:
        os.close(folder)
    if not present:
        return None
    return declared if isinstance(declared, dict) else {}


def _identity(folder: int, name: str) -> tuple[Any, ...]:
    try:
        found = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return (None,)
    return (found.st_ino, found.st_mtime_ns, found.st_size)


def checkpoint_problem(path: str, marker: bool = False) -> str:
    """Why checkpoint-N at `path` does not count, or '' when it is whole (the module's
    docstring says what whole is); `marker`: the run declares markers, so one is required. A
    verdict is kept while the directory, its trainer_state.json and its marker stay as they
    are (a worker lists its checkpoints with every heartbeat while it is idle; the marker is
    written last, and nothing rewrites a saved checkpoint)."""
    folder = open_folder(None, path)
    if folder is None:
        return "not a directory"
    try:
        itself = os.fstat(folder)
        key = (path, marker, itself.st_ino, itself.st_mtime_ns)
        key += _identity(folder, "trainer_state.json") + _identity(folder, MARKER)
        if key not in _verdicts:
            if len(_verdicts) > MAX_VERDICTS:
                _verdicts.clear()
            _verdicts[key] = problem(folder, marker)[:MAX_PROBLEM]
        return _verdicts[key]
    finally:
        os.close(folder)
