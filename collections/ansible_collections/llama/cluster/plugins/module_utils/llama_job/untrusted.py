"""Files the job's user can write, read by root and by the agent without trusting them.

Nothing here follows a link, reads more than a bound, or accepts a file of another owner.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_READ = 1 << 20  # bytes read from any file the job's user can write


def write_json(path: Path, data: object, mode: int = 0o640) -> None:
    """Replace a JSON file atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, sort_keys=True)
        handle.write("\n")
    os.replace(tmp, path)


def read_untrusted(path: str | Path, owners: tuple[int, ...], limit: int = MAX_READ) -> str | None:
    """A regular file's text when one of `owners` owns it; None otherwise (never follows links)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in owners:
            return None
        return handle.read(limit).decode("utf-8", "replace")


def _no_constant(word: str) -> object:
    raise ValueError(f"{word} is not a number JSON has")


def parse_json(text: str) -> object:
    """JSON from a text another account wrote: ValueError for anything that is not (too deep
    for the parser, NaN or Infinity included)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError as err:
        raise ValueError("nested too deep") from err


def read_json_untrusted(path: str | Path, owners: tuple[int, ...]) -> dict[str, Any]:
    """A JSON object from a file the job's user may have written, or {}."""
    text = read_untrusted(path, owners)
    if not text:
        return {}
    try:
        data = parse_json(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def read_from(path: str, offset: int, limit: int = 256 * 1024) -> str:
    """Text of a file from an offset (at most `limit` bytes, the start of that range)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def tail_untrusted(path: str, owners: tuple[int, ...], size: int = 16384) -> str:
    """The end of a log the job's user writes (never follows links)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in owners:
            return ""
        handle.seek(max(0, info.st_size - size))
        return handle.read(size).decode("utf-8", "replace")


def file_size(path: str) -> int:
    """Size of a file, 0 when absent."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def read_text(path: Path) -> str:
    """A small system file's text ('' when it cannot be read)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""
