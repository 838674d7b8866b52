"""The nodes (planner/nodes.py): accelerator, processes, GPU memory from facts."""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    cluster_accelerator,
    describe_nodes,
    hosts_without_gpu_facts,
    node_gpu_memory,
)

from tests.support.planning import (
    hostvars,
    make_plan,
    nodes,
)

# ---------------------------------------------------------------------------------------------
# The nodes: accelerator, processes, GPU memory from facts.
# ---------------------------------------------------------------------------------------------


def test_nodes_that_disagree_on_the_accelerator_are_refused_naming_them() -> None:
    hosts = {"a": hostvars("nvidia"), "b": hostvars("cpu"), "c": hostvars("nvidia")}
    expected = r"disagree on cluster_accelerator \(cpu on b; nvidia on a, c\)"
    with pytest.raises(PlanError, match=expected):
        cluster_accelerator(["a", "b", "c"], hosts)
    described = describe_nodes({"a": 0, "b": 1, "c": 2}, hosts, {"a": 1, "b": 1, "c": 1})
    with pytest.raises(PlanError, match="disagree on cluster_accelerator"):
        make_plan(cluster=described)


def test_gpu_memory_is_the_smallest_gpu_the_node_trains_on() -> None:
    mixed = hostvars(mib=[81559, 24564, 143771])
    assert node_gpu_memory("a", mixed) == (24.0, "facts, smallest of 3 GPUs")
    chosen = hostvars(mib=[81559, 24564, 143771], gpu_ids=[0, 2])
    assert node_gpu_memory("a", chosen) == (79.6, "facts, smallest of 2 GPUs")


def test_gpu_memory_falls_back_to_the_setting_only_where_facts_say_nothing() -> None:
    no_driver = hostvars(mib=[None, None])
    gib, source = node_gpu_memory("a", no_driver)
    assert gib == 80.0
    assert source.startswith("training_gpu_memory_gib")
    assert node_gpu_memory("a", hostvars("cpu")) == (None, "CPU node")


def test_gpu_ids_that_the_node_does_not_have_are_refused() -> None:
    with pytest.raises(PlanError, match=r"a: gpu_ids \[0, 4\] name GPUs \[4\].*GPUs \[0, 1\]"):
        node_gpu_memory("a", hostvars(mib=[81559, 81559], gpu_ids=[0, 4]))


def test_only_gpu_nodes_without_cached_facts_are_read_before_planning() -> None:
    hosts = {"a": hostvars(mib=[81559]), "b": hostvars(), "c": hostvars("cpu")}
    assert hosts_without_gpu_facts(["a", "b", "c"], hosts) == ["b"]


def test_facts_in_ansible_facts_are_read_too() -> None:
    gpus = [{"index": 0, "memory_mib": 24564}]
    gathered = {"ansible_facts": {"local": {"llama_host": {"gpus": gpus}}}}
    assert node_gpu_memory("a", gathered)[0] == 24.0


def test_nodes_with_different_process_counts_are_refused() -> None:
    cluster = nodes(2)
    cluster[1]["nproc"] = 2
    with pytest.raises(PlanError, match=r"different numbers of processes \(n0: 1, n1: 2\)"):
        make_plan(cluster=cluster)


@pytest.mark.parametrize("nproc", [0, -2, "four"])
def test_a_process_count_that_is_not_positive_is_refused(nproc: Any) -> None:
    cluster = nodes(2)
    for node in cluster:
        node["nproc"] = nproc
    with pytest.raises(PlanError, match="nproc_per_node must be an integer >= 1"):
        make_plan(cluster=cluster)
