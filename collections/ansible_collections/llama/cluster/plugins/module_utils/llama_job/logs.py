"""What a node's log and rank 0's trainer log say: the error lines, the exit status a launcher
reports, whether a failure only echoes another node's, progress records and the stall rule."""

from __future__ import annotations

import os
import re
import shlex
import stat
from typing import Any

from .protocol import progress_record
from .untrusted import parse_json, tail_untrusted

# Lines worth showing from a failed node's log, and those that only echo another node's failure.
ERROR_LINE = re.compile(
    r"error|exception|traceback|killed|signal \d|sig[a-z]+\)|exitcode|failed|out of memory|"
    r"\(local_rank: \d+\)",  # torchrun's summary names the process that failed: its rank
    re.IGNORECASE,
)
NOISE_LINE = re.compile(r"^\s*(warnings\.warn|warn\(|[-=]{8,}\s*$)", re.IGNORECASE)
PEER_SYMPTOM = re.compile(
    r"connection (closed|reset) by peer|broken pipe|ncclRemoteError|communicator was aborted|"
    r"DistNetworkError|DistBackendError|socket timeout|connection refused|"
    r"gloo/transport|recvValue|failed to recv|Timed out waiting|watchdog caught collective",
    re.IGNORECASE,
)


def first_error_lines(text: str, limit: int = 12) -> list[str]:
    """The lines that say what went wrong: error-looking lines first, else the last lines."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("[llama-job")]
    picked: list[str] = []
    for line in lines:
        if ERROR_LINE.search(line) and not NOISE_LINE.search(line) and line not in picked:
            picked.append(line[:400])
    if not picked:
        return [line[:400] for line in lines[-limit:]]
    return picked[:limit]


# How a launcher reports the exit status of the process that failed (torchrun's ChildFailedError
# summary: "exitcode : -9", and its elastic agent's "failed (exitcode: -9)"); negative is a signal.
REPORTED_EXIT = re.compile(r"\bexitcode\s*:\s*(-?\d+)")


def reported_exit_status(text: str) -> int | None:
    """The failed process's exit status as the command's output reports it, if it does."""
    found = [int(code) for code in REPORTED_EXIT.findall(text)]
    failed = [code for code in found if code != 0]
    return failed[-1] if failed else None


# torchrun's ChildFailedError summary: the process whose failure came first, by its global rank.
ROOT_CAUSE = re.compile(
    r"Root Cause[^\n]*\n(?:.*\n){0,4}?\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)"
)


def failed_rank(text: str) -> str:
    """'rank 3 (local rank 1)': the process torchrun names as the first to fail ("" if none)."""
    found = ROOT_CAUSE.findall(text)
    if not found:
        return ""
    rank, local = found[-1]
    return f"rank {rank} (local rank {local})"


def is_peer_symptom(errors: list[str]) -> bool:
    """True when a failure's lines only say that another node went away."""
    return any(PEER_SYMPTOM.search(line) for line in errors)


def last_record(path: str) -> dict[str, Any]:
    """The figures of the last JSON record of a trainer log (protocol.progress_record), or {}:
    the last 8 KiB read, no link followed (the training code writes the log, whatever it
    holds)."""
    text = tail_untrusted(path, (os.getuid(),), 8192)
    for line in reversed(text.splitlines()):
        try:
            record = parse_json(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            return progress_record(record)
    return {}


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def stall_limit(intervals: list[float], timeouts: dict[str, float], seen_any: bool) -> float:
    """Seconds without a new progress record after which a run counts as stalled."""
    if not seen_any:
        return timeouts["stall_startup"]
    if not intervals:
        return timeouts["stall_floor"]
    return max(timeouts["stall_floor"], timeouts["stall_factor"] * median(intervals))


def read_env_file(text: str) -> dict[str, str]:
    """KEY="value" lines, as systemd's EnvironmentFile reads them."""
    env = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        parts = shlex.split(value) if value.strip() else [""]
        env[key.strip()] = parts[0] if parts else ""
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """Replace ${NAME} with the job's environment, as systemd does in ExecStart."""
    return re.sub(r"\$\{(\w+)\}", lambda match: env.get(match.group(1), ""), arg)


# A node's log is rotated once it passes max_bytes (llama-job's own lines and the command's
# output alike, written to one file): its content moves to <log>.1, the older ones shift up to
# <log>.<keep>, the oldest goes. So it holds at most (keep + 1) x max_bytes on the node's disk
# (plus what is written between two looks), which the plan's disk check counts.
DEFAULT_ROTATE = {"max_bytes": 64 << 20, "keep": 3}


def rotated_name(path: str, index: int) -> str:
    """The name of a rotated log (index 1 is the newest)."""
    return f"{path}.{index}"


def rotate_log(path: str, log_fd: int, keep: int) -> bool:
    """Rotate the log that `log_fd` appends to (copy, then truncate: the command and the agent
    keep the one descriptor they write through). Nothing is followed through a link; a line
    written between the copy and the truncation is lost (logrotate's copytruncate does the
    same). Whether it rotated."""
    folder, name = os.path.split(path)
    directory = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        reader = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
        try:
            if not stat.S_ISREG(os.fstat(reader).st_mode):
                return False
            newest = _shift(directory, name, max(1, keep))
            try:
                while chunk := os.read(reader, 1 << 20):
                    os.write(newest, chunk)
            finally:
                os.close(newest)
        finally:
            os.close(reader)
        os.ftruncate(log_fd, 0)
        return True
    finally:
        os.close(directory)


def _shift(directory: int, name: str, keep: int) -> int:
    """Shift <log>.1 .. <log>.<keep> up one (the last one gone); a new <log>.1, created without
    following a link, open for writing."""
    for index in range(keep, 0, -1):
        older = rotated_name(name, index)
        try:
            if index == keep:
                os.unlink(older, dir_fd=directory)
            else:
                newer = rotated_name(name, index + 1)
                os.replace(older, newer, src_dir_fd=directory, dst_dir_fd=directory)
        except FileNotFoundError:
            continue
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(rotated_name(name, 1), flags, 0o640, dir_fd=directory)
