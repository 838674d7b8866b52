"""The lab cluster: real containers that the controller reaches over SSH like servers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NAME = "pytest-lab"


def ansible(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_FORCE_COLOR": "0"},
        check=False,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    return proc


def docker_names(kind: str, by: str) -> list[str]:
    """Containers or networks of this test's lab, found by label or by name."""
    selector = f"label=io.llama-cluster.lab={NAME}" if by == "label" else f"name={NAME}"
    out = subprocess.run(
        [
            "docker",
            kind,
            "ls",
            *(["--all"] if kind == "container" else []),
            "--filter",
            selector,
            "--format",
            "{{.Name}}" if kind == "network" else "{{.Names}}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in out.stdout.split() if line]


@pytest.fixture
def lab(tmp_path: Path):
    """Lab play arguments that keep this test's lab apart from the user's."""
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    inventory = tmp_path / "lab.yml"
    extra = [
        "-e",
        f"lab_cluster_name={NAME}",
        "-e",
        f"lab_cluster_inventory_path={inventory}",
        "-e",
        f"lab_cluster_state_dir={tmp_path / 'state'}",
    ]
    yield inventory, extra
    ansible("ansible-playbook", "playbooks/lab.yml", "-e", "lab_state=absent", *extra, check=False)


@pytest.mark.lab
@pytest.mark.parametrize("nodes", [2, 4])
def test_lab_nodes_answer_over_ssh_and_are_removed_on_stop(lab, nodes):
    inventory, extra = lab
    ansible("ansible-playbook", "playbooks/lab.yml", "-e", f"lab_nodes={nodes}", *extra)

    assert len(docker_names("container", by="label")) == nodes
    assert docker_names("network", by="label") == [NAME]

    ping = ansible("ansible", "all", "-i", str(inventory), "-m", "ansible.builtin.ping", "-o")
    assert ping.stdout.count("SUCCESS") == nodes
    assert ping.stdout.count('"ping": "pong"') + ping.stdout.count("ping: pong") == nodes

    groups = ansible("ansible-inventory", "-i", str(inventory), "--graph")
    assert "@master:" in groups.stdout
    assert f"{NAME}-node1" in groups.stdout.split("@workers:")[0]

    ansible("ansible-playbook", "playbooks/lab.yml", "-e", "lab_state=absent", *extra)
    assert docker_names("container", by="name") == []
    assert docker_names("network", by="name") == []
    assert not inventory.exists()


@pytest.mark.lab
def test_every_lab_node_has_its_own_host_key(lab):
    inventory, extra = lab
    ansible("ansible-playbook", "playbooks/lab.yml", "-e", "lab_nodes=2", *extra)
    keys = ansible(
        "ansible",
        "all",
        "-i",
        str(inventory),
        "-o",
        "-m",
        "ansible.builtin.command",
        "-a",
        "cat /etc/ssh/ssh_host_ed25519_key.pub",
    )
    fingerprints = {line.split()[-2] for line in keys.stdout.splitlines() if "ssh-ed25519" in line}
    assert len(fingerprints) == 2
