"""The inventory check refuses, on the controller and before any node is touched, what used to
pass it and fail later (issue 48): a host name llama-job refuses (it names every node's run
files and units), an -i path that does not exist (Ansible only warns and goes on with no hosts,
which read as "the inventory has no nodes"), and nodes reached as another account than root
without become."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter import cluster

from tests.unit.inventory.test_inventory_check import (
    ghost,
    groups,
    ini,
    refused,
    run,
    yaml_inventory,
)


def _two_nodes(worker: str) -> dict:
    return {
        "all": {
            "children": {
                "master": {"hosts": {"node1": ghost(1)}},
                "workers": {"hosts": {worker: ghost(2)}},
            }
        }
    }


@pytest.mark.parametrize(
    ("name", "hint"),
    [("llama lab node2", "llama-lab-node2"), ("llama-läb-nöde2", "llama-lab-node2")],
)
def test_a_host_name_llama_job_refuses_is_refused_before_any_node_with_a_name_it_takes(
    tmp_path: Path, name: str, hint: str
):
    out = refused("train.yml", yaml_inventory(tmp_path, _two_nodes(name)), "-e", "model=tiny")
    assert f"The host name '{name}' cannot name a node's run files and units" in out
    assert "letters, digits, '.', '_' or '-' (ASCII), a letter or digit first" in out
    assert f"Rename the host in the inventory (e.g. {hint})" in out
    assert not (tmp_path / "runs").exists()  # no run claimed on the controller either


def test_host_names_llama_job_takes_pass():
    names = ["a", "node-1", "gpu_a.example.com", "10.0.0.1", "x" * 128]
    hostvars = {name: {} for name in names}
    report = cluster.inventory_report(groups(names[:1], names[1:]), hostvars)
    assert report["problems"] == []
    too_long = "y" * 129
    report = cluster.inventory_report(groups(["a"], [too_long]), {"a": {}, too_long: {}})
    assert len(report["problems"]) == 1
    assert "cannot name a node's run files" in report["problems"][0]


def test_an_inventory_path_that_does_not_exist_is_named_not_called_empty(tmp_path: Path):
    missing = tmp_path / "mycluster" / "hosts.yml"
    rc, out = run("provision.yml", missing)
    text = " ".join(out.split())
    assert rc != 0
    assert f"The inventory {missing} does not exist (-i {missing})" in text
    assert "has no nodes" not in text


def test_a_list_of_hosts_given_as_the_source_is_not_a_path():
    report = cluster.inventory_report(groups(["a"], ["b"]), {"a": {}, "b": {}}, sources=["a,b,"])
    assert report["problems"] == []


# ---- become: the README's INI example without ansible_become=true failed on each playbook's
# own message ("this verb needs root", "llama_files: ...: Permission denied") (issue 48) -----
TUTORIAL = "[cluster]\nnode1\nnode2\n[cluster:vars]\nansible_user=ubuntu\n"


def test_a_non_root_login_without_become_is_refused_naming_ansible_become(tmp_path: Path):
    out = refused("train.yml", ini(tmp_path, TUTORIAL), "-e", "model=tiny")
    assert (
        "node1, node2: Ansible logs in as ubuntu (ansible_user), not root, and is not told to "
        "become root there" in out
    )
    assert "Set ansible_become=true for the cluster ([all:vars] or [cluster:vars]" in out


def test_become_from_the_inventory_or_the_command_line_passes_the_check(tmp_path: Path):
    with_become = ini(tmp_path, TUTORIAL + "ansible_become=true\n")
    (tmp_path / "b").mkdir()
    for inventory, extra in ((with_become, ()), (ini(tmp_path / "b", TUTORIAL), ("--become",))):
        rc, out = run("playbooks/stop.yml", inventory, *extra)
        assert rc != 0
        assert "does not describe a cluster" not in out, out[-2000:]
        assert "UNREACHABLE" in out  # past the check: the ghost nodes are tried


@pytest.mark.parametrize(
    ("hostvars", "become", "refused"),
    [
        ({"ansible_user": "ubuntu"}, False, True),
        ({"ansible_user": "ubuntu", "ansible_become": "True"}, False, False),
        ({"ansible_user": "ubuntu"}, True, False),
        ({"ansible_user": "root"}, False, False),
        ({}, False, False),  # the controller's own account: not known here
    ],
)
def test_the_become_rule(hostvars: dict, become: bool, refused: bool):
    report = cluster.inventory_report(groups(["a"], []), {"a": hostvars}, become=become)
    assert bool(report["problems"]) is refused


def test_status_of_a_cluster_without_runs_says_so(tmp_path: Path):
    # "Conditional result (False) was derived from value of type 'str'": no run id given and
    # none on the master. The "nodes" run on the controller (ansible_connection=local).
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "vars": {**local, "cluster_runs_dir": str(tmp_path / "none")},
            "children": {"master": {"hosts": {"a": {}}}, "workers": {"hosts": {"b": {}}}},
        }
    }
    (tmp_path / "none").mkdir()
    rc, out = run("playbooks/status.yml", yaml_inventory(tmp_path, inventory))
    text = " ".join(out.split())
    assert rc != 0, text[-2000:]
    assert f"No run in {tmp_path / 'none'} on a. Runs there: none." in text, text[-2000:]
    assert "Conditionals must have a boolean result" not in text
