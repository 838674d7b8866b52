"""A value in the user's inventory wins over the project's default (group_vars/all/*.yml), for
every playbook whatever its folder, and through ansible-runner.

Each run is a small probe playbook: the inventory check (as every playbook starts), then every
node writes the values it sees, and localhost writes what it sees of each node through hostvars.
The probe is written, for the run, into the folder under test: the project's root (where
host_group_vars would load group_vars/all as playbook-adjacent variables), playbooks/, and
tests/playbooks/. The nodes are local-connection hosts: nothing leaves the controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from ansible.inventory.group import Group
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.vars.host_group_vars import VarsModule as HostGroupVars
from ansible_collections.llama.cluster.plugins.vars import llama_group_vars

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from train_runner import Cluster  # noqa: E402 - a script at the root, not an installed package

ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
DEFAULTS = {
    key: value
    for path in sorted((ROOT / "group_vars/all").glob("*.yml"))
    for key, value in (yaml.safe_load(path.read_text()) or {}).items()
}
KEYS = [
    "cluster_accelerator",
    "cuda_version",
    "nccl_debug",
    "nccl_ib_disable",
    "pip_timeout",
    "cluster_base_dir",
    "cluster_env_dir",
    "llamafactory_version",
    "master_port",
]


def probe(check_inventory: str) -> list[dict]:
    """The probe playbook, importing the inventory check from `check_inventory`; it writes one
    JSON file: each node's values as its own play sees them, as the controller sees them through
    hostvars, and the controller's own."""
    own = "dict(probe_keys | zip(query('ansible.builtin.vars', *probe_keys)))"
    through_hostvars = "dict(probe_keys | zip(probe_keys | map('extract', hostvars[item])))"
    return [
        {"name": "Probe | Check the inventory", "ansible.builtin.import_playbook": check_inventory},
        {
            "name": "Probe | What every node sees",
            "hosts": "cluster",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Probe | Keep this node's values",
                    "ansible.builtin.set_fact": {"probe_seen": "{{ " + own + " }}"},
                }
            ],
        },
        {
            "name": "Probe | What the controller sees of each node",
            "hosts": "localhost",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "Probe | Read every node's values through hostvars",
                    "ansible.builtin.set_fact": {
                        "probe_hostvars": "{{ probe_hostvars | default({}) | combine({item: "
                        + through_hostvars
                        + "}) }}"
                    },
                    "loop": "{{ groups['cluster'] }}",
                },
                {
                    "name": "Probe | Write what was seen",
                    "ansible.builtin.copy": {
                        "dest": "{{ probe_out }}/seen.json",
                        "content": "{{ {'node': dict(groups['cluster'] | zip(groups['cluster']"
                        " | map('extract', hostvars, 'probe_seen'))), 'hostvars': probe_hostvars,"
                        " 'controller': {'project_dir': project_dir,"
                        " 'controller_runs_dir': controller_runs_dir}} | to_json }}",
                        "mode": "0644",
                    },
                },
            ],
        },
    ]


# Where the probe runs: its folder, and the inventory check's path from there.
FOLDERS = {
    "root": (ROOT, "playbooks/check_inventory.yml"),
    "playbooks": (ROOT / "playbooks", "check_inventory.yml"),
    "tests/playbooks": (ROOT / "tests/playbooks", "../../playbooks/check_inventory.yml"),
}


@pytest.fixture
def probe_in() -> Iterator[Callable[[str], Path]]:
    """Writes the probe into a folder of the project for one test, and removes it after."""
    written: list[Path] = []

    def write(folder: str) -> Path:
        where, check = FOLDERS[folder]
        path = where / f".probe-{uuid.uuid4().hex[:8]}.yml"
        path.write_text(json.dumps(probe(check)))
        written.append(path)
        return path

    yield write
    for path in written:
        path.unlink(missing_ok=True)


def seeds_ini(tmp: Path) -> Path:
    """The seeds' style: [master] and [workers] (no cluster group), settings in [all:vars], a
    host named like its group, with host variables of its own."""
    path = tmp / "hosts.ini"
    path.write_text(
        "[master]\n"
        "master ansible_connection=local nccl_debug=INFO\n"
        "\n"
        "[workers]\n"
        "worker1 ansible_connection=local\n"
        "\n"
        "[all:vars]\n"
        "cluster_accelerator=cpu\n"
        f"ansible_python_interpreter={sys.executable}\n"
    )
    return path


def yaml_inventory(tmp: Path) -> Path:
    """A YAML inventory with group vars inline and group_vars/, host_vars/ beside it."""
    (tmp / "group_vars").mkdir()
    (tmp / "host_vars").mkdir()
    (tmp / "group_vars/all.yml").write_text("cluster_accelerator: cpu\n")
    (tmp / "group_vars/cluster.yml").write_text("cluster_base_dir: /srv/llama\n")
    (tmp / "host_vars/n1.yml").write_text("nccl_ib_disable: true\n")
    path = tmp / "hosts.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": {
                        "ansible_connection": "local",
                        "ansible_python_interpreter": sys.executable,
                    },
                    "children": {
                        "cluster": {
                            "vars": {"pip_timeout": 7},
                            "children": {
                                "master": {"hosts": {"n1": {}}},
                                "workers": {"hosts": {"n2": {"nccl_debug": "TRACE"}}},
                            },
                        }
                    },
                }
            }
        )
    )
    return path


def run_probe(playbook: Path, inventory: Path, out: Path) -> dict[str, dict]:
    out.mkdir()
    proc = subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            *("-i", str(inventory), str(playbook)),
            *("-e", json.dumps({"probe_out": str(out), "probe_keys": KEYS})),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return read(out)


def read(out: Path) -> dict[str, dict]:
    return json.loads((out / "seen.json").read_text())


def assert_seeds_values(seen: dict[str, dict]) -> None:
    # The group cluster was made from master + workers: the node play ran on both.
    for view in ("node", "hostvars"):
        master, worker = seen[view]["master"], seen[view]["worker1"]
        for node in (master, worker):
            assert node["cluster_accelerator"] == "cpu"  # [all:vars]
            assert node["cuda_version"] == "cpu"  # the default follows, per host
            assert node["llamafactory_version"] == DEFAULTS["llamafactory_version"]
            assert node["master_port"] == DEFAULTS["master_port"]
        assert master["nccl_debug"] == "INFO"  # a host var of the host named like its group
        assert worker["nccl_debug"] == DEFAULTS["nccl_debug"]
    assert seen["controller"] == {
        "project_dir": str(ROOT),
        "controller_runs_dir": str(ROOT / "runs"),
    }


def assert_yaml_values(seen: dict[str, dict]) -> None:
    for view in ("node", "hostvars"):
        n1, n2 = seen[view]["n1"], seen[view]["n2"]
        for node in (n1, n2):
            assert node["cluster_accelerator"] == "cpu"  # group_vars/all.yml beside it
            assert node["cuda_version"] == "cpu"
            assert node["pip_timeout"] == 7  # cluster: vars:
            assert node["cluster_base_dir"] == "/srv/llama"  # group_vars/cluster.yml
            assert node["cluster_env_dir"] == "/srv/llama/env"  # a default built on it
            assert node["llamafactory_version"] == DEFAULTS["llamafactory_version"]
        assert n1["nccl_ib_disable"] is True  # host_vars/n1.yml
        assert n2["nccl_ib_disable"] is DEFAULTS["nccl_ib_disable"]
        assert n2["nccl_debug"] == "TRACE"  # host var inline
        assert n1["nccl_debug"] == DEFAULTS["nccl_debug"]


def test_the_defaults_are_the_project_defaults_this_test_reads():
    # The assertions below compare with these: a default that equalled the user's value would
    # prove nothing.
    assert DEFAULTS["cluster_accelerator"] != "cpu"
    assert DEFAULTS["cuda_version"] != "cpu"
    assert DEFAULTS["nccl_debug"] not in ("INFO", "TRACE")
    assert DEFAULTS["pip_timeout"] != 7
    assert DEFAULTS["cluster_base_dir"] != "/srv/llama"
    assert DEFAULTS["nccl_ib_disable"] is False


@pytest.mark.parametrize("folder", ["root", "playbooks"])
def test_seeds_ini_inventory_wins_over_the_defaults(folder, probe_in, tmp_path: Path):
    seen = run_probe(probe_in(folder), seeds_ini(tmp_path), tmp_path / "out")
    assert_seeds_values(seen)


@pytest.mark.parametrize("folder", ["root", "tests/playbooks"])
def test_yaml_inventory_and_its_group_and_host_vars_win(folder, probe_in, tmp_path: Path):
    seen = run_probe(probe_in(folder), yaml_inventory(tmp_path), tmp_path / "out")
    assert_yaml_values(seen)


def test_ansible_runner_sees_the_same_values(probe_in, tmp_path: Path):
    playbook = probe_in("root")
    out = tmp_path / "out"
    out.mkdir()
    cluster = Cluster(seeds_ini(tmp_path), private_data_dir=tmp_path / "runner")
    result = cluster.run_playbook(playbook, {"probe_out": str(out), "probe_keys": KEYS})
    assert result.ok
    assert_seeds_values(read(out))


def test_an_inventory_in_the_root_does_not_load_the_defaults_as_its_group_vars():
    # An inventory kept in the project's root has group_vars/all as its adjacent group_vars:
    # llama_group_vars leaves that to llama_defaults (beneath the inventory), other groups not.
    loader = DataLoader()
    everything = HostGroupVars().get_vars(loader, str(ROOT), [Group("all")], cache=False)
    assert everything["cuda_version"] == DEFAULTS["cuda_version"]
    plugin = llama_group_vars.VarsModule()
    assert plugin.get_vars(loader, str(ROOT), [Group("all")], cache=False) == {}
    assert plugin.get_vars(loader, str(ROOT / "inventory/example"), [Group("cluster")]) == {
        "cluster_accelerator": "nvidia"
    }
