"""Verify the cluster scenario: real ufw, real TCP, the real check playbook.

Runs under `molecule verify -s cluster` (or by hand after `molecule converge -s cluster`).
Nodes are reached with the docker connection.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import testinfra

# Container names carry a prefix so that two checkouts can run the scenario side by side.
PREFIX = os.environ.get("LLAMA_MOLECULE_PREFIX", "mol")
NODES = [f"{PREFIX}-cluster-node{i}" for i in (1, 2, 3)]
MASTER, WORKERS = NODES[0], NODES[1:]
OUTSIDER = f"{PREFIX}-cluster-outsider"
USER = "llama"
MASTER_PORT = 29500
PROJECT = Path(__file__).resolve().parents[3]


def node(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"docker://{name}")


def address(name: str) -> str:
    return node(name).interface("eth0").addresses[0]


def playbook(path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run a project playbook against the scenario's inventory, as molecule would."""
    inventory = os.environ.get("MOLECULE_INVENTORY_FILE")
    if not inventory:
        pytest.skip("MOLECULE_INVENTORY_FILE is not set: run through `molecule verify -s cluster`")
    env = dict(os.environ)
    ephemeral = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY")
    if ephemeral and "ANSIBLE_CONFIG" not in env:
        env["ANSIBLE_CONFIG"] = f"{ephemeral}/ansible.cfg"
    env.setdefault("ANSIBLE_ROLES_PATH", str(PROJECT / "roles"))
    # The project's collection (llama.cluster) and the third-party ones.
    env.setdefault(
        "ANSIBLE_COLLECTIONS_PATH", f"{PROJECT / 'collections'}:{PROJECT / '.cache/collections'}"
    )
    env["ANSIBLE_PIPELINING"] = "true"
    env["ANSIBLE_NOCOLOR"] = "1"
    return subprocess.run(
        ["ansible-playbook", "-i", inventory, str(PROJECT / path), *extra],
        capture_output=True,
        text=True,
        cwd=PROJECT,
        env=env,
        timeout=600,
        check=False,
    )


def said(result: subprocess.CompletedProcess[str]) -> str:
    """The playbook's output (failures go to stderr), with the YAML callback's wrapping undone."""
    return " ".join((result.stdout + result.stderr).split())


def stack_present() -> bool:
    """True when provision.yml ran: every node has the provisioning facts and torchrun."""
    return all(
        node(name).file("/etc/ansible/facts.d/llama_stack.fact").exists
        and node(name).file("/opt/llama-cluster/env/bin/torchrun").exists
        for name in NODES
    )


def test_every_node_resolves_every_other_by_inventory_name() -> None:
    addresses = {name: address(name) for name in NODES}
    for source in NODES:
        hosts = node(source).file("/etc/hosts").content_string
        for target, ip in addresses.items():
            assert f"{ip} {target}\n" in hosts
            assert node(source).check_output("getent hosts %s", target).split()[0] == ip


def test_no_cluster_key_is_left_on_any_node() -> None:
    # roles/ssh_mesh removes the mesh of earlier releases: no node can ssh to another.
    for name in NODES:
        host = node(name)
        assert not host.file(f"/home/{USER}/.ssh/id_ed25519_llama_cluster").exists
        keys = host.file(f"/home/{USER}/.ssh/authorized_keys")
        assert not keys.exists or "@llama-cluster" not in keys.content_string


def test_sshd_settings_are_untouched() -> None:
    for name in NODES:
        host = node(name)
        assert not host.file("/etc/ssh/sshd_config.d").listdir()
        settings = host.check_output("sshd -T")
        assert "pubkeyauthentication yes" in settings
        assert "permitrootlogin without-password" in settings


NODES_COMMENT = ["#", "llama-cluster", "nodes"]


def test_ufw_denies_by_default_and_opens_training_ports_to_cluster_nodes_only() -> None:
    addresses = [address(name) for name in NODES]
    for name in NODES:
        status = node(name).check_output("ufw status verbose")
        assert "Status: active" in status
        assert "Default: deny (incoming), allow (outgoing)" in status
        rules = [line.split() for line in status.splitlines()]
        # Every port, but only from the nodes: one rule per node, marked as the project's.
        sources = {
            rule[3]
            for rule in rules
            if rule[:3] == ["Anywhere", "ALLOW", "IN"]
            and rule[4:] == ["#", "llama-cluster", "nodes"]
        }
        assert sources == set(addresses), f"{name}: {sources}"
        ssh_rule = next(rule[:4] for rule in rules if rule[:1] == ["22/tcp"])
        assert ssh_rule == ["22/tcp", "ALLOW", "IN", "Anywhere"]


@pytest.fixture
def master_listener() -> Iterator[None]:
    """A real listener on the master port of the master for the duration of a test."""
    host = node(MASTER)
    host.check_output(
        f"systemd-run --collect --unit={PREFIX}-cluster-listener --property=RuntimeMaxSec=120"
        " python3 -c %s",
        "import socket,time\n"
        "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('0.0.0.0', {MASTER_PORT})); s.listen(8)\n"
        "while True: s.accept()[0].close()\n",
    )
    host.run(f"timeout 10 sh -c 'until ss -ltn | grep -q :{MASTER_PORT}; do sleep 0.2; done'")
    yield
    host.run(f"systemctl stop {PREFIX}-cluster-listener")


def connects(source: str, target_ip: str, port: int) -> bool:
    probe = (
        "import socket,sys\n"
        f"try: socket.create_connection(('{target_ip}', {port}), timeout=4).close()\n"
        "except OSError as e: sys.exit(str(e))\n"
    )
    return node(source).run("python3 -c %s", probe).rc == 0


@pytest.mark.usefixtures("master_listener")
def test_master_port_is_open_to_cluster_nodes_and_closed_to_an_outsider() -> None:
    master_ip = address(MASTER)
    for worker in WORKERS:
        assert connects(worker, master_ip, MASTER_PORT)
    # Same Docker network but not a cluster node: ufw drops it, while SSH answers (the path works).
    assert connects(OUTSIDER, master_ip, 22)
    assert not connects(OUTSIDER, master_ip, MASTER_PORT)


def test_nccl_interface_fact_points_at_the_route_to_the_master() -> None:
    for name in NODES:
        fact = json.loads(node(name).file("/etc/ansible/facts.d/llama_network.fact").content_string)
        assert fact["ifname"] == "eth0"
        assert fact["address"] == address(name)
        assert fact["master_address"] == address(MASTER)


def test_check_reachability_passes() -> None:
    result = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["reachability"]}')
    assert result.returncode == 0, result.stdout[-3000:]


def test_check_fails_naming_the_worker_when_the_master_port_is_blocked() -> None:
    master, blocked = node(MASTER), WORKERS[1]
    rule = f"from {address(blocked)}"
    master.check_output(f"ufw delete allow {rule}")
    try:
        result = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["reachability"]}')
    finally:
        master.check_output(f"ufw allow {rule} comment 'llama-cluster nodes'")
    assert result.returncode != 0
    assert f"{blocked} cannot open a TCP connection to the master {MASTER}" in said(result)
    assert WORKERS[0] + " cannot" not in said(result)


@pytest.mark.skipif("stack_present()", reason="the provisioning facts exist")
def test_check_without_provisioning_says_run_provision_first() -> None:
    result = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["consistency"]}')
    assert result.returncode != 0
    assert "run provision.yml first" in said(result)


FACTS = {
    "llama_host": {
        "os": {"id": "debian", "version": "12", "codename": "bookworm", "key": "debian-12"},
        "driver_loaded": False,
        "driver_version": None,
        "cuda_version": None,
        "gpu_count": 0,
        "gpus": [],
    },
    "llama_stack": {
        "python": "3.11.2",
        "torch": "2.11.0",
        "torchaudio": "2.11.0",
        "torchvision": "0.26.0",
        "transformers": "5.6.0",
        "llamafactory": "0.9.5",
        "deepspeed": "0.19.8",
        "accelerate": "1.11.0",
        "peft": "0.18.1",
        "torch_cuda": None,
        "nccl": None,
    },
}


@pytest.fixture
def provisioning_facts() -> Iterator[None]:
    """The local facts provision.yml writes (host_facts, llamafactory), as plain fact files."""
    for name in NODES:
        for fact, content in FACTS.items():
            node(name).check_output(
                "printf '%%s' %s > /etc/ansible/facts.d/%s.fact", json.dumps(content), fact
            )
    yield
    for name in NODES:
        for fact in FACTS:
            node(name).run("rm -f /etc/ansible/facts.d/%s.fact", fact)


@pytest.mark.skipif("stack_present()", reason="real provisioning facts exist; not overwritten")
@pytest.mark.usefixtures("provisioning_facts")
def test_check_consistency_table_then_names_the_node_with_another_torch() -> None:
    passed = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["consistency"]}')
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert "torchaudio" in passed.stdout
    assert "2.11.0" in passed.stdout

    odd = NODES[2]
    stack = dict(FACTS["llama_stack"], torch="2.10.0")
    node(odd).check_output(
        "printf '%%s' %s > /etc/ansible/facts.d/llama_stack.fact", json.dumps(stack)
    )
    failed = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["consistency"]}')
    assert failed.returncode != 0
    assert f"{odd}: torch is 2.10.0, but 2.11.0 on {NODES[0]}, {NODES[1]}" in said(failed)


@pytest.mark.skipif("not stack_present()", reason="needs provision.yml in converge (torch stack)")
def test_full_check_passes_with_allreduce() -> None:
    result = playbook("playbooks/check.yml")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "all-reduce ok" in result.stdout
    assert "bus bandwidth" in result.stdout


def test_bad_input_fails_before_any_node_is_changed() -> None:
    inverted = '{"nccl_port_range_start": 41000, "nccl_port_range_end": 40000}'
    result = playbook("playbooks/wiring.yml", "-e", inverted)
    assert result.returncode != 0
    # The inventory check (the first play of every playbook) refuses it, on the controller.
    assert f"nccl_port_range_start of {NODES[0]} (41000) is above nccl_port_range_end" in said(
        result
    )
    assert "changed=0" in result.stdout
    assert not re.search(r"changed=[1-9]", result.stdout)


def test_firewall_disabled_leaves_ufw_exactly_as_it_is() -> None:
    before = {name: node(name).check_output("ufw status verbose") for name in NODES}
    off = playbook(
        "playbooks/wiring.yml", "--tags", "firewall", "-e", '{"firewall_enabled": false}'
    )
    assert off.returncode == 0, said(off)[-3000:]
    assert "changed=0" in off.stdout
    for name in NODES:
        assert node(name).check_output("ufw status verbose") == before[name]
