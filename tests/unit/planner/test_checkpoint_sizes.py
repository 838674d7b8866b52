"""The disk check knows every technique's checkpoint (issue 44): planner/disk.py's estimate of one
checkpoint, replayed against checkpoints measured on disk (tests/data/checkpoint_sizes.json: a
full fine-tune with 8-bit AdamW, a LoRA and a QLoRA of a 0.5B on an H100, bench/gpu/
memory_grid.py; AdamW, 8-bit AdamW and LoRA on the lab's stack on the CPU, bench/
checkpoint_sizes.py), and the stages whose checkpoints it once priced as plain DDP's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.planner.disk import disk_estimate

SIZES = json.loads((Path(__file__).parents[2] / "data/checkpoint_sizes.json").read_text())


def _gpu(measured: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint measured on the GPU machine (bench/gpu/memory_grid.py), as an entry."""
    spec = SIZES["shapes"][measured["shape"]]
    shape = {
        "hidden": spec["hidden_size"],
        "intermediate": spec["intermediate_size"],
        "layers": spec["num_hidden_layers"],
        "vocab": spec["vocab_size"],
        "tied": spec["tie_word_embeddings"],
    }
    args = {"optim": measured["optim"], "bf16": True, "lora_rank": measured.get("lora_rank") or 8}
    return {
        "name": f"gpu: {measured['name']}",
        "model": {"params": spec["params"], "shape": shape},
        "finetuning_type": measured["finetuning"],
        "stage": "none",
        "nproc": 1,
        "world": 1,
        "args": args,
        "checkpoint_bytes": sum(measured["files"].values()),
    }


MEASURED = [_gpu(c) for c in SIZES["checkpoints"] if c.get("status") == "ok"] + [
    e for e in SIZES["cpu_checkpoints"]["entries"]
]
# What the estimate leaves out (tokenizer, RNG and scheduler states, trainer_state.json: a few
# MB on a real model) and LoRA's upper bound (key/value projections counted as wide as hidden).
TOLERANCE = 0.05


def estimate(entry: dict[str, Any], stage: str | None = None) -> dict[str, Any]:
    """disk.py's estimate for a measured entry's run."""
    args = entry["args"]
    model = {
        "finetuning_type": entry["finetuning_type"],
        "params_b": entry["model"]["params"] / 1e9,
        "lora_target": args.get("lora_target", "all"),
        "shape": entry["model"]["shape"],
    }
    return disk_estimate(
        model=model,
        stage=stage or entry["stage"],
        args={**args, "save_total_limit": 1},
        nproc=entry["nproc"],
        world=entry["world"],
    )


@pytest.mark.parametrize("entry", MEASURED, ids=[e["name"] for e in MEASURED])
def test_the_estimate_of_a_checkpoint_matches_one_measured_on_disk(entry: dict[str, Any]) -> None:
    planned = estimate(entry)["checkpoint_bytes"]
    measured = entry["checkpoint_bytes"]
    assert abs(planned - measured) <= TOLERANCE * measured, (entry["name"], planned, measured)


def test_an_8bit_optimizers_checkpoint_is_priced_at_what_it_writes_not_at_fp32_adamws() -> None:
    # The GPU machine's refusal (issue 44): a 4B-class full fine-tune with 8-bit AdamW priced as
    # 12 bytes a parameter, 41 GiB, on a 64 GiB disk. What it writes is fp32 weights and 8-bit
    # moments, the embedding's kept fp32 (measured on the H100 and on the CPU: within 1 %).
    for eight in [e for e in MEASURED if e["args"]["optim"] == "adamw_8bit"]:
        fp32 = {**eight, "args": {**eight["args"], "optim": "adamw_torch"}}
        assert estimate(fp32)["checkpoint_bytes"] > 1.5 * eight["checkpoint_bytes"], eight["name"]
        assert "adamw_8bit's 2 8-bit moments" in estimate(eight)["formula"]


@pytest.mark.parametrize(
    ("stage", "like"),
    [("zero2_offload", "zero2"), ("zero3_offload", "zero3"), ("zero3_hpz", "zero3")],
)
def test_an_offloaded_or_hybrid_zero_checkpoint_is_priced_as_its_stages_shards(
    stage: str, like: str
) -> None:
    # Offloading moves the optimizer while training, not what is saved; hpZ is ZeRO-3's layout.
    # Both were once priced as plain DDP's fp32 weights and moments, every rank's on every node.
    full = next(e for e in MEASURED if e["finetuning_type"] == "full")
    entry = {**full, "nproc": 8, "world": 16, "args": {"bf16": True}}
    assert estimate(entry, stage)["checkpoint_bytes"] == estimate(entry, like)["checkpoint_bytes"]
    assert "this node's 1/2 of optimizer shards" in estimate(entry, stage)["formula"]
