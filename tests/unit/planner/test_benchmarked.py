"""The plans for the benchmarked models reproduce the benchmarked settings (issue 17), and
torch.compile where it repays itself (planner/decisions.py choose_compile).
"""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.decisions import (
    choose_compile,
)

from tests.support.planning import (
    RTX4090_GIB,
    TRAINING,
    make_plan,
    nodes,
)

# ---------------------------------------------------------------------------------------------
# Issue 17: the plans for the benchmarked models reproduce the benchmarked settings.
# ---------------------------------------------------------------------------------------------

# The keys bench/bench_lf.py's presets set that the planner decides.
PLANNED = [
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "packing",
    "neat_packing",
    "disable_gradient_checkpointing",
    "ddp_find_unused_parameters",
    "bf16",
    "flash_attn",
]


# The benchmarked profiles (BENCHMARKS.md section 1: LLaMA-Factory's full example without
# checkpointing, packed rows of 1024, SDPA, no Liger), as the planner must reproduce them.
BENCHMARKED = {
    "packing": True,
    "neat_packing": False,
    "disable_gradient_checkpointing": True,
    "ddp_find_unused_parameters": False,
    "bf16": True,
    "flash_attn": "sdpa",
    "gradient_accumulation_steps": 1,
}
PRESETS = {
    "profile_noliger": {**BENCHMARKED, "per_device_train_batch_size": 3, "cutoff_len": 1024},
    "profile_noliger_mb8": {**BENCHMARKED, "per_device_train_batch_size": 8, "cutoff_len": 1024},
}


def _benchmarked(preset: str) -> dict[str, Any]:
    settings = PRESETS[preset]
    return {key: settings[key] for key in PLANNED}


@pytest.mark.parametrize(
    ("tokens", "preset"), [(3072, "profile_noliger"), (8192, "profile_noliger_mb8")]
)
def test_h200_plan_for_the_1_5b_full_fine_tune_is_the_benchmarked_profile(
    tokens: int, preset: str
) -> None:
    plan = make_plan(
        "qwen2.5-1.5b", finetuning_type="full", cutoff_len=1024, tokens_per_step=tokens
    )
    assert plan.stage.stage == "none"
    assert plan.model["cutoff_len"] == PRESETS[preset]["cutoff_len"]
    assert {key: plan.train_args.get(key) for key in PLANNED} == _benchmarked(preset)
    assert not plan.train_args.get("enable_liger_kernel", False)
    assert plan.train_args["pure_bf16"] is False


def test_h200_plan_for_the_7b_lora_is_3_packed_rows_without_checkpointing() -> None:
    # Issue 17: the same LoRA with 3 packed rows of 1024 and no checkpointing, 8.9x the example.
    plan = make_plan("qwen2.5-7b", cutoff_len=1024, tokens_per_step=3072)
    args = plan.train_args
    assert plan.stage.stage == "none"
    assert plan.model["finetuning_type"] == "lora"
    assert {key: args.get(key) for key in PLANNED} == _benchmarked("profile_noliger")
    assert plan.memory.estimate_gib >= 38.0  # measured peak, eager


def test_torch_compile_is_on_for_a_long_h200_run_and_off_for_a_short_one() -> None:
    long = make_plan(
        "qwen2.5-7b", cutoff_len=1024, tokens_per_step=3072, train_args={"max_steps": 5000}
    )
    short = make_plan(
        "qwen2.5-7b", cutoff_len=1024, tokens_per_step=3072, train_args={"max_steps": 80}
    )
    assert long.train_args["torch_compile"] is True
    assert "torch_compile" not in short.train_args
    assert short.batch.compile_why.startswith("about 80 optimizer steps of ~")
    assert "against ~126 s of compiling" in short.batch.compile_why


def test_a_run_of_2250_steps_compiles_where_compiling_repays_itself() -> None:
    # BENCHMARKS.md 7: 12,000 records, 3 epochs, 1.5B full on one H200 (2,250 estimated steps).
    # Compiling took about 60 s and saved 53 ms of 0.253 s a step: (c3) finished before (d).
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", dataset_records=12000)
    assert plan.batch.steps == 2250
    assert plan.train_args["torch_compile"] is True
    why = plan.batch.compile_why
    saved = float(why.split(" save ~")[1].split(" s")[0])
    assert 84 <= saved <= 2250 * 0.30 * 0.19, why


def test_compile_without_a_model_shape_needs_the_minimum_steps() -> None:
    settings = TRAINING["training_compile"]
    assert choose_compile("gpu", "none", 2999, settings) == (
        False,
        "about 2999 optimizer steps, fewer than the 3000 that repay it",
    )
    use, why = choose_compile("gpu", "none", 3000, settings)
    assert use
    assert "model shape unknown" in why
    use, why = choose_compile("gpu", "none", 1000, settings, step_seconds=0.5, finetuning="lora")
    assert (use, why) == (
        False,
        "about 1000 optimizer steps of ~0.50 s save ~105 s (21% of each) against ~126 s of "
        "compiling",
    )
    assert choose_compile("gpu", "none", 1000, settings, step_seconds=0.5)[0] is True


@pytest.mark.parametrize(
    ("model", "finetuning"), [("qwen2.5-1.5b", "full"), ("qwen2.5-7b", "lora")]
)
def test_h200_plans_of_a_5_epoch_run_are_what_benchmarks_3_1_measured(
    model: str, finetuning: str
) -> None:
    # BENCHMARKS.md 3.1: 12000 records, num_train_epochs 5, the default cutoff and tokens per
    # step; train.yml rendered 4 packed rows of 2048 x 1, no checkpointing, plain DDP, compiled.
    plan = make_plan(
        model, finetuning_type=finetuning, dataset_records=12000, train_args={"num_train_epochs": 5}
    )
    args = plan.train_args
    assert plan.stage.stage == "none"
    assert plan.model["cutoff_len"] == 2048
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (4, 1)
    assert args["packing"] is True
    assert args["disable_gradient_checkpointing"] is True
    assert args["torch_compile"] is True
    assert plan.batch.steps == 3750


def test_24gb_plans_for_the_benchmarked_models() -> None:
    full = make_plan(
        "qwen2.5-1.5b",
        cluster=nodes(1, gib=RTX4090_GIB),
        finetuning_type="full",
        cutoff_len=1024,
        tokens_per_step=3072,
    )
    # 16 bytes per parameter (24.7 GB) do not fit; bitsandbytes' 8-bit AdamW (2 bytes of state
    # instead of 8) keeps the run on the GPU, without DeepSpeed: 3 checkpointed rows.
    assert full.stage.stage == "none"
    assert full.train_args["optim"] == "adamw_8bit"
    assert full.train_args["per_device_train_batch_size"] == 3
    assert full.batch.checkpointing is True
    assert "torch_compile" not in full.train_args
    lora = make_plan(
        "qwen2.5-7b", cluster=nodes(1, gib=RTX4090_GIB), cutoff_len=1024, tokens_per_step=3072
    )
    # 15 GB of bf16 weights, and Liger's fused cross-entropy keeps the logits from being held
    # whole: three checkpointed rows at once (BENCHMARKS.md section 10).
    assert lora.stage.stage == "none"
    args = lora.train_args
    assert args["enable_liger_kernel"] is True
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (3, 1)
    assert lora.batch.checkpointing is True
    assert lora.batch.tokens_per_step == 3072
    for planned in (full, lora):
        assert planned.train_args["packing"] is True
        assert planned.memory.estimate_gib <= planned.memory.budget_gib < RTX4090_GIB


# ---------------------------------------------------------------------------------------------
# torch.compile.
# ---------------------------------------------------------------------------------------------


def test_compile_steps_are_estimated_from_the_record_count() -> None:
    # 4 rows of 2048 tokens, each about 4 records of 512 tokens: 16 records per step.
    plan = make_plan("qwen2.5-0.5b", dataset_records=10000)  # 625 steps an epoch, 3 epochs
    assert plan.batch.steps == 1875
    assert "torch_compile" not in plan.train_args
    longer = make_plan("qwen2.5-0.5b", dataset_records=50000)
    assert longer.batch.steps == 9375
    assert longer.train_args["torch_compile"] is True


def test_compile_is_off_when_the_run_length_is_unknown() -> None:
    plan = make_plan("qwen2.5-0.5b")
    assert "torch_compile" not in plan.train_args
    assert "run length unknown" in plan.batch.compile_why


def test_compile_is_never_on_for_cpus_or_deepspeed() -> None:
    cpu = make_plan("tiny", cluster=nodes(2, accelerator="cpu"), train_args={"max_steps": 10**5})
    zero = make_plan("qwen2.5-0.5b", deepspeed="zero2", train_args={"max_steps": 10**5})
    assert "torch_compile" not in cpu.train_args
    assert "torch_compile" not in zero.train_args
    assert cpu.batch.compile_why == "never on CPUs"


def test_compile_the_user_turns_off_stays_off() -> None:
    plan = make_plan("qwen2.5-0.5b", train_args={"max_steps": 10**5, "torch_compile": False})
    assert plan.train_args["torch_compile"] is False
    assert plan.batch.compile_why == "as set"
