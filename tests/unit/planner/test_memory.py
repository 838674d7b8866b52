"""The memory model (planner/memory.py): GPU memory against what BENCHMARKS.md section 1 measured,
and host memory, a budget like GPU memory, with the knobs that win over the facts.
"""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import PlanError
from ansible_collections.llama.cluster.plugins.module_utils.planner.measured_memory import (
    COEFFICIENTS,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.memory import GIB, Memory
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    model_params,
    model_shape,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    describe_nodes,
    node_gpu_memory,
    node_host_memory,
)

from tests.support.planning import (
    CATALOGUE,
    SETTINGS,
    hostvars,
    make_plan,
    nodes,
)

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
    assert planned.stage.stage == "none"
    assert planned.memory.estimate_gib <= planned.memory.budget_gib
    assert planned.memory.host_estimate_gib < planned.memory.host_budget_gib


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
    assert planned.stage.stage == "zero2_offload"
    assert planned.memory.host_budget_gib == 435.2
    per_param = COEFFICIENTS["host.offload2_full"]
    expected = (COEFFICIENTS["host.offload2_base_gib"] * GIB + per_param * 7.62e9) / GIB
    assert planned.memory.host_estimate_gib == pytest.approx(expected, abs=0.5)
    assert any(line.startswith("Host memory planned for: 512.0 GiB") for line in planned.summary)


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
    assert planned.memory.host_estimate_gib == pytest.approx(8 * per_process, abs=0.5)


def test_without_host_facts_the_plan_says_host_memory_is_unknown() -> None:
    planned = make_plan("qwen2.5-0.5b")
    assert planned.memory.host_gib is None
    assert any(line.startswith("Host memory: not known") for line in planned.summary)


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
