"""The run planner (plugins/module_utils/planner), rule by rule, with the project's own data.

The catalogue and the rules are read from group_vars/all/models.yml and training.yml, so these
tests check what train.yml plans today; the playbook path is in
tests/unit/planner/test_train_validation.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter.run_config import (
    dataset_info,
    train_args,
    train_yaml,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import plan
from ansible_collections.llama.cluster.plugins.module_utils.planner.decisions import (
    check_dataset_batch,
    choose_compile,
    largest_micro,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.measured_memory import (
    COEFFICIENTS,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.memory import GIB, Memory
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    find_model,
    layer_class,
    model_params,
    model_shape,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    cluster_accelerator,
    describe_nodes,
    hosts_without_gpu_facts,
    node_gpu_memory,
    node_host_memory,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.rules import (
    RULE_KEYS,
    apply_rules,
    rule_matches,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import check_request

ROOT = Path(__file__).resolve().parents[3]


CATALOGUE = yaml.safe_load((ROOT / "group_vars/all/models.yml").read_text())["models_catalogue"]
TRAINING = yaml.safe_load((ROOT / "group_vars/all/training.yml").read_text())
STAGES = ["none", "zero0", "zero2", "zero3", "zero3_offload", "fsdp"]
SETTINGS = {
    "catalogue": CATALOGUE,
    "defaults": TRAINING["training_defaults"],
    "rules": TRAINING["training_profile_rules"],
    "memory": TRAINING["training_memory"],
    "compile": TRAINING["training_compile"],
    "stages": STAGES,
}
H200_GIB = round(143771 / 1024, 1)  # what an H200 reports (nvidia-smi memory.total, MiB)
RTX4090_GIB = round(24564 / 1024, 1)  # a 24 GB card
GPU_MODELS = sorted(m for m in CATALOGUE if m != "tiny")
QWEN25_7B_CONFIG = {  # Qwen2.5-7B's config.json, the fields that matter
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
}


# The optional packages of a provisioned node's stack (the lock installs them everywhere).
STACK = {"bitsandbytes": "0.50.2", "liger-kernel": "0.8.5"}


def nodes(
    count: int = 1,
    nproc: int = 1,
    gib: float | None = H200_GIB,
    accelerator: str = "nvidia",
    packages: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    return [
        {
            "host": f"n{i}",
            "rank": i,
            "accelerator": accelerator,
            "nproc": nproc,
            "gpu_memory_gib": None if accelerator == "cpu" else gib,
            "memory_source": "CPU node" if accelerator == "cpu" else "facts, GPU",
            "packages": STACK if packages is None else packages,
        }
        for i in range(count)
    ]


def request(model: str = "qwen2.5-7b", **extra: Any) -> dict[str, Any]:
    asked = {
        "model": model,
        "deepspeed": "auto",
        "train_args": {},
        "tokens_per_step": TRAINING["training_tokens_per_step"],
        "max_restarts": 0,
        "cutoff_len": 0,
        "timestamp": "20260101-000000",
    }
    asked.update(extra)
    return asked


def make_plan(
    model: str = "qwen2.5-7b",
    *,
    cluster: list[dict[str, Any]] | None = None,
    settings: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    cluster = nodes() if cluster is None else cluster
    return plan(
        request(model, **extra),
        nodes=cluster,
        ranks={n["host"]: n["rank"] for n in cluster},
        datasets=[{"name": "demo_alpaca", "file": "data/demo_alpaca.json", "formatting": "alpaca"}],
        settings=settings or SETTINGS,
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
MEMORIES = (24, 48, 80, 141)
NODE_COUNTS = (1, 2, 4)


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
    label = plan["technique"]["label"]
    assert SHORT[plan["deepspeed"]] + TECHNIQUE_MARK[label] == stage
    assert plan["memory_estimate_gib"] <= plan["memory_budget_gib"]


@pytest.mark.parametrize("model", GPU_MODELS)
@pytest.mark.parametrize("gib", MEMORIES)
def test_freeze_plans_like_lora(model: str, gib: int) -> None:
    lora = make_plan(model, cluster=nodes(2, gib=gib), finetuning_type="lora")
    freeze = make_plan(model, cluster=nodes(2, gib=gib), finetuning_type="freeze")
    assert freeze["deepspeed"] == lora["deepspeed"]
    assert freeze["gradient_checkpointing"] == lora["gradient_checkpointing"]


def test_eight_gpu_nodes_shard_a_full_7b_with_zero1_not_zero3() -> None:
    plan = make_plan(cluster=nodes(2, nproc=8, gib=80), finetuning_type="full")
    assert plan["deepspeed"] == "zero1"
    assert plan["world_size"] == 16


def test_a_stage_asked_for_is_kept_and_said_so() -> None:
    plan = make_plan("qwen2.5-0.5b", deepspeed="zero3")
    assert plan["deepspeed"] == "zero3"
    line = next(x for x in plan["summary"] if x.startswith("DeepSpeed:"))
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
    assert plan["deepspeed"] == "none"
    assert plan["gpu_memory_gib"] is None
    assert "CPU cluster" in plan["decisions"]["deepspeed"]


def test_the_plan_is_for_the_smallest_gpu_of_any_node() -> None:
    cluster = nodes(2, gib=H200_GIB)
    cluster[1]["gpu_memory_gib"] = 24.0
    plan = make_plan("qwen2.5-1.5b", cluster=cluster, finetuning_type="full")
    alone = make_plan("qwen2.5-1.5b", cluster=nodes(2, gib=24.0), finetuning_type="full")
    assert plan["gpu_memory_gib"] == 24.0
    assert plan["deepspeed"] == alone["deepspeed"] == "zero1"
    assert any("smallest node: n1" in line for line in plan["summary"])


def test_a_model_too_long_for_any_stage_is_refused() -> None:
    with pytest.raises(PlanError, match=r"even with ZeRO-3 and CPU offload.*Lower cutoff_len"):
        make_plan("llama3-8b", cluster=nodes(1, gib=24), cutoff_len=65536)


def test_a_profile_rule_may_choose_the_stage() -> None:
    rules = [
        *SETTINGS["rules"],
        {"name": "ZeRO-2 for 8B", "when": {"model": "llama3-8b"}, "set": {"deepspeed": "zero2"}},
    ]
    plan = make_plan("llama3-8b", settings={**SETTINGS, "rules": rules})
    assert plan["deepspeed"] == "zero2"
    assert "deepspeed" not in plan["train_args"]
    asked = make_plan("llama3-8b", settings={**SETTINGS, "rules": rules}, deepspeed="zero3")
    assert asked["deepspeed"] == "zero3"


# ---------------------------------------------------------------------------------------------
# The profile rules (data) and what they produce.
# ---------------------------------------------------------------------------------------------


def test_gpu_profile_sets_precision_attention_and_packing() -> None:
    args = make_plan()["train_args"]
    assert args["bf16"] is True
    assert args["pure_bf16"] is False
    assert args["flash_attn"] == "sdpa"
    assert args["packing"] is True
    assert args["neat_packing"] is False
    assert "enable_liger_kernel" not in args  # Liger stays off (LLaMA-Factory's default)


def test_cpu_profile_sets_fp32_single_workers_and_model_only_checkpoints() -> None:
    plan = make_plan("tiny", cluster=nodes(2, accelerator="cpu"))
    args = plan["train_args"]
    assert args["bf16"] is False
    assert (args["preprocessing_num_workers"], args["dataloader_num_workers"]) == (1, 0)
    assert args["save_only_model"] is True
    assert "packing" not in args
    assert "torch_compile" not in args
    single = make_plan("tiny", cluster=nodes(1, accelerator="cpu"))["train_args"]
    assert "save_only_model" not in single  # the rule needs min_world_size 2


def test_pretraining_is_not_packed_by_the_sft_rule() -> None:
    args = make_plan(train_args={"stage": "pt"})["train_args"]
    assert "packing" not in args


def test_rules_match_lists_and_ranges() -> None:
    facts = {"accelerator": "nvidia", "params_b": 7.6, "gpu_memory_gib": 80.0, "world_size": 2}
    assert rule_matches({"when": {"accelerator": ["cpu", "nvidia"]}}, facts)
    assert rule_matches({"when": {"min_params_b": 7, "max_params_b": 8}}, facts)
    assert not rule_matches({"when": {"max_params_b": 3}}, facts)
    assert not rule_matches({"when": {"min_world_size": 4}}, facts)
    assert not rule_matches({"when": {"min_gpu_memory_gib": 24}}, {"gpu_memory_gib": None})
    assert rule_matches({"set": {}}, facts)  # no `when`: always


def test_later_rules_win_and_every_matching_rule_is_named() -> None:
    rules = [
        {"name": "first", "when": {"accelerator": "nvidia"}, "set": {"logging_steps": 5}},
        {"name": "second", "when": {"min_params_b": 1}, "set": {"logging_steps": 7}},
        {"name": "never", "when": {"accelerator": "cpu"}, "set": {"logging_steps": 9}},
    ]
    settings, names = apply_rules(rules, {"accelerator": "nvidia", "params_b": 7.6})
    assert settings == {"logging_steps": 7}
    assert names == ["first", "second"]


def test_a_rule_testing_an_unknown_key_is_refused_with_the_keys_allowed() -> None:
    rules = [{"name": "typo", "when": {"acelerator": "nvidia"}, "set": {"bf16": True}}]
    with pytest.raises(PlanError, match=r"'typo'.*tests acelerator.*Keys a rule can test: "):
        make_plan(settings={**SETTINGS, "rules": rules})


def test_every_rule_key_is_documented_in_training_yml() -> None:
    text = (ROOT / "group_vars/all/training.yml").read_text()
    for key in RULE_KEYS:
        assert key in text, key


def test_the_users_train_args_win_over_the_profile_and_the_defaults() -> None:
    plan = make_plan(train_args={"packing": False, "learning_rate": 2e-5, "bf16": False})
    assert plan["train_args"]["packing"] is False
    assert plan["train_args"]["bf16"] is False
    assert plan["train_args"]["learning_rate"] == 2e-5


# ---------------------------------------------------------------------------------------------
# Micro-batch, accumulation, checkpointing: the batch rule and the effective batch.
# ---------------------------------------------------------------------------------------------


def test_rows_per_step_come_from_tokens_per_step_and_cutoff() -> None:
    plan = make_plan("qwen2.5-0.5b", cutoff_len=1024, tokens_per_step=6144)
    assert plan["train_args"]["per_device_train_batch_size"] == 6
    assert plan["train_args"]["gradient_accumulation_steps"] == 1
    assert plan["tokens_per_step"] == 6144


def test_rows_round_to_whole_rows() -> None:
    plan = make_plan("qwen2.5-0.5b", tokens_per_step=3072)  # 1.5 rows of 2048
    assert plan["tokens_per_step"] == 4096


def test_the_micro_batch_is_the_largest_divisor_that_fits_without_checkpointing() -> None:
    # 7B LoRA on 80 GiB: 4 rows of 2048 per step; 3 would not fit, 2 do: 2 x 2.
    plan = make_plan(cluster=nodes(1, gib=80))
    args = plan["train_args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 2)
    assert args["disable_gradient_checkpointing"] is True
    assert args["ddp_find_unused_parameters"] is False


def test_checkpointing_stays_on_where_no_micro_batch_fits_without_it() -> None:
    # Without Liger (a node whose stack lacks it): 7B LoRA's logits leave room for one row.
    plan = make_plan(cluster=nodes(1, gib=RTX4090_GIB, packages={}))
    args = plan["train_args"]
    assert plan["deepspeed"] == "none"
    assert plan["gradient_checkpointing"] is True
    assert "disable_gradient_checkpointing" not in args
    assert "ddp_find_unused_parameters" not in args
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 4)
    assert "would not fit without recomputing" in plan["decisions"]["checkpointing"]


def test_a_micro_batch_the_user_sets_is_kept_and_the_accumulation_follows() -> None:
    plan = make_plan("qwen2.5-0.5b", cutoff_len=1024, train_args={"per_device_train_batch_size": 2})
    args = plan["train_args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (2, 4)


def test_an_accumulation_the_user_sets_is_kept_and_the_micro_batch_follows() -> None:
    plan = make_plan("qwen2.5-0.5b", cutoff_len=1024, train_args={"gradient_accumulation_steps": 2})
    args = plan["train_args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (4, 2)


def test_without_packing_the_batch_comes_from_the_defaults() -> None:
    plan = make_plan("qwen2.5-0.5b", train_args={"packing": False})
    args = plan["train_args"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 8)
    assert any("at most: samples of up to 2048" in line for line in plan["summary"])


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
    assert fits["deepspeed"] == "none"
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
    assert plan["gradient_checkpointing"] is True
    assert plan["decisions"]["checkpointing"] == "as set"


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
    args = plan["train_args"]
    world = count * nproc
    assert plan["world_size"] == world
    assert plan["effective_batch"] == effective
    assert (
        args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] * world
        == effective
    )
    assert plan["tokens_per_optimizer_step"] == plan["tokens_per_step"] * world


def test_cpu_effective_batch_uses_the_catalogue_and_the_users_values() -> None:
    plan = make_plan(
        "tiny",
        cluster=nodes(3, nproc=4, accelerator="cpu"),
        train_args={"gradient_accumulation_steps": 3},
    )
    assert "Nodes 3 x 4 processes = world size 12 (cpu)" in plan["summary"]
    assert plan["effective_batch"] == 72
    assert plan["summary"][2].startswith(
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


# ---------------------------------------------------------------------------------------------
# The memory model against what BENCHMARKS.md section 1 measured (peak allocated, one H200).
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "finetuning", "tokens", "world", "measured_gib"),
    [
        ("qwen2.5-0.5b", "full", 3072, 1, 16.3),
        ("qwen2.5-0.5b", "full", 8192, 1, 32.6),
        ("qwen2.5-1.5b", "full", 3072, 1, 35.0),
        ("qwen2.5-1.5b", "full", 8192, 1, 59.6),
        ("qwen2.5-0.5b", "full", 3072, 2, 18.2),  # two nodes: + DDP's gradient buckets
        ("qwen2.5-1.5b", "full", 3072, 2, 40.7),
        ("qwen2.5-7b", "lora", 3072, 1, 38.0),  # issue 17, eager
    ],
)
def test_the_memory_model_overestimates_every_measured_peak_by_at_most_15_percent(
    model: str, finetuning: str, tokens: int, world: int, measured_gib: float
) -> None:
    entry = CATALOGUE[model]
    memory = Memory(
        model_params(entry["config"]),
        finetuning,
        model_shape(entry["config"]),
        world,
        SETTINGS["memory"],
        None,
    )
    estimate = memory.need("none", tokens, checkpointing=False) / GIB
    assert measured_gib <= estimate <= measured_gib * 1.15


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
    assert plan["deepspeed"] == "none"
    assert plan["model"]["cutoff_len"] == PRESETS[preset]["cutoff_len"]
    assert {key: plan["train_args"].get(key) for key in PLANNED} == _benchmarked(preset)
    assert not plan["train_args"].get("enable_liger_kernel", False)
    assert plan["train_args"]["pure_bf16"] is False


def test_h200_plan_for_the_7b_lora_is_3_packed_rows_without_checkpointing() -> None:
    # Issue 17: the same LoRA with 3 packed rows of 1024 and no checkpointing, 8.9x the example.
    plan = make_plan("qwen2.5-7b", cutoff_len=1024, tokens_per_step=3072)
    args = plan["train_args"]
    assert plan["deepspeed"] == "none"
    assert plan["model"]["finetuning_type"] == "lora"
    assert {key: args.get(key) for key in PLANNED} == _benchmarked("profile_noliger")
    assert plan["memory_estimate_gib"] >= 38.0  # measured peak, eager


def test_torch_compile_is_on_for_a_long_h200_run_and_off_for_a_short_one() -> None:
    long = make_plan(
        "qwen2.5-7b", cutoff_len=1024, tokens_per_step=3072, train_args={"max_steps": 5000}
    )
    short = make_plan(
        "qwen2.5-7b", cutoff_len=1024, tokens_per_step=3072, train_args={"max_steps": 80}
    )
    assert long["train_args"]["torch_compile"] is True
    assert "torch_compile" not in short["train_args"]
    assert short["decisions"]["torch_compile"].startswith("about 80 optimizer steps of ~")
    assert "against ~126 s of compiling" in short["decisions"]["torch_compile"]


def test_a_run_of_2250_steps_compiles_where_compiling_repays_itself() -> None:
    # BENCHMARKS.md 7: 12,000 records, 3 epochs, 1.5B full on one H200 (2,250 estimated steps).
    # Compiling took about 60 s and saved 53 ms of 0.253 s a step: (c3) finished before (d).
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", dataset_records=12000)
    assert plan["decisions"]["estimated_steps"] == "2250"
    assert plan["train_args"]["torch_compile"] is True
    why = plan["decisions"]["torch_compile"]
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
    args = plan["train_args"]
    assert plan["deepspeed"] == "none"
    assert plan["model"]["cutoff_len"] == 2048
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (4, 1)
    assert args["packing"] is True
    assert args["disable_gradient_checkpointing"] is True
    assert args["torch_compile"] is True
    assert plan["decisions"]["estimated_steps"] == "3750"


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
    assert full["deepspeed"] == "none"
    assert full["train_args"]["optim"] == "adamw_8bit"
    assert full["train_args"]["per_device_train_batch_size"] == 3
    assert full["gradient_checkpointing"] is True
    assert "torch_compile" not in full["train_args"]
    lora = make_plan(
        "qwen2.5-7b", cluster=nodes(1, gib=RTX4090_GIB), cutoff_len=1024, tokens_per_step=3072
    )
    # 15 GB of bf16 weights, and Liger's fused cross-entropy keeps the logits from being held
    # whole: three checkpointed rows at once (BENCHMARKS.md section 10).
    assert lora["deepspeed"] == "none"
    args = lora["train_args"]
    assert args["enable_liger_kernel"] is True
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (3, 1)
    assert lora["gradient_checkpointing"] is True
    assert lora["tokens_per_step"] == 3072
    for planned in (full, lora):
        assert planned["train_args"]["packing"] is True
        assert planned["memory_estimate_gib"] <= planned["memory_budget_gib"] < RTX4090_GIB


# ---------------------------------------------------------------------------------------------
# torch.compile.
# ---------------------------------------------------------------------------------------------


def test_compile_steps_are_estimated_from_the_record_count() -> None:
    # 4 rows of 2048 tokens, each about 4 records of 512 tokens: 16 records per step.
    plan = make_plan("qwen2.5-0.5b", dataset_records=10000)  # 625 steps an epoch, 3 epochs
    assert plan["decisions"]["estimated_steps"] == "1875"
    assert "torch_compile" not in plan["train_args"]
    longer = make_plan("qwen2.5-0.5b", dataset_records=50000)
    assert longer["decisions"]["estimated_steps"] == "9375"
    assert longer["train_args"]["torch_compile"] is True


def test_compile_is_off_when_the_run_length_is_unknown() -> None:
    plan = make_plan("qwen2.5-0.5b")
    assert "torch_compile" not in plan["train_args"]
    assert "run length unknown" in plan["decisions"]["torch_compile"]


def test_compile_is_never_on_for_cpus_or_deepspeed() -> None:
    cpu = make_plan("tiny", cluster=nodes(2, accelerator="cpu"), train_args={"max_steps": 10**5})
    zero = make_plan("qwen2.5-0.5b", deepspeed="zero2", train_args={"max_steps": 10**5})
    assert "torch_compile" not in cpu["train_args"]
    assert "torch_compile" not in zero["train_args"]
    assert cpu["decisions"]["torch_compile"] == "never on CPUs"


def test_compile_the_user_turns_off_stays_off() -> None:
    plan = make_plan("qwen2.5-0.5b", train_args={"max_steps": 10**5, "torch_compile": False})
    assert plan["train_args"]["torch_compile"] is False
    assert plan["decisions"]["torch_compile"] == "as set"


# ---------------------------------------------------------------------------------------------
# The model: size from config.json, remote code, the catalogue.
# ---------------------------------------------------------------------------------------------


def test_a_7b_shaped_config_counts_qwen2_5_7b_parameters() -> None:
    assert model_params(QWEN25_7B_CONFIG) == 7_615_616_512  # transformers' own count


@pytest.mark.parametrize("finetuning", ["lora", "full"])
@pytest.mark.parametrize("gib", MEMORIES)
@pytest.mark.parametrize("count", NODE_COUNTS)
def test_a_model_sized_by_its_config_plans_like_the_catalogues_7b(
    finetuning: str, gib: int, count: int
) -> None:
    cluster = nodes(count, gib=gib)
    catalogue = make_plan("qwen2.5-7b", cluster=cluster, finetuning_type=finetuning)
    own = make_plan(
        "my-7b",
        cluster=cluster,
        finetuning_type=finetuning,
        model_path="/models/my-7b",
        model_template="qwen",
        model_config=QWEN25_7B_CONFIG,
    )
    assert own["model"]["params_source"] == "counted from config.json"
    assert own["deepspeed"] == catalogue["deepspeed"]
    assert own["gradient_checkpointing"] == catalogue["gradient_checkpointing"]
    assert own["model"]["layer_class"] == "Qwen2DecoderLayer"


def test_a_model_of_unknown_size_is_refused_asking_for_params_b() -> None:
    with pytest.raises(PlanError, match=r"size is unknown.*-e model_params_b=7\.6"):
        make_plan("mine", model_path="/models/mine", model_template="qwen")


def test_params_b_given_sizes_a_model_without_config() -> None:
    plan = make_plan(
        "mine", model_path="/models/mine", model_params_b="7.6", finetuning_type="full"
    )
    assert plan["model"]["params_b"] == 7.6
    assert plan["deepspeed"] == "zero3_offload"
    # Shape unknown: checkpointing on, one row per micro-batch.
    assert plan["gradient_checkpointing"] is True
    assert plan["train_args"]["per_device_train_batch_size"] == 1


def test_remote_code_needs_trust_and_the_plan_says_so() -> None:
    config = {**QWEN25_7B_CONFIG, "model_type": "qwen", "auto_map": {"AutoModelForCausalLM": "x"}}
    with pytest.raises(PlanError, match=r"own modelling code.*-e trust_remote_code=true"):
        make_plan("q1", model_path="/m/q1", model_config=config)
    plan = make_plan("q1", model_path="/m/q1", model_config=config, trust_remote_code="true")
    assert plan["model"]["trust_remote_code"] is True
    assert "trust_remote_code" in plan["summary"][0]
    assert train_args(plan, "/r")["trust_remote_code"] is True


@pytest.mark.parametrize("model", GPU_MODELS)
def test_catalogue_sizes_match_their_configs(model: str) -> None:
    entry = CATALOGUE[model]
    assert model_params(entry["config"]) == pytest.approx(entry["params_b"] * 1e9, rel=0.01)
    assert entry["layer_class"] == layer_class(entry["config"])
    assert not entry.get("trust_remote_code", False)


def test_the_catalogue_follows_the_seeds() -> None:
    for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"):
        assert CATALOGUE[name]["template"] == "qwen3"
        assert CATALOGUE[name]["path"].startswith("Qwen/Qwen3-")
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b", "qwen-7b"):
        assert name in CATALOGUE
    # qwen-7b names a model transformers 5.6 loads natively (models.yml says why).
    assert CATALOGUE["qwen-7b"]["path"] == "Qwen/Qwen2.5-7B-Instruct"


TRAIN_PYTHON = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "/var/cache/llama-cluster/venv-train/bin/python")
)
COUNT_WITH_TRANSFORMERS = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
out = {}
for name, config in json.load(sys.stdin).items():
    config = {k: v for k, v in config.items() if k != "architectures"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    out[name] = [sum(p.numel() for p in model.parameters()),
                 type(model.model.layers[0]).__name__]
print("COUNTS " + json.dumps(out))
"""


def test_parameter_count_matches_transformers_for_every_catalogue_config() -> None:
    if not TRAIN_PYTHON.exists():
        pytest.skip(f"no training venv at {TRAIN_PYTHON}: run scripts/setup-train-venv.sh")
    configs = {m: CATALOGUE[m]["config"] for m in GPU_MODELS}
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", COUNT_WITH_TRANSFORMERS],
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("COUNTS ")]
    assert lines, done.stderr[-2000:]
    counts = json.loads(lines[-1].removeprefix("COUNTS "))
    for model, (count, layer) in counts.items():
        assert model_params(configs[model]) == count, model
        assert layer_class(configs[model]) == layer, model


# ---------------------------------------------------------------------------------------------
# The numbers a user gives: one schema, one message listing every bad value.
# ---------------------------------------------------------------------------------------------

BAD_VALUES = [
    (
        {"train_args": {"learning_rate": -1e-4}},
        "train_args.learning_rate = -0.0001 (must be a number > 0)",
    ),
    (
        {"train_args": {"learning_rate": "fast"}},
        "train_args.learning_rate = 'fast' (must be a number > 0)",
    ),
    (
        {"train_args": {"num_train_epochs": 0}},
        "train_args.num_train_epochs = 0 (must be a number > 0)",
    ),
    (
        {"train_args": {"per_device_train_batch_size": 0}},
        "per_device_train_batch_size = 0 (must be an integer >= 1)",
    ),
    (
        {"train_args": {"per_device_train_batch_size": 2.5}},
        "per_device_train_batch_size = 2.5 (must be an integer >= 1)",
    ),
    (
        {"train_args": {"gradient_accumulation_steps": -8}},
        "gradient_accumulation_steps = -8 (must be an integer >= 1)",
    ),
    (
        {"train_args": {"logging_steps": 0}},
        "train_args.logging_steps = 0 (must be an integer >= 1)",
    ),
    (
        {"train_args": {"save_steps": True}},
        "train_args.save_steps = true (must be an integer >= 1)",
    ),
    (
        {"train_args": {"max_steps": 0}},
        "train_args.max_steps = 0 (must be an integer >= 1 or -1 (-1: train num_train_epochs))",
    ),
    (
        {"train_args": {"warmup_ratio": 1.0}},
        "train_args.warmup_ratio = 1.0 (must be a number in [0, 1))",
    ),
    ({"train_args": {"lora_rank": 0}}, "train_args.lora_rank = 0 (must be an integer >= 1)"),
    ({"train_args": {"cutoff_len": -5}}, "train_args.cutoff_len = -5 (must be an integer >= 1)"),
    ({"train_args": {"bf16": "maybe"}}, "train_args.bf16 = 'maybe' (must be true or false)"),
    (
        {"cutoff_len": "long"},
        "-e cutoff_len = 'long' (must be an integer >= 1 or 0 (0: the catalogue's))",
    ),
    ({"cutoff_len": -1}, "-e cutoff_len = -1 (must be an integer >= 1 or 0"),
    ({"max_restarts": -1}, "-e max_restarts = -1 (must be an integer >= 0)"),
    ({"max_restarts": "twice"}, "-e max_restarts = 'twice' (must be an integer >= 0)"),
    (
        {"tokens_per_step": 0},
        "-e tokens_per_step (training_tokens_per_step) = 0 (must be an integer >= 1)",
    ),
    (
        {"model_params_b": "-7"},
        "-e model_params_b (billions of parameters) = -7 (must be a number > 0)",
    ),
    ({"trust_remote_code": "perhaps"}, "-e trust_remote_code = 'perhaps' (must be true or false)"),
    ({"finetuning_type": "qlora"}, "finetuning_type = 'qlora' (must be one of lora, freeze, full)"),
    ({"deepspeed": "zero4"}, 'Unknown deepspeed="zero4". Use one of: auto, none, zero0'),
    ({"train_args": "fast"}, "train_args must be a mapping of LLaMA-Factory arguments"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_a_bad_number_is_refused_saying_what_is_allowed(extra: dict, message: str) -> None:
    with pytest.raises(PlanError) as refused:
        check_request(request(**extra), STAGES)
    assert message in str(refused.value)
    assert "nothing was changed on any node" in str(refused.value)


def test_every_bad_value_is_listed_in_one_message() -> None:
    asked = request(
        train_args={"learning_rate": 0, "warmup_ratio": -0.1, "lora_rank": "eight"},
        max_restarts=-2,
        tokens_per_step="many",
    )
    with pytest.raises(PlanError) as refused:
        check_request(asked, STAGES)
    lines = [x for x in str(refused.value).splitlines() if x.startswith("- ")]
    assert len(lines) == 5


def test_numbers_given_as_text_are_accepted_and_converted() -> None:
    checked = check_request(
        request(
            train_args={
                "learning_rate": "5e-5",
                "per_device_train_batch_size": "4",
                "bf16": "true",
                "lr_scheduler_type": "cosine",
            },
            cutoff_len="1024",
            max_restarts="3",
            tokens_per_step="4096",
            trust_remote_code="no",
        ),
        STAGES,
    )
    assert checked["train_args"] == {
        "learning_rate": 5e-5,
        "per_device_train_batch_size": 4,
        "bf16": True,
        "lr_scheduler_type": "cosine",
    }
    assert (checked["cutoff_len"], checked["max_restarts"], checked["tokens_per_step"]) == (
        1024,
        3,
        4096,
    )
    assert checked["trust_remote_code"] is False


def test_max_restarts_is_in_the_plan() -> None:
    plan = make_plan(max_restarts="2")
    assert plan["max_restarts"] == 2
    assert "Restarts after a failure: at most 2" in plan["summary"]


def test_an_unknown_model_lists_the_known_ones() -> None:
    entry, problems = find_model(CATALOGUE, "gpt-5")
    assert entry == {}
    with pytest.raises(PlanError, match=r'Unknown model "gpt-5"\. Known models: llama3-8b, '):
        check_request(request("gpt-5"), STAGES, problems)


# ---------------------------------------------------------------------------------------------
# The nodes: accelerator, processes, GPU memory from facts.
# ---------------------------------------------------------------------------------------------


def hostvars(
    accelerator: str = "nvidia", mib: list[int | None] | None = None, **extra: Any
) -> dict:
    settings: dict[str, Any] = {"cluster_accelerator": accelerator, "training_gpu_memory_gib": 80}
    if mib is not None:
        gpus = [{"index": i, "memory_mib": m, "name": "GPU"} for i, m in enumerate(mib)]
        settings["ansible_local"] = {"llama_host": {"gpus": gpus, "gpu_count": len(gpus)}}
    settings.update(extra)
    return settings


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


# ---------------------------------------------------------------------------------------------
# The plan's shape (resume.yml and main.yml read it) and what train.yaml gets.
# ---------------------------------------------------------------------------------------------


def test_the_plan_keeps_the_shape_resume_and_the_playbooks_read() -> None:
    plan = make_plan()
    for key in (
        "run_id",
        "resume",
        "model_name",
        "model",
        "datasets",
        "deepspeed",
        "sharded",
        "nnodes",
        "nproc_per_node",
        "world_size",
        "effective_batch",
        "train_args",
        "ranks",
    ):
        assert key in plan, key
    assert plan["run_id"] == "train-20260101-000000-qwen2-5-7b"
    assert plan["resume"] is False
    assert plan["sharded"] is (plan["deepspeed"] != "none")
    json.dumps(plan)  # plan.json


def test_a_resume_id_names_the_run() -> None:
    plan = make_plan(resume_id="train-20250101-000000-tiny")
    assert plan["run_id"] == "train-20250101-000000-tiny"
    assert plan["resume"] is True


def test_the_plan_shown_before_launch_lists_every_decision() -> None:
    plan = make_plan(cluster=nodes(2, nproc=8), dataset_records=10**6)
    text = "\n".join(plan["summary"])
    for expected in (
        "qwen2.5-7b (Qwen/Qwen2.5-7B-Instruct), lora, 7.62B parameters",
        "Nodes 2 x 8 processes = world size 16 (nvidia)",
        "Effective batch 64 = per-device 4 x accumulation 1 x world size 16",
        "Tokens per optimizer step: 8192 per process x 16 = 131072 (packed rows of 2048 tokens)",
        "DeepSpeed: none (the fastest predicted of",
        "Gradient checkpointing: off",
        "Packing: on; torch.compile: on",
        f"GPU memory planned for: {H200_GIB} GiB per GPU",
        "Datasets: demo_alpaca",
    ):
        assert expected in text, expected


def test_train_yaml_adds_the_model_data_and_paths() -> None:
    plan = make_plan("qwen2.5-0.5b", cluster=nodes(2), deepspeed="zero2")
    args = train_args(plan, "/runs/r1")
    assert args["model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert args["deepspeed"] == "/runs/r1/ds_config.json"
    assert (args["dataset_dir"], args["output_dir"]) == ("/runs/r1/data", "/runs/r1/output")
    assert args["cutoff_len"] == 2048
    assert args["save_on_each_node"] is True
    assert not any(key.startswith("lora_") for key in args)  # a full fine-tune
    shared = train_args(plan, "/runs/r1", shared_storage=True)
    assert "save_on_each_node" not in shared
    fsdp = train_args({**plan, "deepspeed": "fsdp"}, "/runs/r1")
    assert fsdp["fsdp_config"] == "/runs/r1/fsdp_config.json"
    assert "deepspeed" not in fsdp
    assert "tokenized_path" not in args  # the ranks tokenize unless asked
    stages = ("zero2",)
    pretokenized = train_args(plan, "/runs/r1", False, stages, True)
    assert pretokenized["tokenized_path"] == "/runs/r1/tokenized"
    streaming = {**plan, "train_args": {**plan["train_args"], "streaming": True}}
    assert "tokenized_path" not in train_args(streaming, "/runs/r1", False, stages, True)


def test_train_yaml_lists_the_arguments_in_sections_with_the_reasons_beside_them() -> None:
    plan = make_plan("qwen2.5-0.5b", cluster=nodes(2), deepspeed="zero2")
    plan["decisions"] = {"batch": "4 rows fit"}  # no reason for checkpointing or compile
    args = {
        **train_args(plan, "/runs/r1"),
        "report_to": "none",
        "learning_rate": 5e-05,
        "my_own": "a b",
        "disable_gradient_checkpointing": True,
    }
    text = train_yaml(args, plan, "/runs/r1", "10.0.0.1", 29500)
    lines = text.splitlines()
    assert lines[0] == f"# LLaMA-Factory training configuration, run {plan['run_id']}."
    assert "#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\" in lines
    assert "#   llamafactory-cli train /runs/r1/train.yaml" in lines
    titles = [x for x in lines if x.startswith("### ")]
    assert titles == [
        "### model",
        "### method",
        "### dataset",
        "### output",
        "### train",
        "### performance",
        "### other settings",
    ]
    assert "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct" in lines
    assert 'report_to: "none"  # no wandb/tensorboard unless asked for' in lines
    assert "learning_rate: 5.0e-05" in lines  # a float to PyYAML too
    assert "deepspeed: /runs/r1/ds_config.json  # ZeRO stage chosen for this run: zero2" in lines
    batch = f"per_device_train_batch_size: {args['per_device_train_batch_size']}  # 4 rows fit"
    assert batch in lines
    assert "disable_gradient_checkpointing: true" in lines  # no reason given: no comment
    others = lines[lines.index("### other settings") + 1 :]
    assert others == ['my_own: "a b"', "save_total_limit: 3"]  # outside the sections, sorted
    assert yaml.safe_load(text) == args
    assert text.endswith("\n")


def test_dataset_info_registers_each_file_beside_it() -> None:
    info = dataset_info(
        [{"name": "a", "file": "x/a.json", "formatting": "sharegpt", "columns": {"messages": "c"}}]
    )
    assert info == {
        "a": {"formatting": "sharegpt", "columns": {"messages": "c"}, "file_name": "a.json"}
    }


def test_the_projects_own_settings_pass_the_same_schema() -> None:
    defaults = {**SETTINGS["defaults"], "learning_rate": 0}
    with pytest.raises(PlanError, match=r"training_defaults \(group_vars/all/training.yml\)"):
        make_plan(settings={**SETTINGS, "defaults": defaults})
    rules = [{"name": "bad", "set": {"per_device_train_batch_size": -1}}]
    with pytest.raises(PlanError, match=r"profile rule 'bad'.*per_device_train_batch_size"):
        make_plan(settings={**SETTINGS, "rules": rules})


# ---------------------------------------------------------------------------------------------
# Issue 21: host memory is a budget like GPU memory; knobs that win over the facts.
# ---------------------------------------------------------------------------------------------

RAM_128GB = round(131_072_000 / 1024 / 1024, 1)  # MemTotal of a 128 GB machine, GiB (125.0)


def with_host_memory(cluster: list[dict[str, Any]], gib: float) -> list[dict[str, Any]]:
    return [{**n, "host_memory_gib": gib, "host_memory_source": "facts"} for n in cluster]


def test_a_7b_full_fine_tune_on_one_h200_with_128_gb_of_ram_trains_without_offload() -> None:
    # As a user found: zero3_offload was chosen and the kernel killed rank 0 for host memory.
    # Measured, the plain run peaks at 113.9 GiB and fits the H200 (BENCHMARKS.md section 5).
    planned = make_plan(
        "qwen2.5-7b", finetuning_type="full", cluster=with_host_memory(nodes(1), RAM_128GB)
    )
    assert planned["deepspeed"] == "none"
    assert planned["memory_estimate_gib"] <= planned["memory_budget_gib"]
    assert planned["host_estimate_gib"] < planned["host_budget_gib"]


def test_where_only_offload_fits_the_gpu_and_not_the_ram_the_refusal_names_both_budgets() -> None:
    # An 80 GB GPU and 128 GB of RAM: none, zero2 and zero3 need more GPU memory than one GPU
    # has, and zero3_offload holds about 27 bytes per parameter (190 GiB) in host memory.
    with pytest.raises(PlanError) as refused:
        make_plan(
            "qwen2.5-7b",
            finetuning_type="full",
            cluster=with_host_memory(nodes(1, gib=80.0), RAM_128GB),
        )
    message = str(refused.value)
    assert "zero3_offload (19" in message
    assert "of host memory" in message
    budgets = "GiB of GPU memory per GPU and 106.2 GiB of host memory per node (1 processes)"
    assert budgets in message
    assert "LoRA (-e finetuning_type=lora)" in message
    assert "2 nodes like the smallest one" in message


def test_with_enough_host_memory_the_offload_plan_stands_and_says_its_need() -> None:
    planned = make_plan(
        "qwen2.5-7b", finetuning_type="full", cluster=with_host_memory(nodes(1, gib=48.0), 512.0)
    )
    # ZeRO-Offload: the optimizer's fp32 state and DeepSpeed's pinned buffers on the host.
    assert planned["deepspeed"] == "zero2_offload"
    assert planned["host_budget_gib"] == 435.2
    per_param = COEFFICIENTS["host.offload2_full"]
    expected = (COEFFICIENTS["host.offload2_base_gib"] * GIB + per_param * 7.62e9) / GIB
    assert planned["host_estimate_gib"] == pytest.approx(expected, abs=0.5)
    assert any(line.startswith("Host memory planned for: 512.0 GiB") for line in planned["summary"])


def test_a_given_stage_that_does_not_fit_host_memory_is_refused_with_the_figures() -> None:
    with pytest.raises(PlanError, match=r"deepspeed=zero3_offload needs 1\d\d\.\d GiB of host"):
        make_plan(
            "qwen2.5-7b",
            finetuning_type="full",
            deepspeed="zero3_offload",
            cluster=with_host_memory(nodes(1), RAM_128GB),
        )


def test_host_memory_counts_every_process_of_the_node() -> None:
    # Eight ranks on one node each load the bf16 weights and hold their runtime (measured).
    planned = make_plan(
        "qwen2.5-1.5b", finetuning_type="full", cluster=with_host_memory(nodes(1, nproc=8), 128.0)
    )
    per_process = COEFFICIENTS["host.base_gib"] + COEFFICIENTS["host.load"] * 1.54e9 / GIB
    assert planned["host_estimate_gib"] == pytest.approx(8 * per_process, abs=0.5)


def test_without_host_facts_the_plan_says_host_memory_is_unknown() -> None:
    planned = make_plan("qwen2.5-0.5b")
    assert planned["host_memory_gib"] is None
    assert any(line.startswith("Host memory: not known") for line in planned["summary"])


def test_gpu_memory_gib_wins_over_the_facts_and_says_so() -> None:
    share = hostvars(mib=[143771], gpu_memory_gib="40")
    assert node_gpu_memory("a", share) == (40.0, "gpu_memory_gib (inventory or -e), over the facts")
    with pytest.raises(PlanError, match=r"a: gpu_memory_gib = 'lots' must be a number of GiB"):
        node_gpu_memory("a", hostvars(mib=[143771], gpu_memory_gib="lots"))


def test_host_memory_comes_from_the_knob_then_the_facts() -> None:
    facts = hostvars(mib=[143771])
    facts["ansible_local"]["llama_host"]["host_memory_mib"] = 128_000
    assert node_host_memory("a", facts) == (125.0, "facts")
    assert node_host_memory("a", {**facts, "host_memory_gib": 64}) == (
        64.0,
        "host_memory_gib (inventory or -e), over the facts",
    )
    assert node_host_memory("a", hostvars(mib=[143771]))[0] is None
    described = describe_nodes({"a": 0}, {"a": facts}, {"a": 1})
    assert described[0]["host_memory_gib"] == 125.0


# ---------------------------------------------------------------------------------------------
# FP8 (-e fp8=true): where it can run, and what makes it real.
# ---------------------------------------------------------------------------------------------


def fp8_nodes(*caps: float | None, torchao: str | None = "0.17.0") -> list[dict[str, Any]]:
    cluster = nodes(len(caps))
    for node, cap in zip(cluster, caps, strict=True):
        node.update(compute_capability=cap, torchao=torchao)
    return cluster


def test_fp8_on_hopper_trains_in_fp8_with_the_environment_accelerate_reads() -> None:
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", cluster=fp8_nodes(9.0), fp8=True)
    args = plan["train_args"]
    assert (args["fp8"], args["fp8_backend"], args["bf16"]) == (True, "torchao", False)
    assert plan["environment"] == {"ACCELERATE_MIXED_PRECISION": "fp8"}
    assert any(line.startswith("FP8: on (torchao") for line in plan["summary"])


def test_fp8_asked_the_way_llamafactory_documents_it_is_made_real() -> None:
    # fp8: true alone trains in bf16 under transformers 5.6 (BENCHMARKS.md 7, third session).
    plan = make_plan(
        "qwen2.5-1.5b",
        finetuning_type="full",
        cluster=fp8_nodes(8.9, 9.0),
        train_args={"fp8": True},
    )
    assert plan["train_args"]["bf16"] is False
    assert plan["environment"] == {"ACCELERATE_MIXED_PRECISION": "fp8"}


def test_no_fp8_leaves_bf16_and_the_environment_alone() -> None:
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", cluster=fp8_nodes(9.0))
    assert "fp8" not in plan["train_args"]
    assert plan["environment"] == {}
    assert "fp8" not in plan["decisions"]


@pytest.mark.parametrize(
    ("cluster", "words"),
    [
        (nodes(2, accelerator="cpu"), ["FP8 needs NVIDIA GPUs", "CPUs"]),
        (fp8_nodes(9.0, None), ["n1", "provision.yml --tags host_facts"]),
        (fp8_nodes(9.0, 8.6), ["n1 (8.6)", "compute capability 8.9 or newer"]),
        (fp8_nodes(9.0, torchao=None), ["torchao", "llamafactory_extras", "n0"]),
    ],
)
def test_fp8_is_refused_where_it_cannot_run_naming_the_nodes(
    cluster: list[dict[str, Any]], words: list[str]
) -> None:
    model = "tiny" if cluster[0]["accelerator"] == "cpu" else "qwen2.5-1.5b"
    with pytest.raises(PlanError) as err:
        make_plan(model, finetuning_type="full", cluster=cluster, fp8=True)
    for word in words:
        assert word in str(err.value)
    assert "Leave fp8 off" in str(err.value)


def test_fp8_with_deepspeed_is_refused() -> None:
    with pytest.raises(PlanError, match="plain DDP only, and this plan needs deepspeed=zero2"):
        make_plan(
            "qwen2.5-1.5b",
            finetuning_type="full",
            cluster=fp8_nodes(9.0),
            deepspeed="zero2",
            fp8=True,
        )


def test_fp8_must_be_a_flag() -> None:
    with pytest.raises(PlanError, match=r"-e fp8 = 'maybe' \(must be true or false\)"):
        make_plan("qwen2.5-1.5b", cluster=fp8_nodes(9.0), fp8="maybe")
