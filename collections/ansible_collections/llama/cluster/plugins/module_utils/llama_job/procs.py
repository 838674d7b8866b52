"""Processes and sockets on this node, read from /proc."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
from pathlib import Path
from typing import Any


def boot_id() -> str:
    """This boot's id: a record from an earlier boot describes no live process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def proc_stat(pid: int) -> dict[str, Any] | None:
    """State, parent, process group, session, start time (clock ticks) and owner of a process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        uid = os.stat(f"/proc/{pid}").st_uid
    except (OSError, ValueError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return {
        "pid": pid,
        "state": fields[0],
        "ppid": int(fields[1]),
        "pgrp": int(fields[2]),
        "session": int(fields[3]),
        "start": int(fields[19]),
        "uid": uid,
    }


def all_pids() -> list[int]:
    """Every process id on this node."""
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def command_line(pid: int) -> str:
    """A process's command line, or '?' when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part) or "?"


def session_members(sid: int, uid: int | None = None, since: int = 0) -> list[int]:
    """Processes in a session (owned by `uid`, started at or after `since` ticks)."""
    found = []
    for pid in all_pids():
        info = proc_stat(pid)
        if (
            info
            and info["session"] == sid
            and info["start"] >= since
            and (uid is None or info["uid"] == uid)
            and info["state"] != "Z"
        ):
            found.append(pid)
    return found


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux 3.4+): a rank whose
    launcher died is then still below the agent, and is found and ended with the rest."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return False


def descendants(roots: list[int], uid: int | None = None) -> list[int]:
    """Every live descendant of `roots` (owned by `uid`), by parent pid: what a process started,
    in whatever session or process group it put them. torch's elastic agent starts each rank with
    start_new_session, so a rank is in neither the agent's session nor the command's group.
    A zombie links its children too: /proc read while a launcher dies may show a rank's parent
    already a zombie and the rank not yet handed to the subreaper (such a rank was missed)."""
    children: dict[int, list[int]] = {}
    zombies = set()
    for pid in all_pids():
        info = proc_stat(pid)
        if info and (uid is None or info["uid"] == uid):
            children.setdefault(info["ppid"], []).append(pid)
            if info["state"] == "Z":
                zombies.add(pid)
    found: list[int] = []
    frontier = list(roots)
    seen = set(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in seen:
                seen.add(child)
                if child not in zombies:
                    found.append(child)
                frontier.append(child)
    return found


def listening_inodes(port: int) -> dict[int, str]:
    """Socket inodes listening on a TCP port (IPv4 and IPv6), each with its local address."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != "0A":  # 0A: LISTEN
                continue
            address, _, hex_port = parts[1].rpartition(":")
            if int(hex_port, 16) == port:
                found[int(parts[9])] = address
    return found


def socket_owners(inodes: set[int], among: list[int] | None = None) -> dict[int, list[int]]:
    """The processes holding each socket inode (of `among`, else of all this user may inspect)."""
    owners: dict[int, list[int]] = {inode: [] for inode in inodes}
    if not inodes:
        return owners
    for pid in all_pids() if among is None else among:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in owners:
                    owners[inode].append(pid)
    return owners


def listeners(port: int) -> list[dict[str, Any]]:
    """Who listens on a TCP port: pid, user and command where this user can read them."""
    inodes = listening_inodes(port)
    owners = socket_owners(set(inodes))
    found = []
    for pids in owners.values():
        if not pids:
            found.append({"port": port, "pid": None, "user": None, "command": None})
        for pid in pids:
            info = proc_stat(pid) or {}
            try:
                user = pwd.getpwuid(info["uid"]).pw_name if "uid" in info else None
            except KeyError:
                user = str(info.get("uid"))
            found.append(
                {
                    "port": port,
                    "pid": pid,
                    "user": user,
                    "command": command_line(pid)[:300],
                    "session": info.get("session"),
                }
            )
    return found


def describe_listener(entry: dict[str, Any]) -> str:
    """'pid 123 (python3 -m http.server 29500, user root)'."""
    if entry.get("pid") is None:
        return "a process this user cannot inspect"
    return f"pid {entry['pid']} ({entry['command']}, user {entry['user']})"


def busy_ports(ports: list[int]) -> list[str]:
    """'port 29500 is in use by pid 7 (...)' for every listener on one of the ports."""
    return [
        f"port {entry['port']} is in use by {describe_listener(entry)}"
        for port in ports
        for entry in listeners(int(port))
    ]
