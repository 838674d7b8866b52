"""The numbers a user gives (planner/schema.py): one schema, one message listing every bad value;
the project's own settings pass the same schema.
"""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    find_model,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import check_request

from tests.support.planning import (
    CATALOGUE,
    SETTINGS,
    STAGES,
    make_plan,
    request,
)

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
    assert plan.max_restarts == 2
    assert "Restarts after a failure: at most 2" in plan.summary


def test_an_unknown_model_lists_the_known_ones() -> None:
    entry, problems = find_model(CATALOGUE, "gpt-5")
    assert entry == {}
    with pytest.raises(PlanError, match=r'Unknown model "gpt-5"\. Known models: llama3-8b, '):
        check_request(request("gpt-5"), STAGES, problems)


def test_the_projects_own_settings_pass_the_same_schema() -> None:
    defaults = {**SETTINGS["defaults"], "learning_rate": 0}
    with pytest.raises(PlanError, match=r"training_defaults \(group_vars/all/training.yml\)"):
        make_plan(settings={**SETTINGS, "defaults": defaults})
    rules = [{"name": "bad", "set": {"per_device_train_batch_size": -1}}]
    with pytest.raises(PlanError, match=r"profile rule 'bad'.*per_device_train_batch_size"):
        make_plan(settings={**SETTINGS, "rules": rules})
