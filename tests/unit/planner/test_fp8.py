"""FP8 (-e fp8=true, planner/decisions.py choose_fp8): where it can run, and what makes it real."""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError

from tests.support.planning import (
    make_plan,
    nodes,
)

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
    args = plan.train_args
    assert (args["fp8"], args["fp8_backend"], args["bf16"]) == (True, "torchao", False)
    assert plan.environment == {"ACCELERATE_MIXED_PRECISION": "fp8"}
    assert any(line.startswith("FP8: on (torchao") for line in plan.summary)


def test_fp8_asked_the_way_llamafactory_documents_it_is_made_real() -> None:
    # fp8: true alone trains in bf16 under transformers 5.6 (BENCHMARKS.md 7, third session).
    plan = make_plan(
        "qwen2.5-1.5b",
        finetuning_type="full",
        cluster=fp8_nodes(8.9, 9.0),
        train_args={"fp8": True},
    )
    assert plan.train_args["bf16"] is False
    assert plan.environment == {"ACCELERATE_MIXED_PRECISION": "fp8"}


def test_no_fp8_leaves_bf16_and_the_environment_alone() -> None:
    plan = make_plan("qwen2.5-1.5b", finetuning_type="full", cluster=fp8_nodes(9.0))
    assert "fp8" not in plan.train_args
    assert plan.environment == {}
    assert not plan.technique.fp8


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
