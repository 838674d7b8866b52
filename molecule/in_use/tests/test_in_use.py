"""Verify the in_use scenario: a server in use keeps its SSH, its rules, its service, its sysctl,
and a server whose ufw is off keeps it off and its service reachable.

Runs under `molecule verify -s in_use` after the plan (plan.yml), converge and idempotence. The
plan's tests come first: the later tests change the nodes. The nodes are inspected with the docker
connection; the playbooks below reach them as a real controller does, over SSH on port 2222 with
the key prepare.yml made.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
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


Snapshot = dict[str, set[str]]


def snapshot(text: str) -> Snapshot:
    """The snapshot script's output (snapshot.yml) as {section: lines}."""
    sections: Snapshot = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("== "):
            current = line[3:]
            sections[current] = set()
        elif current:
            sections[current].add(line)
    return sections


def recorded(phase: str, name: str) -> Snapshot:
    return snapshot((ephemeral() / "plan" / f"{phase}-{name}.txt").read_text())


def now(name: str) -> Snapshot:
    play = yaml.safe_load((PROJECT / "molecule/in_use/snapshot.yml").read_text())[0]
    script = play["tasks"][0]["ansible.builtin.shell"]["cmd"]
    return snapshot(node(name).check_output(f"bash -c {shlex.quote(script)}"))


def runs() -> list[dict]:
    """The plan log's lines of converge.yml: the plan, then converge and idempotence."""
    lines = (ephemeral() / "plan" / "plan.jsonl").read_text().splitlines()
    return [run for run in map(json.loads, lines) if run["playbook"] == "converge.yml"]


def paths(lines: set[str]) -> set[str]:
    return {line.split(" ", 1)[0] for line in lines}


def covers(named: str, path: str) -> bool:
    """Whether a path the plan named accounts for this one (itself, below it, or its parent)."""
    return path == named or path.startswith(named + "/") or named.startswith(path + "/")


def test_the_plan_changes_nothing_on_the_nodes() -> None:
    for name in (NODE1, NODE2):
        assert recorded("before", name) == recorded("planned", name), name


def test_the_plan_lists_what_the_real_run_then_did_category_by_category() -> None:
    plan, converge, idempotence = runs()[:3]
    assert [plan["check"], converge["check"], idempotence["check"]] == [True, False, False]
    assert plan["hosts"] == converge["hosts"]
    assert not any(idempotence["hosts"].values()), idempotence["hosts"]
    for name in (NODE1, NODE2):
        listed = plan["hosts"][name]
        before, after = recorded("before", name), now(name)
        # Files: every path that appeared or changed is one the plan named, inside one, or a
        # parent directory made for one.
        changed = paths(after["files"] - before["files"])
        named = {text.split(" ", 1)[0].rstrip("/") for text in listed.get("files", [])}
        unnamed = {path for path in changed if not any(covers(n, path) for n in named)}
        assert not unnamed, (name, unnamed)
        # ufw: one rule added for each rule command the plan listed, none removed.
        rules = [c for c in listed.get("firewall", []) if c.startswith("ufw allow")]
        new_rules = {r for r in after["ufw"] - before["ufw"] if r.startswith("ufw allow")}
        assert len(new_rules) == len(rules), (name, new_rules, rules)
        assert not {r for r in before["ufw"] - after["ufw"] if r.startswith("ufw allow")}
        # What the plan did not list did not change.
        for section, category in (("packages", "packages"), ("sysctls", "sysctls"),
                                  ("users", "users"), ("services", "services")):  # fmt: skip
            assert (before[section] != after[section]) == bool(listed.get(category)), (
                name, section, before[section] ^ after[section],
            )  # fmt: skip


def test_the_plan_shows_the_server_in_use_and_the_server_with_ufw_off_apart() -> None:
    listed = runs()[0]["hosts"]
    # node1's ufw is already on with the operator's rules: the nodes' rules are added, ufw is not
    # enabled again, and no SSH rule: the operator's `2222/tcp mine-ssh` already allows it.
    assert "ufw --force enable" not in listed[NODE1]["firewall"]
    assert [c for c in listed[NODE1]["firewall"] if "llama-cluster nodes" in c]
    assert not [c for c in listed[NODE1]["firewall"] if "2222" in c]
    assert not listed[NODE1].get("sysctls")
    # node2's ufw is off: nothing at all in the firewall.
    assert not listed[NODE2].get("firewall")


def test_sshd_listens_on_2222_only_and_answers_the_controller() -> None:
    for name in (NODE1, NODE2):
        assert node(name).socket(f"tcp://0.0.0.0:{SSH_PORT}").is_listening
        assert not node(name).socket("tcp://0.0.0.0:22").is_listening
        result = ssh(name, "hostname")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == name


def test_the_operator_s_identical_ssh_rule_is_not_relabelled() -> None:
    rules = added(NODE1)
    assert f"ufw allow {SSH_PORT}/tcp comment 'mine-ssh'" in rules
    assert not [rule for rule in rules if "llama-cluster ssh" in rule], rules
    assert "Status: active" in node(NODE1).check_output("ufw status")


def test_ufw_that_was_off_stays_off_and_the_foreign_service_still_answers() -> None:
    assert node(NODE2).check_output("ufw status") == "Status: inactive"
    assert added(NODE2) == ["(None)"]
    assert node(NODE2).service("foreign-exporter").is_running
    with urllib.request.urlopen(f"http://{address(NODE2)}:9100/", timeout=5) as reply:
        assert reply.status == 200


def test_the_operator_s_rule_and_service_are_untouched() -> None:
    rules = added(NODE1)
    assert rules[:2] == ["ufw allow 8080", f"ufw allow {SSH_PORT}/tcp comment 'mine-ssh'"]
    assert node(NODE1).service("foreign-http").is_running
    with urllib.request.urlopen(f"http://{address(NODE1)}:8080/", timeout=5) as reply:
        assert reply.status == 200


def test_the_operator_s_port_range_is_unchanged() -> None:
    live = node(NODE1).file("/proc/sys/net/ipv4/ip_local_port_range").content_string.split()
    assert live == ["20000", "29000"]
    assert not node(NODE1).file("/etc/sysctl.d/60-llama-cluster-nccl.conf").exists


def test_the_node_whose_ufw_is_on_lets_every_node_in() -> None:
    rules = added(NODE1)
    for peer in (NODE1, NODE2):
        assert f"ufw allow from {address(peer)} comment 'llama-cluster nodes'" in rules


def test_a_run_over_ssh_on_2222_changes_nothing() -> None:
    result = playbook([NODE1, NODE2])
    assert result.returncode == 0, said(result)[-3000:]
    assert "changed=0" in result.stdout
    assert not re.search(r"changed=[1-9]", result.stdout), result.stdout[-3000:]


def test_narrowing_ssh_s_sources_never_deletes_the_operator_s_rule() -> None:
    # The probe of issue 40: ssh from the controller's network only, then from anyone again.
    network = str(ipaddress.ip_interface(
        node(NODE1).check_output("ip -o -f inet addr show eth0").split()[3]
    ).network)  # fmt: skip
    mine = f"ufw allow {SSH_PORT}/tcp comment 'mine-ssh'"
    ours = f"ufw allow from {network} to any port {SSH_PORT} proto tcp comment 'llama-cluster ssh'"
    narrowed = playbook(
        [NODE1, NODE2], "--limit", NODE1, "--tags", "firewall",
        "-e", json.dumps({"firewall_ssh_sources": [network]}),
    )  # fmt: skip
    assert narrowed.returncode == 0, said(narrowed)[-3000:]
    assert mine in added(NODE1)
    assert ours in added(NODE1)
    widened = playbook([NODE1, NODE2], "--limit", NODE1, "--tags", "firewall")
    assert widened.returncode == 0, said(widened)[-3000:]
    assert mine in added(NODE1)
    assert ours not in added(NODE1)
    assert "left under their own comment" in said(widened)
    assert ssh(NODE1, "true").returncode == 0


def test_a_lock_out_is_rolled_back_to_ufw_off_and_names_the_node() -> None:
    before = node(NODE2).check_output("ufw status verbose"), added(NODE2)
    # Asked to turn node2's ufw on, with SSH only from an address the controller does not have:
    # the new connection must fail, and ufw goes back off.
    result = playbook(
        [NODE1, NODE2], "--limit", NODE2, "--tags", "firewall",
        "-e", json.dumps({"firewall_enable_inactive_ufw": True,
                          "firewall_ssh_sources": ["192.0.2.1"],
                          "firewall_connection_check_timeout": 10}),
    )  # fmt: skip
    assert result.returncode != 0
    assert f"after ufw changed on {NODE2}, the controller could not open a new SSH" in said(result)
    assert "ufw was rolled back" in said(result)
    assert (node(NODE2).check_output("ufw status verbose"), added(NODE2)) == before
    assert ssh(NODE2, "true").returncode == 0
    with urllib.request.urlopen(f"http://{address(NODE2)}:9100/", timeout=5) as reply:
        assert reply.status == 200


def test_asked_to_the_node_turns_its_ufw_on_with_ssh_allowed_first() -> None:
    result = playbook(
        [NODE1, NODE2], "--limit", NODE2, "--tags", "firewall",
        "-e", '{"firewall_enable_inactive_ufw": true}',
    )  # fmt: skip
    assert result.returncode == 0, said(result)[-3000:]
    # The service that only the cluster's nodes reach from now on is named.
    assert "no rule names these listening TCP ports" in said(result)
    assert "9100/tcp (python3)" in said(result)
    rules = added(NODE2)
    assert f"ufw allow {SSH_PORT}/tcp comment 'llama-cluster ssh'" in rules
    assert not [rule for rule in rules if rule.startswith("ufw allow 22/")]
    for peer in (NODE1, NODE2):
        assert f"ufw allow from {address(peer)} comment 'llama-cluster nodes'" in rules
    assert "Status: active" in node(NODE2).check_output("ufw status")
    assert ssh(NODE2, "true").returncode == 0


def test_a_node_taken_out_of_the_inventory_loses_its_rules_on_the_others() -> None:
    gone = address(NODE2)
    result = playbook([NODE1], "--tags", "firewall")
    assert result.returncode == 0, said(result)[-3000:]
    rules = added(NODE1)
    assert not [rule for rule in rules if gone in rule], rules
    assert f"ufw allow from {address(NODE1)} comment 'llama-cluster nodes'" in rules
    assert rules[:2] == ["ufw allow 8080", f"ufw allow {SSH_PORT}/tcp comment 'mine-ssh'"]
    assert ssh(NODE1, "true").returncode == 0
