"""bench/links.py's arithmetic on nodes of several ranks (issue 39): what crosses the link for
each plan, and the prediction from the one-node runs. No containers here: the bench itself is
its own proof (BENCHMARKS.md section 11)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import links  # noqa: E402

SHAPE = links.Shape(params=10.9e6, hidden=768, layers=2, intermediate=3072, vocab=400, tied=True)


def row(stage: str, nproc: int, accumulation: int = 1) -> dict:
    return {
        "nodes": 2,
        "nproc": nproc,
        "mbit": 100,
        "busbw_gbps": 0.1,
        "plan": f"{stage}-{accumulation}",
        "stage": stage,
        "accumulation": accumulation,
        "measured_s": 1.0,
        "tokens_per_step": 128 * 2 * nproc * accumulation,
    }


def test_two_ranks_a_node_move_less_under_hsdp_than_ddp_and_zero3():
    seconds = {s: links.communication(SHAPE, row(s, 2), 128) for s in
               ("none", "zero3", "zero3_hpz", "hsdp")}  # fmt: skip
    # fp32 gradients (43.6 MB) over 0.1 Gbit/s: DDP's ring over 4 ranks carries 1.5 x, HSDP's
    # over 2 nodes 1 x; ZeRO-3 and hpZ 3 x (W-1)/W: the forward's gather (a model this small
    # is not gathered again for the backward, so hpZ saves nothing) and gloo's reduce-scatter,
    # which moves an all-reduce's bytes.
    grads = SHAPE.params * 4 * 8 / 0.1e9
    fixed = links.cost.COMMUNICATION["comm_fixed"]
    assert seconds["none"] == pytest.approx(1.5 * grads + fixed)
    assert seconds["hsdp"] == pytest.approx(grads + fixed)
    assert seconds["zero3"] == pytest.approx(0.75 * 3 * grads + fixed)
    assert seconds["zero3_hpz"] == pytest.approx(seconds["zero3"])
    one_rank = links.communication(SHAPE, row("none", 1), 128)
    assert one_rank == pytest.approx(grads + fixed)  # the bench of issue 22


def test_the_prediction_saves_the_partitions_share_except_under_hsdp():
    one = {
        f"{s}-{a}": {"stage": s, "accumulation": a, "step_s": t}
        for s, a, t in (("none", 1, 0.5), ("none", 8, 4.0), ("zero3", 1, 0.7), ("hsdp", 1, 0.8))
    }
    rows = [row("zero3", 2), row("hsdp", 2)]
    links.assess(rows, one, SHAPE, 128)
    zero3, hsdp = rows
    micro = (4.0 - 0.5) / 7
    assert zero3["partition_saving_s"] == pytest.approx((0.7 - micro) / 2)
    assert hsdp["partition_saving_s"] == 0.0  # its partition is a node's ranks, on 1 node or 2
    assert hsdp["predicted_s"] == pytest.approx(0.8 + hsdp["communication_s"])


def test_the_hybrid_plans_are_configured_as_train_yml_renders_them():
    assert links.train_config(links.Plan.parse("hsdp:1"), 5, 128)["fsdp"] == (
        "hybrid_shard auto_wrap"
    )
    ds = links.deepspeed_config("zero3_hpz", 2)
    assert ds["zero_optimization"]["zero_hpz_partition_size"] == 2
    fsdp = links.fsdp_config("Qwen2DecoderLayer")
    assert fsdp["transformer_layer_cls_to_wrap"] == ["Qwen2DecoderLayer"]
    assert fsdp["sync_module_states"] is False  # needs an accelerator's device
