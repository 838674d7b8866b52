"""Disk is a budget too (issue 21): the plan keeps a bounded number of checkpoints, estimates
their size on every node (planner/disk.py) and refuses a node whose runs directory lacks the space;
and a run beyond any real run's size is refused before launch (issue 48).
"""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.filter.run_config import FilterModule
from ansible_collections.llama.cluster.plugins.module_utils.planner.disk import (
    disk_budget,
    log_bytes,
    lora_params,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.memory import GIB

from tests.support.planning import QWEN25_7B_CONFIG, SETTINGS, make_plan, nodes

RUNS = "/opt/llama-cluster/runs"


def full_7b(**extra: Any) -> dict[str, Any]:
    return make_plan(finetuning_type="full", model_config=QWEN25_7B_CONFIG, **extra)


def test_a_plan_keeps_the_latest_three_checkpoints_by_default_and_says_so() -> None:
    plan = make_plan()
    assert plan.train_args["save_total_limit"] == 3
    assert plan.disk["save_total_limit"] == 3
    assert plan.disk["count"] == 4  # three kept, one more while the next is written
    line = next(s for s in plan.summary if s.startswith("Checkpoints"))
    assert "the latest 3 kept (save_total_limit, the project's default" in line


def test_a_users_save_total_limit_is_kept() -> None:
    plan = make_plan(train_args={"save_total_limit": 7})
    assert plan.train_args["save_total_limit"] == 7
    assert plan.disk["count"] == 8
    line = next(s for s in plan.summary if s.startswith("Checkpoints"))
    assert "the latest 7 kept (save_total_limit, as set)" in line


def test_a_7b_full_fine_tune_checkpoint_is_about_90_gb_with_its_optimizer_state() -> None:
    plan = full_7b()
    disk = plan.disk
    assert plan.stage.stage == "none"
    # fp32 weights (LLaMA-Factory upcasts trainable weights) 4 + AdamW's two moments 8 bytes.
    assert disk["checkpoint_bytes"] == 12 * 7_620_000_000
    assert 88e9 < disk["checkpoint_bytes"] < 93e9
    assert disk["final_bytes"] == 4 * 7_620_000_000
    assert disk["needed_bytes"] == 4 * disk["checkpoint_bytes"] + disk["final_bytes"]
    line = next(s for s in plan.summary if s.startswith("Disk per node"))
    assert "up to 369.0 GiB (4 checkpoints x 85.2 GiB" in line
    assert "12 bytes x 7.62B parameters" in line


def test_zero3_checkpoints_hold_this_nodes_share_of_the_optimizer_shards() -> None:
    two = full_7b(deepspeed="zero3", cluster=nodes(2, 8))
    # bf16 weights 2 + half of the fp32 master weights and moments (12 / 2 nodes) = 8 bytes.
    assert two.disk["checkpoint_bytes"] == 8 * 7_620_000_000
    shared = make_plan(
        finetuning_type="full",
        model_config=QWEN25_7B_CONFIG,
        deepspeed="zero3",
        cluster=nodes(2, 8),
        settings={**SETTINGS, "shared_storage": True},
    )
    assert shared.disk["checkpoint_bytes"] == 14 * 7_620_000_000  # every rank writes there


def test_a_7b_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only() -> None:
    plan = make_plan(model_config=QWEN25_7B_CONFIG)
    # Per layer rank 8 x (4 attention projections of 3584 + 3584, gate and up 3584 + 18944,
    # down 18944 + 3584), 28 layers: 21.6M parameters (the exact count, with 4 key/value heads,
    # is 20.2M), 4 bytes of adapter + 8 of moments each.
    adapter = 8 * (4 * 2 * 3584 + 3 * (3584 + 18944)) * 28
    assert lora_params({"hidden": 3584, "intermediate": 18944, "layers": 28}, 8, "all") == adapter
    assert plan.disk["checkpoint_bytes"] == 12 * adapter
    assert plan.disk["checkpoint_bytes"] < 0.3 * GIB
    assert plan.disk["final_bytes"] == 4 * adapter
    only_q_v = lora_params(
        {"hidden": 3584, "intermediate": 18944, "layers": 28}, 8, "q_proj,v_proj"
    )
    assert only_q_v == 8 * 2 * 2 * 3584 * 28


def test_a_short_run_counts_only_the_checkpoints_it_writes() -> None:
    plan = full_7b(train_args={"max_steps": 600})
    assert plan.disk["saves"] == 2  # at step 500 and at the end
    assert plan.disk["count"] == 2


def test_a_node_whose_disk_cannot_hold_the_checkpoints_is_refused_with_the_figures() -> None:
    plan = full_7b()
    checked = disk_budget(
        plan.to_dict(),
        {"n0": {"free": 500 * GIB, "path": RUNS}, "n1": {"free": 300 * GIB, "path": "/opt"}},
        RUNS,
    )
    assert not checked["ok"]
    assert checked["short"] == ["n1"]
    message = checked["message"]
    assert message.startswith(f"n1: the run's checkpoints would not fit the free space of {RUNS}")
    assert "(measured at /opt, its nearest existing directory)" in message
    assert "300.0 GiB free, 369.0 GiB (4 checkpoints x 85.2 GiB: save_total_limit 3 + the one" in (
        message
    )
    assert "the final model 28.4 GiB) needed" in message
    assert """-e '{"train_args": {"save_total_limit": 2}}' fits""" in message
    assert "larger disk" in message
    assert "-e finetuning_type=lora" in message
    assert "n0" not in message


def test_a_node_whose_free_space_is_unknown_is_named_and_not_refused() -> None:
    plan = full_7b()
    checked = disk_budget(plan.to_dict(), {"n0": {}, "n1": None}, RUNS)
    assert checked["ok"]
    assert f"n0: the free space of {RUNS} is unknown" in checked["message"]
    assert "n1: the free space" in checked["message"]
    assert "(369.0 GiB) were not checked" in checked["message"]


def test_a_node_with_room_passes_and_a_resumed_run_is_not_checked_again() -> None:
    plan = full_7b()
    fits = disk_budget(plan.to_dict(), {"n0": {"free": 400 * GIB, "path": RUNS}}, RUNS)
    assert fits == {
        "ok": True,
        "short": [],
        "message": f"Disk: n0: 369.0 GiB needed, 400.0 GiB free on {RUNS}.",
    }
    assert disk_budget({**plan.to_dict(), "resume": True}, {"n0": 0}, RUNS)["ok"]


def test_the_node_logs_are_counted_beside_the_checkpoints() -> None:
    # Issue 40: node logs grew without bound outside the disk budget. Rotated past 64 MiB with 3
    # kept (group_vars/all/cluster.yml), a job's node log takes at most 4 x 64 MiB on a node.
    plan = full_7b()
    logs = log_bytes(64, 3)
    assert logs == 256 << 20
    needed = plan.disk["needed_bytes"]
    just = {"n0": {"free": needed + (100 << 20), "path": RUNS}}
    assert disk_budget(plan.to_dict(), just, RUNS)["ok"]
    checked = disk_budget(plan.to_dict(), just, RUNS, logs)
    assert not checked["ok"]
    assert "369.1 GiB free, 369.3 GiB (4 checkpoints x 85.2 GiB" in checked["message"]
    assert "and the node's logs, rotated, at most 0.2 GiB) needed" in checked["message"]
    roomy = disk_budget(plan.to_dict(), {"n0": {"free": needed + logs, "path": RUNS}}, RUNS, logs)
    assert roomy["ok"], roomy


@pytest.mark.parametrize("free", [2 * GIB, 10 * GIB])
def test_the_filter_is_the_planners_check(free: int) -> None:
    check = FilterModule().filters()["run_config_disk_budget"]
    plan = make_plan(model_config=QWEN25_7B_CONFIG)
    assert check(plan.to_dict(), {"n0": free}, RUNS) == disk_budget(
        plan.to_dict(), {"n0": free}, RUNS
    )
    assert check(plan.to_dict(), {"n0": free}, RUNS)["ok"]
    assert check(plan.to_dict(), {"n0": free}, RUNS, "64", "3") == disk_budget(
        plan.to_dict(), {"n0": free}, RUNS, log_bytes(64, 3)
    )


# ---- absurd sizes are refused before launch, with the predicted time (issue 48) -----------------
def test_a_run_of_a_million_years_is_refused_with_its_steps_and_predicted_time() -> None:
    # train_args.num_train_epochs: 1e12 was launched: 4,000,000,000,000 steps, no warning.
    with pytest.raises(PlanError) as refused:
        make_plan(train_args={"num_train_epochs": 1e12}, dataset_records=1000)
    said = str(refused.value)
    assert said.startswith("Refused before launch: 63,000,000,000,000 optimizer steps, ")
    assert "predicted to take 1,113,317 years at 0.557 s a step" in said
    assert "beyond any real run (the bounds: a year, 1,000,000,000 steps" in said
    assert "Check num_train_epochs, max_steps and save_steps (train_args)" in said


def test_a_run_whose_checkpoints_are_beyond_the_bound_is_refused() -> None:
    with pytest.raises(PlanError, match=r"2,000,000 checkpoints written: beyond any real run"):
        make_plan(train_args={"max_steps": 2_000_000, "save_steps": 1})


def test_a_cluster_without_a_predicted_step_time_is_bounded_at_its_floor() -> None:
    cpu = nodes(2, accelerator="cpu")
    with pytest.raises(PlanError, match=r"at least 2,220 years even at 0\.01 s a step"):
        make_plan("tiny", cluster=cpu, train_args={"num_train_epochs": 1e12}, dataset_records=28)
    assert make_plan("tiny", cluster=cpu, train_args={"num_train_epochs": 1e5}, dataset_records=28)


def test_a_long_real_run_passes() -> None:
    # A month of a 7B full fine-tune's steps: long, not absurd.
    plan = make_plan(train_args={"max_steps": 3_000_000, "save_steps": 5000})
    assert plan.batch.steps == 3_000_000
