"""The memory-saving techniques in the plan (issue 38): 8-bit AdamW, Liger, QLoRA, ZeRO-Offload,
the numerics policy that allows or forbids a change of numerics, and their refusals
(planner/techniques.py, planner/assembly.py)."""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError

from tests.support.planning import RTX4090_GIB, make_plan, nodes

A6000_GIB = 47.5  # an RTX A6000 / L40S: 48 GB


def technique_line(plan: dict) -> str:
    return next(x for x in plan.summary if x.startswith("Memory-saving technique:"))


def test_a_full_fine_tune_on_a_24_gib_card_stays_on_the_gpu_with_8_bit_adamw_and_liger() -> None:
    plan = make_plan("qwen2.5-1.5b", cluster=nodes(1, gib=RTX4090_GIB), finetuning_type="full")
    args = plan.train_args
    assert plan.stage.stage == "none"
    assert (args["optim"], args["enable_liger_kernel"]) == ("adamw_8bit", True)
    assert plan.technique.numerics_changes == ("8-bit AdamW states",)
    line = technique_line(plan)
    # The change of numerics is printed with its measured figure and the way to forbid it.
    assert "8-bit AdamW + Liger: the fastest predicted candidate that fits" in line
    assert "within 0.0031 of fp32 AdamW's" in line
    assert "-e numerics=exact forbids every numerics change" in line
    runner = next(x for x in plan.summary if x.startswith("Runner-up"))
    assert "8-bit AdamW" in runner


def test_numerics_exact_forbids_the_8_bit_optimizer_and_keeps_fp32_adamw_off_the_gpu() -> None:
    plan = make_plan(
        "qwen2.5-1.5b",
        cluster=nodes(1, gib=RTX4090_GIB),
        finetuning_type="full",
        numerics="exact",
    )
    assert plan.stage.stage == "zero2_offload"  # ZeRO-Offload: fp32 AdamW on the host
    assert "optim" not in plan.train_args
    assert plan.technique.numerics_changes == ()
    assert plan.technique.numerics == "exact"
    assert "Numerics: exact" in technique_line(plan)


def test_deepspeed_none_asked_on_a_24_gib_card_is_planned_with_what_makes_it_fit() -> None:
    plan = make_plan(
        "qwen2.5-1.5b",
        cluster=nodes(1, gib=RTX4090_GIB),
        finetuning_type="full",
        deepspeed="none",
    )
    assert plan.stage.stage == "none"
    assert plan.train_args["optim"] == "adamw_8bit"
    assert plan.memory.estimate_gib <= plan.memory.budget_gib


def test_deepspeed_none_with_numerics_exact_is_refused_with_the_way_out() -> None:
    with pytest.raises(PlanError) as refused:
        make_plan(
            "qwen2.5-1.5b",
            cluster=nodes(1, gib=RTX4090_GIB),
            finetuning_type="full",
            deepspeed="none",
            numerics="exact",
        )
    message = str(refused.value)
    assert "does not fit the GPUs with deepspeed=none" in message
    assert "8-bit AdamW:" not in message  # not tried: numerics=exact
    assert "-e numerics=measured (8-bit AdamW)" in message


def test_an_optimizer_the_user_sets_is_kept_and_planned_for() -> None:
    plan = make_plan(
        "qwen2.5-1.5b",
        cluster=nodes(1, gib=RTX4090_GIB),
        finetuning_type="full",
        train_args={"optim": "adamw_torch", "enable_liger_kernel": False},
    )
    assert plan.train_args["optim"] == "adamw_torch"
    assert plan.train_args["enable_liger_kernel"] is False
    assert plan.technique.label == "none"
    assert plan.stage.stage != "none"  # fp32 AdamW does not fit the GPU without sharding


def test_nodes_without_bitsandbytes_plan_without_8_bit_adamw_and_say_so() -> None:
    plan = make_plan(
        "qwen2.5-1.5b",
        cluster=nodes(1, gib=RTX4090_GIB, packages={"liger-kernel": "0.8.5"}),
        finetuning_type="full",
    )
    assert "optim" not in plan.train_args
    assert "Not considered: what needs bitsandbytes" in technique_line(plan)


def test_liger_is_tried_only_where_the_plain_run_must_recompute() -> None:
    # On 141 GiB the 1.5B fits without checkpointing: its plan is the one measured at 0.99 of an
    # expert's (BENCHMARKS.md section 7), with no technique.
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full")
    args = plan.train_args
    assert plan.stage.stage == "none"
    assert plan.technique.label == "none"
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (4, 1)
    assert args["disable_gradient_checkpointing"] is True
    assert "enable_liger_kernel" not in args
    assert "optim" not in args


def test_a_4b_full_fine_tune_on_48_gib_trains_without_deepspeed() -> None:
    plan = make_plan("qwen3-4b", cluster=nodes(1, gib=A6000_GIB), finetuning_type="full")
    assert plan.stage.stage == "none"
    assert plan.train_args["optim"] == "adamw_8bit"


# -- QLoRA -----------------------------------------------------------------------------------


def test_qlora_asked_for_is_planned_on_a_24_gib_card() -> None:
    plan = make_plan(
        "qwen2.5-14b", cluster=nodes(1, gib=RTX4090_GIB), finetuning_type="lora", quantization_bit=4
    )
    args = plan.train_args
    assert plan.stage.stage == "none"
    assert (args["quantization_bit"], args["quantization_method"]) == (4, "bnb")
    assert args["double_quantization"] is True
    assert plan.technique.numerics_changes == ("4-bit frozen weights",)
    assert plan.memory.estimate_gib <= plan.memory.budget_gib


def test_qlora_asked_in_train_args_is_planned_as_qlora() -> None:
    plan = make_plan(
        "qwen2.5-14b",
        cluster=nodes(1, gib=RTX4090_GIB),
        finetuning_type="lora",
        train_args={"quantization_bit": 4},
    )
    assert plan.technique.quantization_bit == 4


def test_the_planner_chooses_qlora_where_bf16_weights_fit_only_offloaded_and_says_so() -> None:
    plan = make_plan("qwen2.5-14b", cluster=nodes(1, gib=RTX4090_GIB), finetuning_type="lora")
    assert plan.stage.stage == "none"
    assert plan.train_args["quantization_bit"] == 4
    line = technique_line(plan)
    assert "chosen by the planner because the bf16 weights fit the GPU with no stage" in line
    runner = next(x for x in plan.summary if x.startswith("Runner-up"))
    assert "zero3_offload" in runner


def test_numerics_exact_keeps_a_14b_lora_in_bf16_offloaded() -> None:
    plan = make_plan(
        "qwen2.5-14b", cluster=nodes(1, gib=RTX4090_GIB), finetuning_type="lora", numerics="exact"
    )
    assert plan.stage.stage == "zero3_offload"
    assert "quantization_bit" not in plan.train_args


@pytest.mark.parametrize(
    ("extra", "cluster", "expected"),
    [
        ({"finetuning_type": "full"}, None, "add -e finetuning_type=lora"),
        ({"deepspeed": "zero3"}, None, "measured with plain DDP only, not deepspeed=zero3"),
        ({"numerics": "exact"}, None, "numerics=exact forbids every such change"),
        ({}, nodes(1, accelerator="cpu"), "need NVIDIA GPUs"),
        ({}, nodes(2, gib=RTX4090_GIB, packages={}), "which n0, n1 lack: run provision.yml"),
    ],
)
def test_qlora_that_cannot_be_planned_is_refused_naming_the_fix(
    extra: dict, cluster: list | None, expected: str
) -> None:
    asked = {"finetuning_type": "lora", "quantization_bit": 4, **extra}
    with pytest.raises(PlanError, match="QLoRA cannot be planned") as refused:
        make_plan("qwen2.5-14b", cluster=cluster or nodes(1, gib=RTX4090_GIB), **asked)
    assert expected in str(refused.value)


def test_a_quantization_the_planner_did_not_measure_is_refused() -> None:
    with pytest.raises(PlanError, match=r"-e quantization_bit = 8 \(must be one of 0, 4"):
        make_plan("qwen2.5-14b", finetuning_type="lora", quantization_bit=8)


def test_an_unknown_numerics_policy_is_refused() -> None:
    refusal = r"-e numerics .* = 'loose' \(must be one of measured, exact"
    with pytest.raises(PlanError, match=refusal):
        make_plan("qwen2.5-1.5b", numerics="loose")


def test_fp8_is_a_numerics_change_that_exact_forbids() -> None:
    with pytest.raises(PlanError, match="FP8 changes the run's numerics"):
        make_plan("qwen2.5-1.5b", finetuning_type="full", fp8=True, numerics="exact")


def test_a_cpu_run_that_does_not_fit_the_host_memory_free_now_is_refused() -> None:
    cluster = nodes(2, accelerator="cpu")
    for node in cluster:
        node.update(host_memory_gib=0.5, host_memory_source="available now (MemAvailable)")
    with pytest.raises(PlanError, match="The run does not fit the nodes' memory") as refused:
        make_plan("tiny", cluster=cluster)
    assert "n0 (available now (MemAvailable)) has 0.4 GiB to give" in str(refused.value)


@pytest.mark.parametrize(("finetuning", "lora_offered"), [("lora", False), ("full", True)])
def test_too_many_processes_per_node_are_refused_naming_the_count_that_fits(
    finetuning: str, lora_offered: bool
) -> None:
    # Issue 48: nproc_per_node=1000 on a LoRA run was told to try LoRA. The way out is the
    # number of processes the node's memory holds; LoRA only for a full fine-tune it would fit.
    cluster = nodes(2, nproc=1000 if finetuning == "lora" else 2, accelerator="cpu")
    for node in cluster:
        node.update(host_memory_gib=15.0 if finetuning == "lora" else 8.0, host_memory_source="x")
    with pytest.raises(PlanError) as refused:
        make_plan("qwen2.5-0.5b", cluster=cluster, finetuning_type=finetuning)
    said = str(refused.value)
    assert "train fewer processes per node" in said or "-e nproc_per_node=" in said
    if finetuning == "lora":
        assert "its 1000 training processes per node" in said
        assert "train 4 processes per node (-e nproc_per_node=4 fits)" in said
    assert ("LoRA (-e finetuning_type=lora)" in said) is lora_offered
