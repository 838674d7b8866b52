"""check.yml's link measurement on the real lab while connections without the check's key hold
every node's link server (issue 45): the server used to take one connection at a time, 3 s each,
so four idle connections from a host without the key made the genuine measurement fail after
10 s. Here 50 idle keyless connections to every node's link port are kept open through the whole
check (each one the servers close is opened again), and every pair is measured.

The check writes the local fact llama_links on every node, which the planner reads: the fact each
node had before is put back afterwards, so the lab's other tests plan as they did. It needs the
lab's nodes, not the training stack (the link checks run the node's own python3).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import _read_inventory
from train_runner import DEFAULT_INVENTORY, Cluster

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
FACT = "/etc/ansible/facts.d/llama_links.fact"
IDLE = 50

pytestmark = pytest.mark.lab


def _docker(host: str, *command: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "exec", "-i", host, *command],
        input=stdin, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


@pytest.fixture
def facts_kept(lab_hosts: list[str]) -> Iterator[None]:
    """Each node's llama_links fact as it was, put back after the test."""
    kept = {host: _docker(host, "cat", FACT) for host in lab_hosts}
    yield
    for host, before in kept.items():
        if before.returncode == 0:
            _docker(host, "sh", "-c", f"cat > {FACT}", stdin=before.stdout)
        else:
            _docker(host, "rm", "-f", FACT)


class Hold:
    """IDLE idle connections, never a byte sent, to one address and port, opened again as the
    server closes them, until stopped."""

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self.most = 0  # the most connections held open at once
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._hold, daemon=True)
        self.thread.start()

    def _hold(self) -> None:
        held: list[socket.socket] = []
        while not self.stop.is_set():
            held = [s for s in held if not _closed(s)]
            while len(held) < IDLE and not self.stop.is_set():
                try:
                    held.append(socket.create_connection((self.address, self.port), timeout=2))
                except OSError:
                    break  # not listening yet (or any more)
            self.most = max(self.most, len(held))
            time.sleep(0.2)
        for sock in held:
            sock.close()


def _closed(sock: socket.socket) -> bool:
    """Whether the other side closed it (what it sent, its greeting, is read and dropped)."""
    sock.setblocking(False)
    try:
        while True:
            if not sock.recv(4096):
                sock.close()
                return True
    except BlockingIOError:
        return False
    except OSError:
        sock.close()
        return True


def test_fifty_idle_keyless_connections_to_every_node_leave_every_link_measured(
    lab: Cluster, lab_hosts: list[str], facts_kept: None
) -> None:
    _groups, hostvars = _read_inventory(DEFAULT_INVENTORY)
    network = yaml.safe_load((ROOT / "group_vars/all/network.yml").read_text())
    port = int(network["master_port"])  # preflight_links_port's default
    holds = [Hold(str(hostvars[host]["ansible_host"]), port) for host in lab_hosts]
    started = time.monotonic()
    try:
        done = subprocess.run(
            [str(ANSIBLE_PLAYBOOK), "-i", str(DEFAULT_INVENTORY), "playbooks/check.yml",
             "-e", '{"preflight_checks": ["links"]}'],
            cwd=ROOT, capture_output=True, text=True, check=False, timeout=900,
        )  # fmt: skip
    finally:
        for hold in holds:
            hold.stop.set()
        for hold in holds:
            hold.thread.join(timeout=10)
    took = time.monotonic() - started
    said = " ".join(done.stdout.split())
    print(f"check.yml (links) in {took:.0f} s; idle connections held: {[h.most for h in holds]}")
    assert done.returncode == 0, said[-4000:]
    assert [hold.most for hold in holds] == [IDLE] * len(holds)  # the servers were held
    for a in lab_hosts:
        for b in lab_hosts:
            if a != b:
                assert f"{a} to {b} on " in said, said[-4000:]
    assert "no TCP stream from" not in said
    assert "Gbit/s" in said
