"""Out of memory: the kernel's OOM killer (host memory) or torch's CUDA out-of-memory error;
and out of disk: the checkpoints' filesystem full.

What a failed attempt ran out of, from the unit's cgroup counters, the node's counter, the
kernel log, the command's own output and the checkpoints' filesystem; and the words that name
it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .untrusted import read_text

CGROUP_ROOT = Path("/sys/fs/cgroup")
GIB = float(1 << 30)
UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
SIZE = r"([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)"
# torch's message, in both shapes (groups: tried, GPU, total, free). Since torch 2.1:
# "Tried to allocate 2.30 GiB. GPU 0 has a total capacity of 79.10 GiB of which 400.00 MiB is free";
# before: "Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; ...; 3.19 MiB free; ...)".
CUDA_OOM = (
    re.compile(
        rf"CUDA out of memory\. Tried to allocate {SIZE}\. GPU (\d+) has a total capac\w* of "
        rf"{SIZE} of which {SIZE} is free"
    ),
    re.compile(
        rf"CUDA out of memory\. Tried to allocate {SIZE} \(GPU (\d+); {SIZE} total capacity;"
        rf"[^)]*?; {SIZE} free"
    ),
)
RANK_PREFIX = re.compile(r"^\s*\[rank(\d+)\]:")  # torch.distributed's prefix of a rank's traceback
# torchrun's ChildFailedError summary ("rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: 8393)")
# and its elastic agent's line ("failed (exitcode: -9) local_rank: 0 (pid: 8393) of binary").
TORCHRUN_FAILURE = re.compile(
    r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)"
)
AGENT_FAILURE = re.compile(r"failed \(exitcode:\s*(-?\d+)\)\s*local_rank:\s*\d+\s*\(pid:\s*(\d+)\)")
# The kernel's two lines on an OOM kill (the global killer's and a memory cgroup's).
OOM_VICTIM = re.compile(r"out of memory: Killed process (\d+) \(([^)]*)\)", re.IGNORECASE)
OOM_SUMMARY = re.compile(r"oom-kill:.*?\btask=([^,]*),pid=(\d+),uid=(\d+)")
OOM_LINE = re.compile(r"Killed process \d+|oom-kill:")
# A write that failed for space: Python's OSError, safetensors' (Rust) and torch's zip writer.
DISK_FULL = re.compile(
    r"No space left on device|\[Errno 28\]|ENOSPC|StorageFull|Disk quota exceeded|"
    r"file write failed",
    re.IGNORECASE,
)
FULL_BYTES = 64 << 20  # a filesystem with less free than this (or 2 %) is full
ANON_RSS = re.compile(r"anon-rss:(\d+)kB")
VICTIM_UID = re.compile(r"\bUID:(\d+)")


def counter(text: str, key: str) -> int | None:
    """The value of a `key N` line (memory.events, memory.oom_control, /proc/vmstat)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def cgroup_dir(proc_cgroup: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The directory of a process's memory cgroup, from its /proc/<pid>/cgroup.

    The v1 memory controller's hierarchy where it is mounted, else the unified (v2) one.
    """
    unified = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        relative = parts[2].strip().lstrip("/")
        if "memory" in parts[1].split(","):
            return root / "memory" / relative
        if parts[1] == "":
            unified = root / relative
    return unified


def unit_cgroup(unit: str, proc_cgroup: str, root: Path = CGROUP_ROOT) -> Path | None:
    """The memory cgroup systemd made for a unit, when this process runs in it; else None."""
    directory = cgroup_dir(proc_cgroup, root)
    return directory if directory is not None and directory.name == f"{unit}.service" else None


def cgroup_oom_kills(directory: Path) -> int | None:
    """Processes of a cgroup the OOM killer has killed (v2 memory.events, v1 memory.oom_control)."""
    for name in ("memory.events", "memory.oom_control"):
        found = counter(read_text(directory / name), "oom_kill")
        if found is not None:
            return found
    return None


def oom_counters(cgroup: Path | None, vmstat: Path = Path("/proc/vmstat")) -> dict[str, int | None]:
    """OOM kills so far: on the node (since boot) and in the job's cgroup (None: unknown)."""
    return {
        "node": counter(read_text(vmstat), "oom_kill"),
        "cgroup": cgroup_oom_kills(cgroup) if cgroup is not None else None,
    }


def cgroup_number(directory: Path, *names: str) -> int | None:
    """The first of a cgroup's files that holds a number, in bytes; None for none or no limit."""
    for name in names:
        text = read_text(directory / name).strip()
        if text.isdigit():
            return int(text) if int(text) < 1 << 60 else None  # v1 says "no limit" so
    return None


def memory_limit(proc_cgroup: str, root: Path = CGROUP_ROOT) -> tuple[int, Path] | None:
    """The tightest memory limit a process is under, and the cgroup that sets it.

    Its memory cgroup's limit and every parent's up to the hierarchy's root (v2 memory.max, v1
    memory.limit_in_bytes): a container's limit is usually a parent's, as a unit's cgroup sits
    below the container's. v1's hierarchical_memory_limit (memory.stat) also counts the parents
    a container's own view of the hierarchy hides. None where no limit is set.
    """
    leaf = cgroup_dir(proc_cgroup, root)
    if leaf is None:
        return None
    top = root / "memory" if leaf.is_relative_to(root / "memory") else root
    found: list[tuple[int, int, Path]] = []  # (bytes, 1 for a hierarchical figure, cgroup)
    directory = leaf
    while True:
        if directory.is_dir():
            own = cgroup_number(directory, "memory.max", "memory.limit_in_bytes")
            if own is not None:
                found.append((own, 0, directory))
            stated = counter(read_text(directory / "memory.stat"), "hierarchical_memory_limit")
            if stated is not None and stated < 1 << 60:
                found.append((stated, 1, directory))
        if directory in (top, directory.parent):
            break
        directory = directory.parent
    # a tie goes to the cgroup whose own limit it is, not to a child that inherits it
    best = min(found, key=lambda limit: limit[:2]) if found else None
    return (best[0], best[2]) if best is not None else None


def cgroup_name(directory: Path, root: Path = CGROUP_ROOT) -> str:
    """A cgroup's path as /proc/<pid>/cgroup writes it (/docker/<id>/system.slice/x.service)."""
    for top in (root / "memory", root):
        if directory.is_relative_to(top):
            relative = directory.relative_to(top).as_posix()
            return "/" if relative == "." else f"/{relative}"
    return str(directory)


def memory_figures(
    cgroup: Path | None,
    proc_cgroup: str = "",
    meminfo: Path = Path("/proc/meminfo"),
    root: Path = CGROUP_ROOT,
) -> dict[str, Any]:
    """The memory a job's processes had, in bytes: the node's MemTotal, the tightest limit of
    the process's cgroup and its parents (`proc_cgroup`: its /proc/<pid>/cgroup) with that
    cgroup's path, and the peak use of that cgroup (else of the unit's, `cgroup`)."""
    total = next(
        (int(line.split()[1]) * 1024 for line in read_text(meminfo).splitlines()
         if line.startswith("MemTotal:") and line.split()[1].isdigit()),
        None,
    )  # fmt: skip
    limited = memory_limit(proc_cgroup, root) if proc_cgroup else None
    if limited is None and cgroup is not None:
        own = cgroup_number(cgroup, "memory.max", "memory.limit_in_bytes")
        limited = (own, cgroup) if own is not None else None
    peaks = ("memory.peak", "memory.max_usage_in_bytes")
    peak = cgroup_number(limited[1], *peaks) if limited is not None else None
    if peak is None and cgroup is not None:
        peak = cgroup_number(cgroup, *peaks)
    if peak is not None and limited is not None and peak > limited[0]:
        # v1's high-water mark dates from before a lowered limit (docker update): the cgroup
        # was at its limit when the kernel killed
        peak = limited[0]
    return {
        "total": total,
        "limit": limited[0] if limited is not None else None,
        "limit_cgroup": cgroup_name(limited[1], root) if limited is not None else None,
        "unit_limited": limited is not None and cgroup is not None and limited[1] == cgroup,
        "peak": peak,
    }


def kernel_oom_kills(text: str, pids: set[int], uid: int | None = None) -> list[dict[str, Any]]:
    """The OOM killer's victims among `pids` in kernel log text, in the log's order.

    Each: pid, process name and, where the kernel printed them, its uid and anonymous resident
    memory in bytes. A victim of another uid than `uid` is not the job's (a reused pid).
    """
    found: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        killed, summary = OOM_VICTIM.search(line), OOM_SUMMARY.search(line)
        if killed:
            rss, owner = ANON_RSS.search(line), VICTIM_UID.search(line)
            entry = {
                "pid": int(killed.group(1)),
                "process": killed.group(2),
                "uid": int(owner.group(1)) if owner else None,
                "rss": int(rss.group(1)) * 1024 if rss else None,
            }
        elif summary:
            entry = {
                "pid": int(summary.group(2)),
                "process": summary.group(1),
                "uid": int(summary.group(3)),
                "rss": None,
            }
        else:
            continue
        if entry["pid"] in pids:
            merged = found.setdefault(entry["pid"], entry)
            merged.update({k: v for k, v in entry.items() if merged.get(k) is None})
    return [e for e in found.values() if uid is None or e["uid"] in (None, uid)]


def read_kernel_log(since: float) -> str | None:
    """Kernel messages since a time: the journal's, else the ring buffer's (None: unreadable)."""
    journal = None
    sources = (
        ["journalctl", "-k", "-q", "--no-pager", "-o", "cat", f"--since=@{int(since)}"],
        ["dmesg"],
    )
    for command in sources:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode != 0:
            continue
        if OOM_LINE.search(done.stdout) or command[0] == "dmesg":
            return done.stdout
        journal = done.stdout  # an empty journal may only mean this user may not read it
    return journal or None


def reported_failures(text: str) -> list[dict[str, Any]]:
    """The failed processes a launcher's output names: rank (when it says), exit status, pid."""
    found: dict[int, dict[str, Any]] = {}
    for rank, code, pid in TORCHRUN_FAILURE.findall(text):
        found[int(pid)] = {"rank": int(rank), "exit_status": int(code), "pid": int(pid)}
    for code, pid in AGENT_FAILURE.findall(text):
        found.setdefault(int(pid), {"rank": None, "exit_status": int(code), "pid": int(pid)})
    return [entry for entry in found.values() if entry["exit_status"] != 0]


def oom_kill_evidence(
    before: dict[str, int | None],
    after: dict[str, int | None],
    kernel_log: Callable[[], str | None],
    pids: set[int],
    uid: int | None,
) -> dict[str, Any] | None:
    """Whether the OOM killer killed one of `pids` (a job's processes that died by SIGKILL).

    The job cgroup's counter decides when there is one; else the node's counter says whether
    the killer ran at all, and the kernel log whom it killed. The log is read only when needed.
    Returns {"source": "cgroup" | "kernel log" | "node", "victim": {...} | None}, or None.
    """

    def rose(key: str) -> bool | None:
        old, new = before.get(key), after.get(key)
        return None if old is None or new is None else new > old

    in_cgroup, on_node = rose("cgroup"), rose("node")
    if in_cgroup is False or (in_cgroup is None and on_node is False):
        return None
    text = kernel_log()
    victims = kernel_oom_kills(text or "", pids, uid)
    if in_cgroup or victims:
        return {"source": "cgroup" if in_cgroup else "kernel log", "victim": (victims or [None])[0]}
    if on_node and text is None:
        return {"source": "node", "victim": None}  # it ran; the log that says whom is unreadable
    return None


def gib(value: object) -> float | None:
    """Bytes as GiB with one decimal (None for anything but a number)."""
    return round(value / GIB, 1) if isinstance(value, (int, float)) else None


def host_oom_cause(
    evidence: dict[str, Any], failures: list[dict[str, Any]], memory: dict[str, int | None]
) -> dict[str, Any]:
    """The cause record of an OOM kill: which rank or process, and the memory figures."""
    victim = evidence.get("victim") or {}
    killed = [f for f in failures if f["exit_status"] == -signal.SIGKILL]
    if victim:
        rank = next((f["rank"] for f in killed if f["pid"] == victim["pid"]), None)
    else:
        rank = killed[0]["rank"] if killed else None
    total, limit = memory.get("total"), memory.get("limit")
    by_cgroup = limit is not None and (total is None or limit < total)
    return {
        "kind": "host_oom",
        "source": evidence["source"],
        "rank": rank,
        "pid": victim.get("pid"),
        "process": victim.get("process"),
        "rss_gib": gib(victim.get("rss")),
        "peak_gib": gib(memory.get("peak")),
        "total_gib": gib(limit if by_cgroup else total),
        # what set the limit: the node's RAM, the job's own unit, or a cgroup above the job
        # (a container's, a slice's), named by its path
        "limit": ("unit" if memory.get("unit_limited") else "cgroup") if by_cgroup else "host",
        "limit_cgroup": memory.get("limit_cgroup") if by_cgroup else None,
    }


def cuda_oom(text: str, failures: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first CUDA out-of-memory error in a log: its rank, GPU and figures in GiB."""
    for line in text.splitlines():
        found = next((m for p in CUDA_OOM if (m := p.search(line))), None)
        if found is None:
            continue
        prefix = RANK_PREFIX.match(line)
        failed = [f["rank"] for f in failures if f["rank"] is not None]
        return {
            "kind": "gpu_oom",
            "rank": int(prefix.group(1)) if prefix else (failed[0] if failed else None),
            "gpu": int(found.group(3)),
            "tried_gib": gib(float(found.group(1)) * UNIT_BYTES[found.group(2)]),
            "free_gib": gib(float(found.group(6)) * UNIT_BYTES[found.group(7)]),
            "total_gib": gib(float(found.group(4)) * UNIT_BYTES[found.group(5)]),
        }
    return None


def disk_full(text: str, directory: str) -> dict[str, Any] | None:
    """The checkpoints' filesystem, full, where the output says a write failed for space and
    `directory`'s filesystem has next to nothing free (so the words name the right disk)."""
    if not directory or not DISK_FULL.search(text):
        return None
    try:
        found = os.statvfs(directory)
    except OSError:
        return None
    free, total = found.f_bavail * found.f_frsize, found.f_blocks * found.f_frsize
    if free > max(FULL_BYTES, total // 50):
        return None
    return {"kind": "disk_full", "path": directory, "free_bytes": free, "total_bytes": total}


def size_words(value: object) -> str:
    """'12.0 KiB', '3.5 GiB': bytes as people read them."""
    amount = float(value) if isinstance(value, int | float) else 0.0
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if amount < 1024 or unit == "GiB":
            return f"{amount:,.0f} bytes" if unit == "bytes" else f"{amount:,.1f} {unit}"
        amount /= 1024
    return ""


def describe_cause(cause: dict[str, Any], node: str, step: object = None) -> str:
    """A failure's cause in words, naming the rank (or process) and the node."""
    if cause.get("kind") == "disk_full":
        when = f" after step {step}" if step is not None else ""
        return (
            f"the disk of {cause.get('path')} on {node} is full{when}: "
            f"{size_words(cause.get('free_bytes'))} free of {size_words(cause.get('total_bytes'))}"
        )
    rank, pid = cause.get("rank"), cause.get("pid")
    who = (
        f"rank {rank}"
        if rank is not None
        else f"pid {pid} ({cause.get('process')})"
        if pid is not None
        else "a process of the job"
    )
    if cause.get("kind") == "gpu_oom":
        when = f" after step {step}" if step is not None else ""
        return (
            f"{who} on {node} ran out of GPU memory{when}: tried to allocate "
            f"{cause.get('tried_gib')} GiB, {cause.get('free_gib')} of {cause.get('total_gib')} "
            "GiB free"
        )
    total = cause.get("total_gib")
    if cause.get("source") == "node":
        return (
            f"{who} on {node} was killed as the kernel's OOM killer ran there (host memory: "
            f"{total} GiB; the kernel log, which names its victim, is not readable to the job)"
        )
    if cause.get("limit") == "unit":
        limit = "its unit's memory limit; "
    elif cause.get("limit") == "cgroup":
        limit = f"the memory limit of cgroup {cause.get('limit_cgroup')}; "
    else:
        limit = ""
    if total is None:
        figures = ""
    elif cause.get("peak_gib") is not None:
        figures = f": {cause['peak_gib']} of {total} GiB in use"
    elif cause.get("rss_gib") is not None:
        figures = f": it held {cause['rss_gib']} of {total} GiB"
    else:
        figures = f" ({total} GiB)"
    return f"the kernel killed {who} on {node} for host memory{figures} ({limit}OOM killer)"
