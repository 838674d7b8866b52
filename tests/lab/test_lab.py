"""The lab cluster: real containers that the controller reaches over SSH like servers, and what
provision.yml makes of them.

The first tests start labs of their own (`own_lab`, apart from the user's). The others check the
nodes of the lab `make test` starts after provision.yml ran on it through the API
(tests/conftest.py, `provisioned`, shared with tests/lab/test_runner.py's lab tests): every node
runs
the pinned stack from cluster_env_dir."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import testinfra
import yaml
from testinfra.host import Host

from train_runner import DEFAULT_INVENTORY, Cluster

ROOT = Path(__file__).resolve().parents[2]
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
def own_lab(tmp_path: Path):
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
def test_lab_nodes_answer_over_ssh_and_are_removed_on_stop(own_lab):
    nodes = 3  # more than the default 2, started side by side
    inventory, extra = own_lab
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
def test_every_lab_node_has_its_own_host_key(lab_hosts: list[str]):
    keys = {
        subprocess.run(
            ["docker", "exec", host, "cat", "/etc/ssh/ssh_host_ed25519_key.pub"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[1]
        for host in lab_hosts
    }
    assert len(keys) == len(lab_hosts)


# --------------------------------------------------------------------------------------------
# A provisioned node: every lab node after provision.yml (its second run changing nothing is
# tests/lab/test_runner.py's test_lab_provision_reports_every_node)
# --------------------------------------------------------------------------------------------
ENV = "/opt/llama-cluster/env"
ENV_BIN = f"{ENV}/bin"


@pytest.fixture(scope="module")
def nodes(provisioned: Cluster, lab_hosts: list[str]) -> list[Host]:
    return [testinfra.get_host(f"docker://{name}") for name in lab_hosts]


@pytest.mark.lab
def test_lab_provision_reports_every_node(provisioned: Cluster):
    # The fixture asserted it; a second run must change nothing (idempotence through the API).
    # Here, on the nodes as the fixture left them: test_lab_long_runs.py later kills and starts
    # a node's container again, which this check does not cover.
    result = provisioned.provision()
    assert all(s.changed == 0 for s in result.hosts.values()), result.hosts


def run(host: Host, command: str) -> str:
    result = host.run(command)
    assert result.rc == 0, f"{host.backend.name}: {command}: {result.stdout}{result.stderr}"
    return result.stdout


@pytest.mark.lab
def test_pinned_torch_trio_imports(nodes: list[Host]) -> None:
    for host in nodes:
        out = run(
            host,
            f"{ENV_BIN}/python -c 'import torch, torchvision, torchaudio;"
            " print(torch.__version__, torchvision.__version__, torchaudio.__version__)'",
        )
        # PyPI's 2.11.0 trio is the CUDA 13.0 build: every version carries the same local tag.
        versions = [v.split("+") for v in out.split()]
        assert [v[0] for v in versions] == ["2.11.0", "0.26.0", "2.11.0"]
        assert {v[1] for v in versions} == {"cu130"}


@pytest.mark.lab
def test_llamafactory_cli_reports_the_pinned_version(nodes: list[Host]) -> None:
    for host in nodes:
        assert "0.9.5" in run(host, f"{ENV_BIN}/llamafactory-cli version")


@pytest.mark.lab
def test_torchrun_resolves_from_the_env_bin_for_the_training_user(nodes: list[Host]) -> None:
    for host in nodes:
        out = run(
            host,
            f"runuser -u llama -- env PATH={ENV_BIN}:/usr/bin:/bin sh -c 'command -v torchrun'",
        )
        assert out.strip() == f"{ENV_BIN}/torchrun"
        run(host, f"runuser -u llama -- {ENV_BIN}/torchrun --help")


@pytest.mark.lab
def test_deepspeed_imports_at_the_pinned_version(nodes: list[Host]) -> None:
    for host in nodes:
        out = run(host, f"{ENV_BIN}/python -c 'import deepspeed; print(deepspeed.__version__)'")
        assert out.strip().splitlines()[-1] == "0.19.8"


@pytest.mark.lab
def test_no_host_wide_port_range_is_pinned_by_default(nodes: list[Host]) -> None:
    # The firewall lets the nodes reach each other on every port instead (roles/firewall).
    for host in nodes:
        live = host.file("/proc/sys/net/ipv4/ip_local_port_range").content_string.split()
        assert live != ["40000", "40999"]
        assert not host.file("/etc/sysctl.d/60-llama-cluster-nccl.conf").exists


@pytest.mark.lab
def test_llama_stack_fact_records_the_stack(nodes: list[Host]) -> None:
    for host in nodes:
        fact = json.loads(host.file("/etc/ansible/facts.d/llama_stack.fact").content_string)
        assert fact["torch"] == "2.11.0"
        assert fact["llamafactory"] == "0.9.5"
        assert fact["deepspeed"] == "0.19.8"
        assert fact["transformers"] == "5.6.0"
        assert fact["python"].startswith("3.11.")
        assert fact["torch_cuda"] == "13.0"  # PyPI's build, running on the lab's CPU
        assert "llamafactory_env" in fact
        for key in ("torchaudio", "torchvision", "accelerate", "peft", "nccl"):
            assert key in fact


@pytest.mark.lab
def test_llama_host_fact_describes_a_cpu_debian_node(nodes: list[Host]) -> None:
    for host in nodes:
        fact = json.loads(host.file("/etc/ansible/facts.d/llama_host.fact").content_string)
        assert fact["os"]["key"] == "debian-12"
        assert fact["gpu_count"] == 0
        assert fact["gpus"] == []
        assert fact["driver_version"] is None


@pytest.mark.lab
def test_no_package_floats_outside_the_pins(nodes: list[Host]) -> None:
    for host in nodes:
        lock = {
            line.split("==")[0]
            for line in host.file(f"{ENV}/constraints.txt").content_string.splitlines()
            if line and not line.startswith("#")
        }
        top = {"pip"}  # the lock pins the top-level packages too
        for line in run(host, f"{ENV_BIN}/pip freeze --all").splitlines():
            name = re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
            if name in top or name.startswith(("nvidia-", "cuda-")) or name == "triton":
                continue
            assert name in lock, f"{line} is not pinned by the lock"


@pytest.mark.lab
@pytest.mark.parametrize(
    ("path", "owner", "mode"),
    [
        ("/opt/llama-cluster", "root", 0o755),
        ("/opt/llama-cluster/wheelhouse", "root", 0o755),
        # root's: each run's directory is made there by root alone (llama_files new)
        ("/opt/llama-cluster/runs", "root", 0o755),
        ("/opt/llama-cluster/models", "llama", 0o775),
    ],
)
def test_cluster_directories_have_sane_ownership(
    nodes: list[Host], path: str, owner: str, mode: int
) -> None:
    for host in nodes:
        d = host.file(path)
        assert d.is_directory
        assert d.user == owner
        assert d.group == "llama"
        assert d.mode == mode


@pytest.mark.lab
def test_the_environment_was_filled_by_uv_and_its_dependencies_agree(nodes: list[Host]) -> None:
    # python_env_installer: uv (the default) installs uv from the wheelhouse, then everything else.
    for host in nodes:
        assert run(host, f"{ENV_BIN}/uv --version").split()[:2] == ["uv", "0.13.9"]
        check = host.run(f"{ENV_BIN}/uv pip check --python {ENV_BIN}/python")
        assert check.rc == 0, check.stdout + check.stderr
        assert "All installed packages are compatible" in check.stdout + check.stderr


@pytest.mark.lab
def test_every_node_got_the_controllers_deepspeed_wheel(nodes: list[Host]) -> None:
    for host in nodes:
        assert host.file("/opt/llama-cluster/wheelhouse/deepspeed-0.19.8-py3-none-any.whl").is_file


# Issue 38: the plan is for the memory each node has free now (llama.cluster.llama_node_usage,
# read just before the plan), on the lab's CPU nodes its host memory; a run that does not fit it
# is refused before any node changes.
@pytest.mark.lab
def test_the_plan_is_for_the_host_memory_free_now_and_refuses_what_does_not_fit(
    provisioned: Cluster, lab_hosts: list[str]
) -> None:
    planned = ansible("ansible-playbook", "train.yml", "--check", "-e", "model=tiny")
    said = " ".join(planned.stdout.split())
    found = re.search(r"Host memory planned for: ([\d.]+) GiB per node \(smallest node: ([^,]+), "
                      r"available now \(", said)  # fmt: skip
    assert found, said[-3000:]
    assert found.group(2) in lab_hosts
    assert 0 < float(found.group(1)) < 1024
    assert "plan only (--check): nothing was changed" in said
    refused = ansible(
        "ansible-playbook", "train.yml", "--check", "-e", "model=tiny", "-e",
        "host_memory_gib=0.3", check=False,
    )  # fmt: skip
    said = " ".join(refused.stdout.split())
    assert refused.returncode != 0
    assert "The run does not fit the nodes' memory" in said
    assert "Nothing was changed on any node." in said


SECOND_ADMIN = """
- name: Make a second admin account on a node, as another server's image has
  hosts: all
  gather_facts: false
  become: true
  tasks:
    - name: Create the account
      ansible.builtin.user:
        name: admin2
        shell: /bin/bash
    - name: Authorize the lab's key for it
      ansible.builtin.copy:
        src: /home/{user}/.ssh/authorized_keys
        remote_src: true
        dest: /home/admin2/.ssh/
        owner: admin2
        mode: "0600"
        directory_mode: "0700"
    - name: Let it become root
      ansible.builtin.copy:
        content: "admin2 ALL=(ALL) NOPASSWD: ALL\\n"
        dest: /etc/sudoers.d/admin2
        mode: "0440"
"""


@pytest.mark.lab
def test_nodes_reached_as_different_admin_accounts_are_one_cluster(
    provisioned: Cluster, lab_hosts: list[str], tmp_path: Path
) -> None:
    # Issue 48: a worker whose ansible_user differs from the master's. Each node is reached as
    # its own account, and a task delegated to a node runs as that node's: the cluster check
    # (versions, links, an all-reduce started by llama-job on every node) passes.
    worker = lab_hosts[1]
    inventory = yaml.safe_load(DEFAULT_INVENTORY.read_text())
    admin = inventory["all"]["vars"]["ansible_user"]
    playbook = tmp_path / "admin2.yml"
    playbook.write_text(SECOND_ADMIN.replace("{user}", admin))
    ansible("ansible-playbook", "-i", str(DEFAULT_INVENTORY), "-l", worker, str(playbook))
    workers = inventory["all"]["children"]["cluster"]["children"]["workers"]["hosts"]
    workers[worker]["ansible_user"] = "admin2"
    mixed = tmp_path / "mixed.yml"
    mixed.write_text(yaml.safe_dump(inventory))
    checked = ansible("ansible-playbook", "-i", str(mixed), "playbooks/check.yml", check=False)
    out = checked.stdout + checked.stderr
    assert checked.returncode == 0, out[-3000:]
    assert re.search(
        rf"{re.escape(worker)}\s+: ok=\d+\s+changed=\d+\s+unreachable=0\s+failed=0", out
    )
