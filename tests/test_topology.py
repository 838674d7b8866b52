"""Node ranks and processes per node, as the cluster filters derive them from an inventory."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.llama.cluster.plugins.filter import cluster


def groups(master: list[str], workers: list[str]) -> dict[str, list[str]]:
    return {"cluster": master + workers, "master": master, "workers": workers}


def test_master_is_rank_zero_and_workers_follow_inventory_order():
    hosts = {h: {} for h in ("a", "b", "c")}
    assert cluster.cluster_ranks(groups(["b"], ["c", "a"]), hosts) == {"b": 0, "c": 1, "a": 2}


def test_without_a_cluster_group_master_and_workers_are_ranked():
    hosts = {h: {} for h in ("m", "w1", "w2")}
    inventory = {"master": ["m"], "workers": ["w1", "w2"]}
    assert cluster.cluster_ranks(inventory, hosts) == {"m": 0, "w1": 1, "w2": 2}


def test_explicit_node_ranks_are_used():
    hosts = {"a": {"node_rank": 0}, "b": {"node_rank": 2}, "c": {"node_rank": "1"}}
    assert cluster.cluster_ranks(groups(["a"], ["b", "c"]), hosts) == {"a": 0, "b": 2, "c": 1}


@pytest.mark.parametrize(
    ("inventory", "hostvars", "message"),
    [
        ({"cluster": [], "master": [], "workers": []}, {}, "no hosts in the group 'cluster'"),
        (groups([], ["a"]), {"a": {}}, "exactly one host (found: none)"),
        (groups(["a", "b"], []), {"a": {}, "b": {}}, "exactly one host (found: a, b)"),
        (
            {"cluster": ["a", "b"], "master": ["a"], "workers": []},
            {"a": {}, "b": {}},
            "neither in 'master' nor in 'workers'",
        ),
        (groups(["a"], ["b"]), {"a": {"node_rank": 0}, "b": {}}, "set it on every host or none"),
        (groups(["a"], ["b"]), {"a": {"node_rank": 1}, "b": {"node_rank": 0}}, "must be rank 0"),
        (groups(["a"], ["b"]), {"a": {"node_rank": 0}, "b": {"node_rank": 0}}, "both have"),
        (groups(["a"], ["b"]), {"a": {"node_rank": 0}, "b": {"node_rank": 5}}, "do not add up"),
        (
            groups(["a"], ["b"]),
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
