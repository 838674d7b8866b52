"""The profile rules kept as data (planner/rules.py, group_vars/all/training.yml) and what they
produce.
"""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.rules import (
    RULE_KEYS,
    apply_rules,
    rule_matches,
)

from tests.support.planning import (
    ROOT,
    SETTINGS,
    make_plan,
    nodes,
)

# ---------------------------------------------------------------------------------------------
# The profile rules (data) and what they produce.
# ---------------------------------------------------------------------------------------------


def test_gpu_profile_sets_precision_attention_and_packing() -> None:
    args = make_plan().train_args
    assert args["bf16"] is True
    assert args["pure_bf16"] is False
    assert args["flash_attn"] == "sdpa"
    assert args["packing"] is True
    assert args["neat_packing"] is False
    assert "enable_liger_kernel" not in args  # Liger stays off (LLaMA-Factory's default)


def test_cpu_profile_sets_fp32_single_workers_and_model_only_checkpoints() -> None:
    plan = make_plan("tiny", cluster=nodes(2, accelerator="cpu"))
    args = plan.train_args
    assert args["bf16"] is False
    assert (args["preprocessing_num_workers"], args["dataloader_num_workers"]) == (1, 0)
    assert args["save_only_model"] is True
    assert "packing" not in args
    assert "torch_compile" not in args
    single = make_plan("tiny", cluster=nodes(1, accelerator="cpu")).train_args
    assert "save_only_model" not in single  # the rule needs min_world_size 2


def test_pretraining_is_not_packed_by_the_sft_rule() -> None:
    args = make_plan(train_args={"stage": "pt"}).train_args
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
    assert plan.train_args["packing"] is False
    assert plan.train_args["bf16"] is False
    assert plan.train_args["learning_rate"] == 2e-5
