"""check.yml's link measurement on the real lab while connections without the check's key hold
every node's link server (issue 45), from a peer inside the cluster: the server used to take one
connection at a time, 3 s each, so four idle connections from a host without the key made the
genuine measurement fail after 10 s. Here 50 idle keyless connections to every node's link port
are kept open through the whole check (each one the servers close is opened again), and every
pair is measured.

The check writes the local fact llama_links on every node, which the planner reads: the fact each
node had before is put back afterwards, so the lab's other tests plan as they did. It needs the
lab's nodes, not the training stack (the link checks run the node's own python3).
"""

from __future__ import annotations

import subprocess
import sys
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


# Run with the node's own python3 on a peer of the node it holds: a provisioned node's ufw admits
# its port from the cluster's nodes alone, so a host without the key inside the cluster is where
# such connections come from. It holds IDLE connections (never a byte sent), opening again each
# one the server closes, until the file `stop` exists; then prints the most it held at once.
HOLD = """
import os, socket, sys, time
address, port, idle, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def closed(sock):
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
held, most = [], 0
while not os.path.exists(stop):
    held = [s for s in held if not closed(s)]
    while len(held) < idle and not os.path.exists(stop):
        try:
            held.append(socket.create_connection((address, port), timeout=2))
        except OSError:
            break
    most = max(most, len(held))
    time.sleep(0.2)
print(most)
"""


class Hold:
    """IDLE idle connections from `peer` to `address`:`port`, held until stopped."""

    def __init__(self, peer: str, address: str, port: int) -> None:
        self.peer, self.stop_file = peer, f"/tmp/llama-hold-{address}-{port}.stop"
        _docker(peer, "rm", "-f", self.stop_file)
        self.process = subprocess.Popen(
            ["docker", "exec", "-i", peer, "python3", "-", address, str(port), str(IDLE),
             self.stop_file],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdin is not None
        self.process.stdin.write(HOLD)
        self.process.stdin.close()

    def stopped(self) -> int:
        """Stop holding; the most connections held open at once."""
        _docker(self.peer, "touch", self.stop_file)
        assert self.process.stdout is not None
        out = self.process.stdout.read()  # its stdin is closed: no communicate()
        self.process.wait(timeout=30)
        _docker(self.peer, "rm", "-f", self.stop_file)
        return int(out.strip() or 0)


def test_fifty_idle_keyless_connections_to_every_node_leave_every_link_measured(
    lab: Cluster, lab_hosts: list[str], facts_kept: None
) -> None:
    _groups, hostvars = _read_inventory(DEFAULT_INVENTORY)
    network = yaml.safe_load((ROOT / "group_vars/all/network.yml").read_text())
    port = int(network["master_port"])  # preflight_links_port's default
    peers = {host: next(h for h in lab_hosts if h != host) for host in lab_hosts}
    holds = [Hold(peers[h], str(hostvars[h]["ansible_host"]), port) for h in lab_hosts]
    started = time.monotonic()
    try:
        done = subprocess.run(
            [str(ANSIBLE_PLAYBOOK), "-i", str(DEFAULT_INVENTORY), "playbooks/check.yml",
             "-e", '{"preflight_checks": ["links"]}'],
            cwd=ROOT, capture_output=True, text=True, check=False, timeout=900,
        )  # fmt: skip
    finally:
        most = [hold.stopped() for hold in holds]
    took = time.monotonic() - started
    said = " ".join(done.stdout.split())
    print(f"check.yml (links) in {took:.0f} s; idle connections held: {most}")
    assert done.returncode == 0, said[-4000:]
    assert most == [IDLE] * len(holds)  # the servers were held
    for a in lab_hosts:
        for b in lab_hosts:
            if a != b:
                assert f"{a} to {b} on " in said, said[-4000:]
    assert "no TCP stream from" not in said
    assert "Gbit/s" in said
