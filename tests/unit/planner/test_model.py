"""The model (planner/model.py): its size from config.json, remote code, the catalogue."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter.run_config import (
    train_args,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    layer_class,
    model_params,
)

from tests.support.planning import (
    CATALOGUE,
    GPU_MODELS,
    MEMORIES,
    NODE_COUNTS,
    QWEN25_7B_CONFIG,
    make_plan,
    nodes,
)

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
    assert own.model["params_source"] == "counted from config.json"
    assert own.stage.stage == catalogue.stage.stage
    assert own.batch.checkpointing == catalogue.batch.checkpointing
    assert own.model["layer_class"] == "Qwen2DecoderLayer"


def test_a_model_of_unknown_size_is_refused_asking_for_params_b() -> None:
    with pytest.raises(PlanError, match=r"size is unknown.*-e model_params_b=7\.6"):
        make_plan("mine", model_path="/models/mine", model_template="qwen")


def test_params_b_given_sizes_a_model_without_config() -> None:
    plan = make_plan(
        "mine", model_path="/models/mine", model_params_b="7.6", finetuning_type="full"
    )
    assert plan.model["params_b"] == 7.6
    # No cost model without a shape: the first stage of the search order that fits, ZeRO-2 with
    # the optimizer offloaded (the search prefers it to ZeRO-3's offload wherever both fit).
    assert plan.stage.stage == "zero2_offload"
    assert plan.stage.source == "order"
    # Shape unknown: checkpointing on, one row per micro-batch.
    assert plan.batch.checkpointing is True
    assert plan.train_args["per_device_train_batch_size"] == 1


def test_remote_code_needs_trust_and_the_plan_says_so() -> None:
    config = {**QWEN25_7B_CONFIG, "model_type": "qwen", "auto_map": {"AutoModelForCausalLM": "x"}}
    with pytest.raises(PlanError, match=r"own modelling code.*-e trust_remote_code=true"):
        make_plan("q1", model_path="/m/q1", model_config=config)
    plan = make_plan("q1", model_path="/m/q1", model_config=config, trust_remote_code="true")
    assert plan.model["trust_remote_code"] is True
    assert "trust_remote_code" in plan.summary[0]
    assert train_args(plan.to_dict(), "/r")["trust_remote_code"] is True


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
