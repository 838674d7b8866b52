"""`-e min_nodes=N` (issue 44): the run planned at launch for every count of nodes from N up to the
cluster's less one (module_utils/fewer_nodes.py, called by llama.cluster.run_plan), so that the
master's agent can continue on the nodes that remain: the same effective batch through
accumulation, memory checked again by the planner; what cannot carry the run is refused before
launch."""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.fewer_nodes import plan_fewer_nodes
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import assemble
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    find_model,
    resolve_model,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Plan, Request
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import check_request

from tests.support.planning import QWEN25_7B_CONFIG, SETTINGS, nodes, request

DATASETS = [{"name": "demo_alpaca", "file": "data/demo_alpaca.json", "formatting": "alpaca"}]


def fewer(
    min_nodes: int, cluster: list[dict[str, Any]], model: str = "tiny", **extra: Any
) -> tuple[Plan, Plan]:
    """The plan for `cluster`, then the same with its plan for fewer nodes (what run_plan does)."""
    entry, problems = find_model(SETTINGS["catalogue"], model, None)
    asked = check_request(request(model, **extra), SETTINGS["stages"], problems)
    resolved, checked = resolve_model(asked, entry), Request.of(asked)
    ranks = {n["host"]: n["rank"] for n in cluster}
    common = {"model": resolved, "nodes": cluster, "datasets": DATASETS, "settings": SETTINGS}
    plan = assemble(checked, ranks=ranks, **common)
    return plan, plan_fewer_nodes(plan, checked, min_nodes=min_nodes, **common)


def test_the_lab_planned_for_one_node_keeps_its_effective_batch_through_accumulation() -> None:
    # The lab: 2 CPU nodes x 2 processes. On one node, the same effective batch takes twice the
    # accumulation at the same micro-batch; the planner planned that run again.
    plan, planned = fewer(1, nodes(2, 2, accelerator="cpu"))
    micro, accumulation = plan.batch.micro, plan.batch.accumulation
    assert planned.min_nodes == 1
    assert planned.fewer_nodes["1"]["args"] == [
        f"per_device_train_batch_size={micro}",
        f"gradient_accumulation_steps={2 * accumulation}",
    ]
    note = planned.fewer_nodes["1"]["note"]
    assert note.endswith(f"effective batch {plan.batch.effective} kept (memory checked again)")
    assert planned.summary == (*plan.summary, f"On 1 node(s), should the others stay away: {note}")


def test_every_count_from_min_nodes_is_planned_and_min_nodes_of_every_node_is_none() -> None:
    batch = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 3}  # 12 in all
    _, planned = fewer(2, nodes(4, 1, accelerator="cpu"), train_args=batch)
    assert {n: f["args"][1] for n, f in planned.fewer_nodes.items()} == {
        "2": "gradient_accumulation_steps=6",
        "3": "gradient_accumulation_steps=4",
    }
    plan, every = fewer(4, nodes(4, 1, accelerator="cpu"))
    assert every == plan
    assert (every.min_nodes, every.fewer_nodes) == (0, {})


def test_a_batch_that_fewer_nodes_cannot_split_is_refused_before_launch() -> None:
    # An effective batch of 3 (3 nodes x micro-batch 1 x accumulation 1): 2 nodes cannot share it.
    batch = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    with pytest.raises(PlanError, match=r"min_nodes=2: the effective batch 3 cannot be split over"):
        fewer(2, nodes(3, 1, accelerator="cpu"), train_args=batch)


def test_sharded_checkpoints_cannot_go_on_without_a_node_and_are_refused() -> None:
    with pytest.raises(PlanError, match=r"min_nodes=1: the plan's zero3 writes checkpoints of"):
        fewer(1, nodes(2, 8), model="qwen2.5-7b", deepspeed="zero3", model_config=QWEN25_7B_CONFIG)


def test_more_nodes_than_the_cluster_has_are_refused() -> None:
    with pytest.raises(PlanError, match=r"min_nodes=3: the cluster has 2 node\(s\); give 1 to 2"):
        fewer(3, nodes(2, 2, accelerator="cpu"))
