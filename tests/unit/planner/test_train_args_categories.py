"""train_args by category (issue 45): the training's hyper-parameters pass; what would send the
model, its data or a token off the cluster, read or write outside the run's directory, or take
over what the plan owns is refused on the controller, naming the supported way. Before, every
LLaMA-Factory argument name the plan did not own passed: push_to_hub and hub_model_id uploaded
the model trained on the operator's data, resume_from_checkpoint skipped the resume rule,
adapter_name_or_path, cache_dir and logging_dir reached other runs' files."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter.tracking import TRACKERS
from ansible_collections.llama.cluster.plugins.module_utils.planner import schema
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError

ROOT = Path(__file__).resolve().parents[3]
SECURITY = ROOT / "docs" / "security.md"


def _refusal(train_args: dict) -> str:
    request = {"model": "tiny", "tokens_per_step": 4096, "train_args": train_args}
    with pytest.raises(PlanError) as refused:
        schema.check_request(request, schema.DEEPSPEED_STAGES)
    return str(refused.value)


@pytest.mark.parametrize(
    ("key", "value", "category", "way"),
    [
        ("push_to_hub", True, "off the cluster", "upload it yourself"),
        ("hub_model_id", "someone/model", "off the cluster", "playbooks/export.yml"),
        ("hub_token", "hf_x", "off the cluster", "hf_token"),
        ("hub_private_repo", False, "off the cluster", "playbooks/logs.yml"),
        ("use_swanlab", True, "off the cluster", "-e report_to="),
        ("resume_from_checkpoint", "/tmp/x", "set by the plan", "-e resume=true"),
        ("output_dir", "/tmp/x", "set by the plan", "runs/<run id>/"),
        ("deepspeed", "/tmp/ds.json", "set by the plan", "-e deepspeed=<stage>"),
        ("trust_remote_code", True, "set by the plan", "-e trust_remote_code=true"),
        ("adapter_name_or_path", "/opt/llama-cluster/runs/other/output", "outside", "-e resume"),
        ("cache_dir", "/root/.cache", "outside", "cluster_models_dir"),
        ("logging_dir", "/etc/cron.d", "outside", "-e tensorboard=true"),
    ],
)
def test_each_refused_category_names_the_supported_way(
    key: str, value: object, category: str, way: str
) -> None:
    said = _refusal({key: value})
    assert f"train_args.{key} " in said
    assert category in said
    assert way in said


@pytest.mark.parametrize("report_to", ["comet_ml", "wandb,neptune", ["tensorboard", "clearml"]])
def test_report_to_beyond_the_supported_trackers_is_refused(report_to: object) -> None:
    said = _refusal({"report_to": report_to})
    assert "train_args.report_to" in said
    assert "tracking_environment" in said


def test_hyper_parameters_and_the_supported_trackers_pass() -> None:
    args = {
        "learning_rate": 2e-5,
        "num_train_epochs": 1,
        "lora_rank": 16,
        "warmup_ratio": 0.05,
        "lr_scheduler_type": "cosine",
        "optim": "adamw_torch",
        "report_to": ["tensorboard", "wandb"],
    }
    request = {"model": "tiny", "tokens_per_step": 4096, "train_args": args}
    checked = schema.check_request(request, schema.DEEPSPEED_STAGES)
    assert checked["train_args"]["report_to"] == ["tensorboard", "wandb"]
    assert schema.check_request({**request, "train_args": {"report_to": "none"}}, ["none"])


def test_every_refused_key_is_one_of_llamafactorys_and_in_one_category() -> None:
    names = schema.llamafactory_names()["train_args"]
    seen: set[str] = set()
    for _why, ways in schema.TRAIN_ARGS_REFUSED:
        assert set(ways) <= names, set(ways) - names
        assert not seen & set(ways)
        seen |= set(ways)
    assert set(schema.TRACKERS) == set(TRACKERS)  # the trackers the tracking role sets up


def test_the_security_page_names_every_refused_key() -> None:
    text = SECURITY.read_text()
    missing = [
        key for _why, ways in schema.TRAIN_ARGS_REFUSED for key in ways if f"`{key}`" not in text
    ]
    assert missing == []
