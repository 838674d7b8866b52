"""llama-job's procs.py: who listens on a port."""

from __future__ import annotations

import os
import socket

from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    procs,
)


def test_listeners_name_the_process_that_holds_a_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        found = procs.listeners(port)
        busy = procs.busy_ports([port])
    assert [entry["pid"] for entry in found] == [os.getpid()]
    assert "pytest" in found[0]["command"] or "python" in found[0]["command"]
    assert f"port {port} is in use by pid {os.getpid()}" in busy[0]
    assert procs.busy_ports([port]) == []


def test_a_rank_below_a_launcher_that_is_already_a_zombie_is_still_found(monkeypatch):
    # Issue 39's lab: a frozen rank outlived its attempt. /proc read while torchrun died showed
    # torchrun a zombie and the rank (in a session of its own) still its child: the zombie was
    # left out of the tree, so the rank was unreachable from the agent and never killed.
    table = {
        100: {"ppid": 1, "state": "S", "uid": 1000},  # the agent
        200: {"ppid": 100, "state": "Z", "uid": 1000},  # torchrun, dead, not yet reaped
        300: {"ppid": 200, "state": "T", "uid": 1000},  # the frozen rank
        301: {"ppid": 200, "state": "Z", "uid": 1000},  # its sibling, dead
        400: {"ppid": 1, "state": "S", "uid": 1000},  # not the agent's
    }
    monkeypatch.setattr(procs, "all_pids", lambda: list(table))
    monkeypatch.setattr(procs, "proc_stat", table.get)
    assert procs.descendants([100], 1000) == [300]  # the zombies are links, not targets
    assert procs.descendants([100], 0) == []  # another account's processes are never signalled
