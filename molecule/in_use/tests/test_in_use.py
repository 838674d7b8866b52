"""Verify the in_use scenario: a server in use keeps its SSH, its rules, its service, its sysctl.

Runs under `molecule verify -s in_use` after converge and idempotence. The nodes are inspected
with the docker connection; the playbooks below reach them as a real controller does, over SSH on
port 2222 with the key prepare.yml made.
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
import testinfra
import yaml

PREFIX = os.environ.get("LLAMA_MOLECULE_PREFIX", "mol")
NODE1, NODE2 = f"{PREFIX}-in-use-node1", f"{PREFIX}-in-use-node2"
PROJECT = Path(__file__).resolve().parents[3]
SSH_PORT = 2222


def node(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"docker://{name}")


def address(name: str) -> str:
    return node(name).interface("eth0").addresses[0]


def ephemeral() -> Path:
    directory = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY")
    if not directory:
        pytest.skip("MOLECULE_EPHEMERAL_DIRECTORY is not set: run through `molecule verify`")
    return Path(directory)


def ssh(name: str, command: str) -> subprocess.CompletedProcess[str]:
    """A new SSH connection from the controller to the node's port 2222, as an operator opens."""
    return subprocess.run(
        ["ssh", "-p", str(SSH_PORT), "-i", str(ephemeral() / "id_in_use"), "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         "-o", "ConnectTimeout=5", f"debian@{address(name)}", command],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


def playbook(hosts: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    """playbooks/wiring.yml against an inventory of these hosts, reached over SSH on 2222."""
    inventory = ephemeral() / f"in_use_ssh_{len(hosts)}.yml"
    connection = {
        "ansible_host": None,
        "ansible_port": SSH_PORT,
        "ansible_user": "debian",
        "ansible_become": True,
        "ansible_ssh_private_key_file": str(ephemeral() / "id_in_use"),
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
    }
    content = {
        "all": {
            "children": {
                "master": {"hosts": {hosts[0]: None}},
                "workers": {"hosts": {name: None for name in hosts[1:]}},
                "cluster": {
                    "hosts": {name: {**connection, "ansible_host": address(name)} for name in hosts}
                },
            }
        }
    }
    inventory.write_text(yaml.safe_dump(content))
    env = dict(os.environ)
    env["ANSIBLE_CONFIG"] = str(ephemeral() / "ansible.cfg")
    env.setdefault("ANSIBLE_ROLES_PATH", str(PROJECT / "roles"))
    env.setdefault(
        "ANSIBLE_COLLECTIONS_PATH", f"{PROJECT / 'collections'}:{PROJECT / '.cache/collections'}"
    )
    env["ANSIBLE_VARS_ENABLED"] = "llama.cluster.llama_defaults,llama.cluster.llama_group_vars"
    env["ANSIBLE_PIPELINING"] = "true"
    env["ANSIBLE_NOCOLOR"] = "1"
    # The lab's CPU settings (molecule/shared/group_vars), as molecule links them.
    shared = PROJECT / "molecule/shared/group_vars/cluster.yml"
    return subprocess.run(
        ["ansible-playbook", "-i", str(inventory), "-e", f"@{shared}",
         str(PROJECT / "playbooks/wiring.yml"), *extra],
        capture_output=True, text=True, cwd=PROJECT, env=env, timeout=600, check=False,
    )  # fmt: skip


def said(result: subprocess.CompletedProcess[str]) -> str:
    return " ".join((result.stdout + result.stderr).split())


def added(name: str) -> list[str]:
    return node(name).check_output("ufw show added").splitlines()[1:]


def test_sshd_listens_on_2222_only_and_answers_the_controller() -> None:
    for name in (NODE1, NODE2):
        assert node(name).socket(f"tcp://0.0.0.0:{SSH_PORT}").is_listening
        assert not node(name).socket("tcp://0.0.0.0:22").is_listening
        result = ssh(name, "hostname")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == name


def test_ufw_opens_sshd_s_real_port_and_no_other_ssh_port() -> None:
    for name in (NODE1, NODE2):
        rules = added(name)
        assert f"ufw allow {SSH_PORT}/tcp comment 'llama-cluster ssh'" in rules
        assert not [rule for rule in rules if rule.startswith("ufw allow 22/")]
        assert "Status: active" in node(name).check_output("ufw status")


def test_the_operator_s_rule_and_service_are_untouched() -> None:
    rules = added(NODE1)
    assert rules[0] == "ufw allow 8080"
    assert node(NODE1).service("foreign-http").is_running
    with urllib.request.urlopen(f"http://{address(NODE1)}:8080/", timeout=5) as reply:
        assert reply.status == 200


def test_the_operator_s_port_range_is_unchanged() -> None:
    live = node(NODE1).file("/proc/sys/net/ipv4/ip_local_port_range").content_string.split()
    assert live == ["20000", "29000"]
    assert not node(NODE1).file("/etc/sysctl.d/60-llama-cluster-nccl.conf").exists


def test_the_nodes_reach_each_other_and_only_each_other() -> None:
    for name in (NODE1, NODE2):
        rules = added(name)
        for peer in (NODE1, NODE2):
            assert f"ufw allow from {address(peer)} comment 'llama-cluster nodes'" in rules


def test_a_run_over_ssh_on_2222_changes_nothing() -> None:
    result = playbook([NODE1, NODE2])
    assert result.returncode == 0, said(result)[-3000:]
    assert "changed=0" in result.stdout
    assert not re.search(r"changed=[1-9]", result.stdout), result.stdout[-3000:]


def test_a_lock_out_is_rolled_back_and_names_the_node() -> None:
    before = node(NODE1).check_output("ufw status verbose")
    # SSH only from an address the controller does not have: a new connection must fail.
    result = playbook(
        [NODE1, NODE2], "--limit", NODE1, "--tags", "firewall",
        "-e", '{"firewall_ssh_sources": ["192.0.2.1"], "firewall_connection_check_timeout": 10}',
    )  # fmt: skip
    assert result.returncode != 0
    assert f"after ufw changed on {NODE1}, the controller could not open a new SSH" in said(result)
    assert "ufw was rolled back" in said(result)
    assert node(NODE1).check_output("ufw status verbose") == before
    assert ssh(NODE1, "true").returncode == 0


def test_a_node_taken_out_of_the_inventory_loses_its_rules_on_the_others() -> None:
    gone = address(NODE2)
    result = playbook([NODE1], "--tags", "firewall")
    assert result.returncode == 0, said(result)[-3000:]
    rules = added(NODE1)
    assert not [rule for rule in rules if gone in rule], rules
    assert f"ufw allow from {address(NODE1)} comment 'llama-cluster nodes'" in rules
    assert rules[0] == "ufw allow 8080"
    assert ssh(NODE1, "true").returncode == 0
