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


def playbook(
    path: str, *extra: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
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
    env.update(env_extra or {})
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


@pytest.fixture
def facts_aside() -> Iterator[None]:
    """The local facts prepare recorded (host_facts, llamafactory) moved aside, then back."""
    for name in NODES:
        node(name).check_output(
            "mkdir -p /root/facts-aside && mv %s/* /root/facts-aside/", FACTS_DIR
        )
    yield
    for name in NODES:
        node(name).check_output("mv /root/facts-aside/* %s/ && rmdir /root/facts-aside", FACTS_DIR)


FACTS_DIR = "/etc/ansible/facts.d"


@pytest.mark.usefixtures("facts_aside")
def test_check_without_provisioning_says_run_provision_first() -> None:
    result = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["consistency"]}')
    assert result.returncode != 0
    assert "run provision.yml first" in said(result)


def _fact(name: str, fact: str) -> dict:
    return json.loads(node(name).file(f"{FACTS_DIR}/{fact}.fact").content_string)


@pytest.fixture
def odd_torch() -> Iterator[str]:
    """One node whose recorded torch differs from the others'."""
    odd = NODES[2]
    saved = node(odd).file(f"{FACTS_DIR}/llama_stack.fact").content_string
    stack = dict(json.loads(saved), torch="2.10.0")
    node(odd).check_output("printf '%%s' %s > %s/llama_stack.fact", json.dumps(stack), FACTS_DIR)
    yield odd
    node(odd).check_output("printf '%%s' %s > %s/llama_stack.fact", saved, FACTS_DIR)


def test_check_consistency_table_then_names_the_node_with_another_torch(odd_torch: str) -> None:
    torch = _fact(NODES[0], "llama_stack")["torch"]
    # The recorded versions (live ones would win: the mounted stack is the same on every node).
    recorded = '{"preflight_checks": ["consistency"], "preflight_read_installed": false}'
    failed = playbook("playbooks/check.yml", "-e", recorded)
    assert failed.returncode != 0
    assert "torchaudio" in failed.stdout
    assert f"{odd_torch}: torch is 2.10.0, but {torch} on {NODES[0]}, {NODES[1]}" in said(failed)


def test_full_check_passes_with_allreduce_and_records_the_links() -> None:
    result = playbook("playbooks/check.yml")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "all-reduce ok: gloo, 3 processes" in said(result)
    assert "bus bandwidth" in said(result)
    for name in NODES:
        links = _fact(name, "llama_links")
        assert links["ifname"] == "eth0"
        assert links["interfaces"]["eth0"]["address"] == address(name)
        assert sorted(links["peers"]) == sorted(set(NODES) - {name})
        for peer in links["peers"].values():
            assert peer["ifname"] == "eth0"
            assert peer["tcp_gbps"] > 0.05  # a veth pair: gigabits at least
            assert 0 < peer["rtt_ms"] < 100
        allreduce = links["allreduce"]
        assert (allreduce["backend"], allreduce["nodes"], allreduce["world_size"]) == ("gloo", 3, 3)
        assert allreduce["busbw_gbps"] > 0
        assert allreduce["sum_correct"] is True


# ---- the go/no-go on a 10 Mbit/s link, measured ------------------------------------------------
# The lab's containers have no GPUs and the planner models communication for GPU nodes only: the
# nodes declare one H200 each (their llama_host fact, cluster_accelerator=nvidia for the run);
# the link is what check.yml measures under the shaping.
SLOW_MBIT = 10
H200 = {"index": 0, "name": "NVIDIA H200", "memory_mib": 143771}


@pytest.fixture
def slow_links() -> Iterator[str]:
    """Every node's eth0 limited to 10 Mbit/s: netem where the kernel has it, else tbf (the
    qdisc used is returned)."""
    used = "netem"
    for name in NODES:
        host = node(name)
        netem = host.run(f"tc qdisc replace dev eth0 root netem rate {SLOW_MBIT}mbit delay 1ms")
        if netem.rc != 0:
            used = "tbf"
            host.check_output(
                f"tc qdisc replace dev eth0 root tbf rate {SLOW_MBIT}mbit burst 16kb latency 50ms"
            )
    yield used
    for name in NODES:
        node(name).run("tc qdisc del dev eth0 root")


@pytest.fixture
def declared_h200() -> Iterator[None]:
    """Each node's llama_host fact names one H200 (the recorded one is put back after)."""
    saved = {name: node(name).file(f"{FACTS_DIR}/llama_host.fact").content_string for name in NODES}
    for name, content in saved.items():
        host = dict(json.loads(content), gpus=[H200], gpu_count=1)
        node(name).check_output("printf '%%s' %s > %s/llama_host.fact", json.dumps(host), FACTS_DIR)
    yield
    for name, content in saved.items():
        node(name).check_output("printf '%%s' %s > %s/llama_host.fact", content, FACTS_DIR)


@pytest.mark.usefixtures("declared_h200")
def test_a_measured_10_mbit_link_refuses_zero3_and_accepts_ddp_with_accumulation(
    slow_links: str, tmp_path: Path
) -> None:
    # The links only (the all-reduce is test_full_check's): the planner then takes the slowest
    # TCP stream between two nodes.
    measured = playbook("playbooks/check.yml", "-e", '{"preflight_checks": ["links"]}')
    assert measured.returncode == 0, said(measured)[-3000:]
    for name in NODES:
        links = _fact(name, "llama_links")
        for peer in links["peers"].values():
            assert 0.5 * SLOW_MBIT / 1e3 < peer["tcp_gbps"] < 1.2 * SLOW_MBIT / 1e3, (
                slow_links,
                links,
            )
        assert "allreduce" not in links  # not measured by this run

    # Molecule's ansible.cfg caches no facts: train.yml reads the GPU nodes' facts (links too).
    gpus = ("-e", "cluster_accelerator=nvidia", "-e", "model=tiny")
    refused = playbook("train.yml", *gpus, "-e", "deepspeed=zero3")
    out = said(refused)
    assert refused.returncode != 0
    assert "Refused before launch: 3 nodes would" in out, out[-3000:]
    figure = re.search(r"\(link ([0-9.]+) Gbit/s, check.yml's slowest TCP stream", out)
    assert figure, out[-3000:]
    assert float(figure.group(1)) < 1.2 * SLOW_MBIT / 1e3
    assert "plan deepspeed=zero3" in out
    assert "Ways out: fewer nodes:" in out
    assert "a faster link: at least" in out
    assert "-e allow_slow_scaling=true" in out
    assert "Train | Prepare every node" not in out  # refused before any node play

    # The same link, DDP with accumulation: train.yml plans it and the go/no-go passes (--check:
    # the inventory check and the plan, on the controller; no node play runs).
    accumulate = {
        "train_args": {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 64}
    }
    # 64 micro-steps of every process need more records than demo_alpaca's 28 (the plan refuses
    # an effective batch beyond the dataset): its records, repeated.
    demo = json.loads((PROJECT / "data" / "demo_alpaca.json").read_text())
    large = tmp_path / "large_alpaca.json"
    large.write_text(json.dumps([demo[i % len(demo)] for i in range(8192)]))
    ddp = ("-e", "deepspeed=none", "-e", json.dumps(accumulate), "--check")
    ddp += ("-e", f"dataset_file={large}", "-e", "dataset_format=alpaca")
    accepted = playbook("train.yml", *gpus, *ddp)
    out = said(accepted)
    assert accepted.returncode == 0, out[-3000:]
    assert "deepspeed=none, micro-batch 1 x accumulation 64" in out
    assert re.search(
        r"Scaling \(predicted, per added node\): 1 node .* 3 nodes [0-9,]+ tokens/s", out
    )
    assert "Refused" not in out
    assert "Link between nodes: 0.0" in out
    assert f"slowest TCP stream, {PREFIX}-cluster-node" in out  # (YAML doubles the quote)


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
