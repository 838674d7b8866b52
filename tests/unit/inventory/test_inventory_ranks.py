"""Node ranks, processes per node and every process's RANK, as the cluster filters derive them from
an inventory (llama/cluster/plugins/module_utils/inventory.py: cluster_ranks, node_nproc,
global_ranks, cluster_groups for an inventory of the group cluster alone)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.llama.cluster.plugins.filter import cluster

from tests.support.inventories import (
    ini,
    run,
)

# Node ranks and processes per node, as the cluster filters derive them from an inventory.


def topology(master: list[str], workers: list[str]) -> dict[str, list[str]]:
    return {"cluster": master + workers, "master": master, "workers": workers}


def test_master_is_rank_zero_and_workers_follow_inventory_order():
    hosts = {h: {} for h in ("a", "b", "c")}
    assert cluster.cluster_ranks(topology(["b"], ["c", "a"]), hosts) == {
        "b": 0,
        "c": 1,
        "a": 2,
    }


def test_without_a_cluster_group_master_and_workers_are_ranked():
    hosts = {h: {} for h in ("m", "w1", "w2")}
    inventory = {"master": ["m"], "workers": ["w1", "w2"]}
    assert cluster.cluster_ranks(inventory, hosts) == {"m": 0, "w1": 1, "w2": 2}


def test_explicit_node_ranks_are_used():
    hosts = {"a": {"node_rank": 0}, "b": {"node_rank": 2}, "c": {"node_rank": "1"}}
    assert cluster.cluster_ranks(topology(["a"], ["b", "c"]), hosts) == {
        "a": 0,
        "b": 2,
        "c": 1,
    }


@pytest.mark.parametrize(
    ("inventory", "hostvars", "message"),
    [
        ({"cluster": [], "master": [], "workers": []}, {}, "no hosts in the group 'cluster'"),
        (topology([], ["a"]), {"a": {}}, "exactly one host (found: none)"),
        (topology(["a", "b"], []), {"a": {}, "b": {}}, "exactly one host (found: a, b)"),
        (
            {"cluster": ["a", "b", "c"], "master": ["a"], "workers": ["b"]},
            {"a": {}, "b": {}, "c": {}},
            "c in 'cluster' but neither in 'master' nor in 'workers'",
        ),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 0}, "b": {}},
            "set it on every host or none",
        ),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 1}, "b": {"node_rank": 0}},
            "must be rank 0",
        ),
        (topology(["a"], ["b"]), {"a": {"node_rank": 0}, "b": {"node_rank": 0}}, "both have"),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 0}, "b": {"node_rank": 5}},
            "do not add up",
        ),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 0}, "b": {"node_rank": "x"}},
            "node_rank of b is 'x': allowed is a whole number >= 0",
        ),
    ],
)
def test_bad_topologies_fail_with_the_fix(inventory, hostvars, message):
    with pytest.raises(AnsibleFilterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cluster.cluster_ranks(inventory, hostvars)


@pytest.mark.parametrize(
    ("hostvars", "expected"),
    [
        ({"nproc_per_node": 3, "gpu_ids": [0]}, 3),
        ({"gpu_ids": [0, 1, 2, 3]}, 4),
        ({"cluster_accelerator": "cpu"}, 1),
        ({"ansible_local": {"llama_host": {"gpu_count": 8}}}, 8),
    ],
)
def test_processes_per_node(hostvars, expected):
    assert cluster.node_nproc(hostvars) == expected


@pytest.mark.parametrize("nproc", [0, -1, "two", 1.5])
def test_processes_per_node_must_be_a_positive_whole_number(nproc):
    with pytest.raises(AnsibleFilterError, match="allowed is a whole number >= 1"):
        cluster.node_nproc({"inventory_hostname": "gpu1", "nproc_per_node": nproc})


def test_gpu_node_without_gpus_or_nproc_fails():
    with pytest.raises(AnsibleFilterError, match="reports no GPUs"):
        cluster.node_nproc({"inventory_hostname": "gpu1", "ansible_local": {}})


def test_a_node_whose_facts_list_no_gpu_is_told_to_set_cluster_accelerator_cpu():
    # Issue 39: the lab's CPU nodes in a tutorial's inventory were refused without naming it.
    facts = {"llama_host": {"gpus": [], "gpu_count": 0}}
    with pytest.raises(AnsibleFilterError, match="set cluster_accelerator=cpu for the cluster"):
        cluster.node_nproc({"inventory_hostname": "lab1", "ansible_local": facts})


# ---- an inventory of the group cluster alone (a tutorial's [cluster] of addresses) ---------------
@pytest.mark.parametrize(
    ("inventory", "hostvars", "ranks"),
    [
        # the first host of cluster is the master, the others workers in inventory order
        ({"cluster": ["c", "a", "b"]}, {}, {"c": 0, "a": 1, "b": 2}),
        # ... unless a host is named: the group master, or node_rank=0
        ({"cluster": ["c", "a", "b"], "master": ["b"]}, {}, {"b": 0, "c": 1, "a": 2}),
        (
            {"cluster": ["c", "a"]},
            {"c": {"node_rank": "1"}, "a": {"node_rank": "0"}},
            {"a": 0, "c": 1},
        ),
        # workers named, no master: the host of cluster that is not a worker
        ({"cluster": ["a", "b"], "workers": ["a"]}, {}, {"b": 0, "a": 1}),
    ],
)
def test_the_group_cluster_alone_makes_its_first_host_the_master(inventory, hostvars, ranks):
    hostvars = {h: hostvars.get(h, {}) for h in inventory["cluster"]}
    assert cluster.cluster_ranks(inventory, hostvars) == ranks
    report = cluster.inventory_report(inventory, hostvars)
    assert report["problems"] == [], report["message"]


def test_a_tutorial_ini_of_the_group_cluster_alone_passes_the_check(tmp_path: Path):
    # As a tutorial writes it (and the README): addresses, a user who becomes root, no
    # [master] or [workers]. The check passes and the plays that follow see node1 as the master
    # (they then find the nodes unreachable: they do not exist).
    text = "[cluster]\nnode1\nnode2\n[cluster:vars]\nansible_user=ubuntu\nansible_become=true\n"
    rc, out = run("playbooks/status.yml", ini(tmp_path, text))
    assert "does not describe a cluster" not in out, out[-3000:]
    assert "node1: master" in out, out[-3000:]
    assert "node2: workers" in out, out[-3000:]
    # status.yml asks the master (node1) for the runs: the first node it tries to reach.
    asked = out.split("List the runs on the master", 1)[-1]
    assert "fatal: [node1]: UNREACHABLE" in asked, out[-3000:]
    assert rc != 0


def test_global_ranks_follow_node_rank_then_local_rank():
    hostvars = {"a": {"nproc_per_node": 2}, "b": {"nproc_per_node": 3}, "c": {"gpu_ids": [4]}}
    assert cluster.global_ranks(topology(["b"], ["a", "c"]), hostvars) == {
        "b": [0, 1, 2],
        "a": [3, 4],
        "c": [5],
    }
