"""The DeepSpeed stage (planner/decisions.py choose_stage, one rule over the search): every
catalogue model x GPU memory x node count x fine-tuning type, a stage asked for, a rule's.
"""

from __future__ import annotations

import re

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError

from tests.support.planning import (
    GPU_MODELS,
    H200_GIB,
    MEMORIES,
    NODE_COUNTS,
    SETTINGS,
    make_plan,
    nodes,
)

# ---------------------------------------------------------------------------------------------
# The DeepSpeed stage: every catalogue model x GPU memory x node count x fine-tuning type.
# ---------------------------------------------------------------------------------------------

# One GPU per node (world size = node count). Cells: 24 | 48 | 80 | 141 GiB, each "1 2 4 nodes".
# One node is the measured model (BENCHMARKS.md section 5); several are extrapolated from it.
# none = DDP, z1 = ZeRO-1, z2 = ZeRO-2, o2 = ZeRO-2 with the optimizer offloaded (ZeRO-Offload),
# z3 = ZeRO-3, off = ZeRO-3 with CPU offload; +8, +L, +8L: the technique (TECHNIQUE_MARK). The
# stage is the fastest that fits by the cost model (planner/cost.py); these nodes have no link
# facts, so communication is not counted: ZeRO-1 wins over ZeRO-2 wherever it fits (it moves
# its gradients once per step), and a sharded stage over DDP where it lets the micro-batch grow
# without recomputation.
STAGE_TABLE = {
    ("qwen2.5-14b", "lora"): "none+Q off z3 | none+L none+L none+L | "
    "none none none | none none none",
    ("qwen2.5-14b", "full"): "off off off | o2 o2 o2 | o2 o2 o2 | o2 o2 z1",
    ("llama3-8b", "lora"): "none+L none+L none+L | none none none | "
    "none none none | none none none",
    ("llama3-8b", "full"): "off off off | o2 o2 o2 | o2 o2 z1 | none z2 z1",
    ("qwen-7b", "lora"): "none+L none+L none+L | none none none | none none none | none none none",
    ("qwen-7b", "full"): "off off off | o2 o2 o2 | o2 o2 z1 | none none+8 none+8",
    ("qwen2.5-0.5b", "lora"): "none none none | none none none | none none none | none none none",
    ("qwen2.5-0.5b", "full"): "none+8 none+8 none+8 | none none none | "
    "none none none | none none none",
    ("qwen2.5-1.5b", "lora"): "none none none | none none none | none none none | none none none",
    ("qwen2.5-1.5b", "full"): "none+8L z1 z1 | none none none | none none none | none none none",
    ("qwen2.5-7b", "lora"): "none+L none+L none+L | none none none | "
    "none none none | none none none",
    ("qwen2.5-7b", "full"): "off off off | o2 o2 o2 | o2 o2 z1 | none none+8 none+8",
    ("qwen3-0.6b", "lora"): "none none none | none none none | none none none | none none none",
    ("qwen3-0.6b", "full"): "none+8 z1 z1 | none none none | none none none | none none none",
    ("qwen3-1.7b", "lora"): "none none none | none none none | none none none | none none none",
    ("qwen3-1.7b", "full"): "none+8L z2 z1 | none none+8 none+8 | none none none | none none none",
    ("qwen3-4b", "lora"): "none+L none+L none+L | none none none | none none none | none none none",
    ("qwen3-4b", "full"): "o2 o2 o2 | none+8L o2 z1 | none none+8 none+8 | none none none",
    ("qwen3-8b", "lora"): "none+L none+L none+L | none none none | none none none | none none none",
    ("qwen3-8b", "full"): "off off off | o2 o2 o2 | o2 o2 z1 | none none+8 z1",
}
# The memory-saving technique beside the stage (planner/techniques.py): +8 bitsandbytes' 8-bit
# AdamW, +L Liger's kernels, +8L both, +Q QLoRA.
TECHNIQUE_MARK = {"none": "", "8-bit AdamW": "+8", "Liger": "+L", "8-bit AdamW + Liger": "+8L",
                  "QLoRA 4-bit": "+Q"}  # fmt: skip
SHORT = {"none": "none", "zero1": "z1", "zero2": "z2", "zero2_offload": "o2", "zero3": "z3",
         "zero3_offload": "off"}  # fmt: skip


def stage_cases() -> list[tuple[str, str, int, int, str]]:
    cases = []
    for (model, finetuning), cells in STAGE_TABLE.items():
        for gib, row in zip(MEMORIES, cells.split(" | "), strict=True):
            for count, stage in zip(NODE_COUNTS, row.split(), strict=True):
                cases.append((model, finetuning, gib, count, stage))
    return cases


def test_the_stage_table_covers_every_catalogue_model() -> None:
    assert sorted({model for model, _ in STAGE_TABLE}) == GPU_MODELS


@pytest.mark.parametrize(("model", "finetuning", "gib", "count", "stage"), stage_cases())
def test_deepspeed_stage(model: str, finetuning: str, gib: int, count: int, stage: str) -> None:
    plan = make_plan(model, cluster=nodes(count, gib=gib), finetuning_type=finetuning)
    label = plan.technique.label
    assert SHORT[plan.stage.stage] + TECHNIQUE_MARK[label] == stage
    assert plan.memory.estimate_gib <= plan.memory.budget_gib


@pytest.mark.parametrize("model", GPU_MODELS)
@pytest.mark.parametrize("gib", MEMORIES)
def test_freeze_plans_like_lora(model: str, gib: int) -> None:
    lora = make_plan(model, cluster=nodes(2, gib=gib), finetuning_type="lora")
    freeze = make_plan(model, cluster=nodes(2, gib=gib), finetuning_type="freeze")
    assert freeze.stage.stage == lora.stage.stage
    assert freeze.batch.checkpointing == lora.batch.checkpointing


def test_eight_gpu_nodes_shard_a_full_7b_with_zero1_not_zero3() -> None:
    plan = make_plan(cluster=nodes(2, nproc=8, gib=80), finetuning_type="full")
    assert plan.stage.stage == "zero1"
    assert plan.world_size == 16


def test_a_stage_asked_for_is_kept_and_said_so() -> None:
    plan = make_plan("qwen2.5-0.5b", deepspeed="zero3")
    assert plan.stage.stage == "zero3"
    line = next(x for x in plan.summary if x.startswith("DeepSpeed:"))
    assert line.startswith("DeepSpeed: zero3 (deepspeed=zero3 given; the fastest predicted of its")


def test_a_stage_asked_for_that_does_not_fit_is_refused_with_what_each_technique_needs() -> None:
    with pytest.raises(PlanError) as refused:
        make_plan("llama3-8b", cluster=nodes(1, gib=24), finetuning_type="full", deepspeed="none")
    message = str(refused.value)
    assert message.startswith("The run does not fit the GPUs with deepspeed=none")
    assert re.search(r"plain: 1\d\d\.\d GiB; .*8-bit AdamW: \d+\.\d GiB", message)
    assert "the budget is 20.7 GiB" in message
    assert "Nothing was changed on any node." in message


def test_cpu_clusters_train_with_plain_ddp() -> None:
    plan = make_plan("tiny", cluster=nodes(2, accelerator="cpu"))
    assert plan.stage.stage == "none"
    assert plan.memory.gpu_gib is None
    assert "CPU cluster" in plan.stage.why


def test_the_plan_is_for_the_smallest_gpu_of_any_node() -> None:
    cluster = nodes(2, gib=H200_GIB)
    cluster[1]["gpu_memory_gib"] = 24.0
    plan = make_plan("qwen2.5-1.5b", cluster=cluster, finetuning_type="full")
    alone = make_plan("qwen2.5-1.5b", cluster=nodes(2, gib=24.0), finetuning_type="full")
    assert plan.memory.gpu_gib == 24.0
    assert plan.stage.stage == alone.stage.stage == "zero1"
    assert any("smallest node: n1" in line for line in plan.summary)


def test_a_model_too_long_for_any_stage_is_refused() -> None:
    with pytest.raises(PlanError, match=r"even with ZeRO-3 and CPU offload.*Lower cutoff_len"):
        make_plan("llama3-8b", cluster=nodes(1, gib=24), cutoff_len=65536)


def test_a_profile_rule_may_choose_the_stage() -> None:
    rules = [
        *SETTINGS["rules"],
        {"name": "ZeRO-2 for 8B", "when": {"model": "llama3-8b"}, "set": {"deepspeed": "zero2"}},
    ]
    plan = make_plan("llama3-8b", settings={**SETTINGS, "rules": rules})
    assert plan.stage.stage == "zero2"
    assert "deepspeed" not in plan.train_args
    asked = make_plan("llama3-8b", settings={**SETTINGS, "rules": rules}, deepspeed="zero3")
    assert asked.stage.stage == "zero3"
