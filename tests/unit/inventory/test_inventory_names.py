"""The inventory check refuses, on the controller and before any node is touched, what used to
pass it and fail later (issue 48): a host name llama-job refuses (it names every node's run
files and units), and an -i path that does not exist (Ansible only warns and goes on with no
hosts, which read as "the inventory has no nodes")."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter import cluster

from tests.unit.inventory.test_inventory_check import ghost, groups, refused, run, yaml_inventory


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
