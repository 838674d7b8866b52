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
