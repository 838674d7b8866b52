"""torch.compile as a candidate of the search, FP8 weighed over the run, and every plan's time to
its first step (issue 46; planner/techniques.py COMPILE_SAVING, decisions.py choose_compile,
fp8_pays, first_step)."""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.cost import (
    Setup,
    step_cost,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.measured_memory import Shape
from ansible_collections.llama.cluster.plugins.module_utils.planner.techniques import (
    COMPILE_SAVING,
    PLAIN,
    Technique,
    candidates,
)
from test_planner import CATALOGUE, make_plan, nodes

# 50,000 records of about 512 tokens, 3 epochs of 4 packed rows a step: 9,375 optimizer steps.
LONG = {"dataset_records": 50000}
SHORT = {"dataset_records": 2000}


def line(plan: dict, start: str) -> str:
    return next(x for x in plan["summary"] if x.startswith(start))


def test_a_long_run_compiles_the_fastest_candidate_and_its_uncompiled_twin_is_the_runner_up():
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", **LONG)
    assert plan["train_args"]["torch_compile"] is True
    assert plan["technique"]["label"] == "torch.compile"
    assert plan["decisions"]["torch_compile"].startswith("about 9375 optimizer steps of ~")
    assert "(19% of each) against ~84 s of compiling" in plan["decisions"]["torch_compile"]
    assert "micro-batch 4 x accumulation 1, checkpointing off" in line(plan, "Runner-up")
    assert "torch.compile" not in line(plan, "Runner-up")


def test_a_short_run_searches_no_compiled_candidate_and_says_why():
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", **SHORT)
    assert "torch_compile" not in plan["train_args"]
    assert "against ~84 s of compiling" in plan["decisions"]["torch_compile"]
    assert "torch.compile" not in line(plan, "Runner-up")


def test_a_torch_compile_set_in_train_args_is_kept_and_no_twin_is_searched():
    plan = make_plan(
        "qwen2.5-1.5b", finetuning_type="full", train_args={"torch_compile": False}, **LONG
    )
    assert plan["train_args"]["torch_compile"] is False
    assert plan["decisions"]["torch_compile"] == "as set"
    assert plan["technique"]["label"] == "none"


def test_a_compiled_twin_exists_only_where_its_saving_was_measured_and_only_without_deepspeed():
    full = list(candidates("full", "none", compiling=True))
    for technique in full:
        if technique.compiled:
            assert technique.compile_saving("full") is not None
            assert technique.uncompiled in full
    assert Technique(compiled=True) in full
    assert not any(t.compiled for t in candidates("full", "zero2", compiling=True))
    assert not any(t.compiled for t in candidates("full", "none"))
    # QLoRA was not measured compiled: its candidates stay uncompiled.
    assert not any(t.compiled for t in candidates("lora", "none", quantization=4, compiling=True))


def test_a_compiled_step_is_its_twins_less_the_measured_saving():
    entry = CATALOGUE["qwen2.5-1.5b"]
    shape = Shape.from_config(entry["config"], entry["params_b"] * 1e9)
    plain = Setup(finetuning="full", stage="none", checkpointing=False, micro_tokens=8192)
    compiled = Setup(**{**plain.__dict__, "technique": Technique(compiled=True)})
    twin, fast = (step_cost(shape, s, world=1, link=None).compute for s in (plain, compiled))
    assert fast == pytest.approx(twin * (1 - COMPILE_SAVING[("full", "adamw_torch", False, 0)]))
    assert PLAIN.label() == ""
    assert Technique(optim="adamw_8bit", compiled=True).label() == "8-bit AdamW + torch.compile"


def test_every_gpu_plan_prints_its_first_step_with_its_compilation():
    compiled = make_plan("qwen2.5-1.5b", finetuning_type="full", **LONG)
    plain = make_plan("qwen2.5-1.5b", finetuning_type="full", **SHORT)
    said = line(compiled, "First optimizer step: about ")
    assert "compiling ~84 s" in said
    assert "compiling" not in line(plain, "First optimizer step: about ")
    cpu = make_plan("tiny", cluster=nodes(2, accelerator="cpu"))
    assert line(cpu, "First optimizer step:").endswith(
        "not predicted (a CPU cluster: measured on GPUs)"
    )


def fp8_nodes() -> list[dict]:
    return [{**n, "compute_capability": 9.0, "torchao": "0.17.0"} for n in nodes()]


def test_fp8_that_would_end_a_short_1_5b_run_later_than_bf16_is_refused_with_the_figures():
    with pytest.raises(PlanError) as refused:
        make_plan("qwen2.5-1.5b", finetuning_type="full", cluster=fp8_nodes(), fp8=True, **SHORT)
    message = str(refused.value)
    assert message.startswith("FP8 would end this run later than bf16: about ")
    assert "at the 1.06x measured at this shape, against ~156 s more compiling" in message
    assert "Leave fp8 off (bf16)" in message


def test_fp8_says_per_shape_what_it_gives_and_compiles():
    plan = make_plan("qwen2.5-7b", finetuning_type="full", cluster=fp8_nodes(), fp8=True, **LONG)
    assert plan["train_args"]["torch_compile"] is True
    said = plan["decisions"]["fp8"]
    assert "1.54B full fine-tune 1.06x bf16" in said
    assert "this run: not measured at 7.62B" in said
    assert "compiling ~240 s" in line(plan, "First optimizer step")
