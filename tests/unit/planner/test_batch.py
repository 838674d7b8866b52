"""Micro-batch, accumulation and checkpointing (planner/decisions.py choose_batch and the batches
it refuses) and the effective batch.
"""

from __future__ import annotations

import json
import re

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.decisions import (
    check_dataset_batch,
    largest_micro,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.measured_memory import (
    COEFFICIENTS,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.memory import GIB, Memory

from tests.support.planning import (
    RTX4090_GIB,
    SETTINGS,
    make_plan,
    nodes,
)

# ---------------------------------------------------------------------------------------------
# Micro-batch, accumulation, checkpointing: the batch rule and the effective batch.
# ---------------------------------------------------------------------------------------------


def test_rows_per_step_come_from_tokens_per_step_and_cutoff() -> None:
    plan = make_plan("qwen2.5-0.5b", cutoff_len=1024, tokens_per_step=6144)
    assert plan.train_args["per_device_train_batch_size"] == 6
    assert plan.train_args["gradient_accumulation_steps"] == 1
    assert plan.batch.tokens_per_step == 6144


def test_rows_round_to_whole_rows() -> None:
    plan = make_plan("qwen2.5-0.5b", tokens_per_step=3072)  # 1.5 rows of 2048
    assert plan.batch.tokens_per_step == 4096


def test_the_micro_batch_is_the_largest_divisor_that_fits_without_checkpointing() -> None:
    # 7B LoRA on 80 GiB: 4 rows of 2048 per step; 3 would not fit, 2 do: 2 x 2.
    plan = make_plan(cluster=nodes(1, gib=80))
    args = plan.train_args
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 2)
    assert args["disable_gradient_checkpointing"] is True
    assert args["ddp_find_unused_parameters"] is False


def test_checkpointing_stays_on_where_no_micro_batch_fits_without_it() -> None:
    # Without Liger (a node whose stack lacks it): 7B LoRA's logits leave room for one row.
    plan = make_plan(cluster=nodes(1, gib=RTX4090_GIB, packages={}))
    args = plan.train_args
    assert plan.stage.stage == "none"
    assert plan.batch.checkpointing is True
    assert "disable_gradient_checkpointing" not in args
    assert "ddp_find_unused_parameters" not in args
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 4)
    assert "would not fit without recomputing" in plan.batch.checkpointing_why


def test_a_micro_batch_the_user_sets_is_kept_and_the_accumulation_follows() -> None:
    plan = make_plan("qwen2.5-0.5b", cutoff_len=1024, train_args={"per_device_train_batch_size": 2})
    args = plan.train_args
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 4)


def test_an_accumulation_the_user_sets_is_kept_and_the_micro_batch_follows() -> None:
    plan = make_plan("qwen2.5-0.5b", cutoff_len=1024, train_args={"gradient_accumulation_steps": 2})
    args = plan.train_args
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (4, 2)


def test_without_packing_the_batch_comes_from_the_defaults() -> None:
    plan = make_plan("qwen2.5-0.5b", train_args={"packing": False})
    args = plan.train_args
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 8)
    assert any("at most: samples of up to 2048" in line for line in plan.summary)


def test_a_micro_batch_that_does_not_fit_is_refused_naming_the_largest_that_fits() -> None:
    gpus = nodes(1, gib=32)
    with pytest.raises(PlanError) as refused:
        make_plan(cluster=gpus, deepspeed="none", train_args={"per_device_train_batch_size": 16})
    said = str(refused.value)
    found = re.search(r"The largest micro-batch that fits is (\d+): -e '(.*?)'", said)
    assert found, said
    largest = int(found.group(1))
    assert json.loads(found.group(2)) == {"train_args": {"per_device_train_batch_size": largest}}
    assert 1 < largest < 16
    fits = make_plan(cluster=gpus, train_args={"per_device_train_batch_size": largest})
    assert fits.stage.stage == "none"
    with pytest.raises(
        PlanError, match="does not fit the GPUs with deepspeed=none: a micro-batch of"
    ):
        make_plan(
            cluster=gpus, deepspeed="none", train_args={"per_device_train_batch_size": largest + 1}
        )


def test_a_cpu_micro_batch_the_nodes_memory_cannot_hold_is_refused_naming_the_largest() -> None:
    # The lab's probe (issue 40): a per-device batch of 1,000,000 took 10 GB per node on CPUs.
    cpus = [{**node, "host_memory_gib": 64.0} for node in nodes(2, accelerator="cpu")]
    model = "qwen2.5-0.5b"  # a shape in the catalogue (the tiny model's is read from its files)
    with pytest.raises(PlanError) as refused:
        make_plan(model, cluster=cpus, train_args={"per_device_train_batch_size": 1_000_000})
    said = str(refused.value)
    assert said.startswith("The run does not fit the nodes' memory: a micro-batch of 1000000 x")
    found = re.search(r"The largest micro-batch that fits is (\d+): -e '(.*?)'", said)
    assert found, said
    largest = int(found.group(1))
    assert largest > 1
    make_plan(model, cluster=cpus, train_args={"per_device_train_batch_size": largest})
    with pytest.raises(PlanError, match="does not fit the nodes' memory"):
        make_plan(model, cluster=cpus, train_args={"per_device_train_batch_size": largest + 1})
    # Without the nodes' memory there is nothing to plan for: as set.
    assert make_plan(model, cluster=nodes(2, accelerator="cpu"))


@pytest.mark.parametrize(
    ("below", "fitting", "largest"), [(16, 5, 5), (16, 0, 0), (1, 9, 0), (2, 1, 1)]
)
def test_the_largest_micro_batch_is_the_last_that_fits(below: int, fitting: int, largest: int):
    assert largest_micro(lambda micro: micro <= fitting, below) == largest


@pytest.mark.parametrize(
    ("batch", "records", "said"),
    [
        ((4, 8, 2), 64, None),  # exactly the dataset
        ((4, 8, 2), None, None),  # records unknown
        ((4, 8, 2), 63, "per_device_train_batch_size=3 with gradient_accumulation_steps=8 "
                        "(effective batch 48)"),
        ((4, 8, 2), 10, "per_device_train_batch_size=1 with gradient_accumulation_steps=5 "
                        "(effective batch 10)"),
        ((1, 1, 16), 14, "fewer records than processes"),
    ],
)  # fmt: skip
def test_an_effective_batch_beyond_the_records_is_refused_with_the_largest_that_fits(
    batch: tuple[int, int, int], records: int | None, said: str | None
) -> None:
    micro, accumulation, world = batch
    ask = {"micro": micro, "accumulation": accumulation, "world": world, "records": records}
    if said is None:
        check_dataset_batch(**ask, packing=False)
        return
    with pytest.raises(PlanError, match=re.escape(said)):
        check_dataset_batch(**ask, packing=False)


def test_max_samples_caps_the_records_each_dataset_gives() -> None:
    asked = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}
    # 4 x 2 x 2 processes = 16 rows per step; one dataset of which max_samples are read.
    make_plan(cluster=nodes(2), dataset_records=1000, train_args={**asked, "max_samples": 16})
    with pytest.raises(PlanError, match="more than the dataset's 15 records"):
        make_plan(cluster=nodes(2), dataset_records=1000, train_args={**asked, "max_samples": 15})


def test_checkpointing_the_user_asks_for_is_kept() -> None:
    plan = make_plan("qwen2.5-0.5b", train_args={"disable_gradient_checkpointing": False})
    assert plan.batch.checkpointing is True
    assert plan.batch.checkpointing_why == "as set"


@pytest.mark.parametrize(
    ("count", "nproc", "accumulation", "effective"),
    [(1, 1, None, 4), (2, 4, None, 32), (3, 8, 3, 1 * 3 * 3 * 8)],
)
def test_effective_batch_is_micro_times_accumulation_times_world(
    count: int, nproc: int, accumulation: int | None, effective: int
) -> None:
    train_args = {"gradient_accumulation_steps": accumulation} if accumulation else {}
    plan = make_plan(
        "qwen2.5-0.5b", cluster=nodes(count, nproc=nproc), cutoff_len=2048, train_args=train_args
    )
    args = plan.train_args
    world = count * nproc
    assert plan.world_size == world
    assert plan.batch.effective == effective
    assert (
        args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] * world
        == effective
    )
    assert plan.batch.tokens_per_optimizer_step == plan.batch.tokens_per_step * world


def test_cpu_effective_batch_uses_the_catalogue_and_the_users_values() -> None:
    plan = make_plan(
        "tiny",
        cluster=nodes(3, nproc=4, accelerator="cpu"),
        train_args={"gradient_accumulation_steps": 3},
    )
    assert "Nodes 3 x 4 processes = world size 12 (cpu)" in plan.summary
    assert plan.batch.effective == 72
    assert plan.summary[2].startswith(
        "Effective batch 72 = per-device 2 x accumulation 3 x world size 12"
    )


def test_ddp_buckets_are_counted_only_with_more_than_one_rank() -> None:
    one = Memory(1e9, "full", None, 1, SETTINGS["memory"], None)
    two = Memory(1e9, "full", None, 2, SETTINGS["memory"], None)
    margin = COEFFICIENTS["margin"]
    overhead = COEFFICIENTS["overhead_gib"] * GIB
    assert one.state("none") == pytest.approx(
        (COEFFICIENTS["step/full/none"] * 1e9 + overhead) * margin
    )
    assert two.state("none") - one.state("none") == pytest.approx(4e9 * margin)
    # ZeRO-2 keeps the bf16 weights whole and splits the rest of the measured state.
    split = 2 + (COEFFICIENTS["step/full/zero2"] - 2) / 2
    assert two.state("zero2") == pytest.approx((split * 1e9 + overhead) * margin)
