"""Issue 46's first device call, replayed (tests/data/compile_grid.json, one H100, BENCHMARKS.md
section 12): torch.compile's measured savings and failures are the planner's, the memory model's
compiled term predicts the compiled points, the cost model its timed points; and issue 44's
checkpoint sizes (tests/data/checkpoint_sizes.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.module_utils.planner import cost as cm
from ansible_collections.llama.cluster.plugins.module_utils.planner import decisions
from ansible_collections.llama.cluster.plugins.module_utils.planner import measured_memory as mm
from ansible_collections.llama.cluster.plugins.module_utils.planner.techniques import (
    COMPILE_SAVING,
    Technique,
)

ROOT = Path(__file__).resolve().parents[3]
DATA = json.loads((ROOT / "tests" / "data" / "compile_grid.json").read_text())
SIZES = json.loads((ROOT / "tests" / "data" / "checkpoint_sizes.json").read_text())
TRAINING = yaml.safe_load((ROOT / "group_vars" / "all" / "training.yml").read_text())
GIB = 2**30


def point(name: str) -> dict:
    return next(p for p in DATA["points"] if p["name"] == name)


def shape(p: dict, data: dict = DATA) -> mm.Shape:
    spec = data["shapes"][p["shape"]]
    return mm.Shape.from_config(spec, spec["params"])


def technique(p: dict) -> Technique:
    return Technique(
        optim=p["optim"] or "adamw_torch",
        liger=bool(p["liger"]),
        quant=int(p["quant"] or 0),
        compiled=bool(p["compile"]),
    )


def timed() -> list[dict]:
    return [p for p in DATA["points"] if p["status"] == "ok" and not p["fp8"]]


@pytest.mark.parametrize(
    ("uncompiled", "compiled", "key"),
    [
        (
            "1.5b-full-none-ckpt-2x2048-cap24-adamw_8bit-alone",
            "1.5b-full-none-ckpt-2x2048-cap24-adamw_8bit-10steps-seed42-compile-alone",
            ("full", "adamw_8bit", False, 0),
        ),
        (
            "8b-lora-none-ckpt-4x2048-cap24-liger-alone",
            "8b-lora-none-ckpt-4x2048-cap24-liger-10steps-seed42-compile-alone",
            ("lora", "adamw_torch", True, 0),
        ),
    ],
)
def test_the_planners_compile_saving_is_the_measured_twins(uncompiled, compiled, key):
    saving = 1 - point(compiled)["step_s"] / point(uncompiled)["step_s"]
    assert COMPILE_SAVING[key] == pytest.approx(saving, abs=0.005)


def test_liger_with_a_trainable_lm_head_failed_to_compile_and_is_never_compiled():
    failed = point("1.5b-full-none-ckpt-4x2048-cap24-adamw_8bit-liger-10steps-seed42-compile-alone")
    assert failed["status"] == "error"
    liger = Technique(optim="adamw_8bit", liger=True, compiled=True)
    assert liger.compile_saving("full") is None
    assert "fails torch.compile" in str(liger.compile_failure("full"))
    assert decisions.choose_compile(
        "gpu", "none", 10**5, TRAINING["training_compile"], step_seconds=0.4, technique=liger
    ) == (False, "Liger's fused cross-entropy fails torch.compile's tracing (measured)")


def test_the_memory_model_predicts_every_compiled_point_within_2_percent():
    compiled = [p for p in timed() if p["compile"] and not p["liger"]]
    assert len(compiled) == 3  # 4 rows of the 8B LoRA fitted, the others held out
    for p in compiled:
        need = mm.gpu_bytes(
            shape(p), p["finetuning"], p["stage"], p["checkpointing"], p["tokens"],
            technique=technique(p),
        ) / GIB  # fmt: skip
        assert need == pytest.approx(p["peak_allocated_gib"], rel=0.02), p["name"]


def test_the_cost_model_predicts_every_timed_point_of_the_h100_within_20_percent():
    assert DATA["gpu"] == "NVIDIA H100 80GB HBM3"
    for p in timed():
        setup = cm.Setup(
            finetuning=p["finetuning"], stage=p["stage"], checkpointing=p["checkpointing"],
            micro_tokens=p["tokens"], technique=technique(p),
        )  # fmt: skip
        predicted = cm.step_cost(shape(p), setup, world=1, link=None).total
        assert predicted == pytest.approx(p["step_s"], rel=0.20), p["name"]


def test_the_first_step_of_an_uncompiled_run_is_predicted_within_25_percent():
    for p in timed():
        if p["compile"]:
            continue
        seconds, _ = decisions.first_step(
            shape(p).params / 1e9, compiled=False, fp8=False, finetuning=p["finetuning"],
            settings=TRAINING["training_compile"],
        )  # fmt: skip
        assert seconds == pytest.approx(p["first_step_at_s"], rel=0.25), p["name"]


def test_fp8_compiled_reached_its_first_step_after_minutes_without_recompiling_forever():
    fp8 = point("1.5b-full-none-nockpt-4x2048-cap80-10steps-seed42-compile-fp8-alone")
    assert fp8["status"] == "ok"
    assert fp8["first_step_at_s"] - fp8["train_begin_s"] > 120  # compiling, then steps
    assert fp8["step_s"] < 0.25
    seconds, said = decisions.first_step(
        1.54, compiled=True, fp8=True, finetuning="full", settings=TRAINING["training_compile"]
    )
    assert seconds >= fp8["first_step_at_s"]
    assert "compiling ~240 s" in said


def checkpoint(finetuning: str, quant: int = 0) -> dict:
    return next(
        c
        for c in SIZES["checkpoints"]
        if c["finetuning"] == finetuning and int(c["quant"] or 0) == quant
    )


def test_a_full_checkpoint_with_8_bit_adamw_holds_fp32_weights_and_2_bytes_of_state_a_weight():
    # The Trainer keeps bitsandbytes' states of the embedding in 32 bits (8 bytes a weight).
    spec = SIZES["shapes"]["0.5b"]
    params = spec["params"]
    embedding = spec["vocab_size"] * spec["hidden_size"]  # tied: one matrix
    full = checkpoint("full")
    assert full["weights"] == pytest.approx(4 * params, rel=0.001)
    assert full["optimizer"] == pytest.approx(2 * (params - embedding) + 8 * embedding, rel=0.01)
    assert full["scheduler"] + full["rng"] < 2**20


def test_lora_and_qlora_checkpoints_are_the_same_adapter_and_its_adamw_states():
    lora, qlora = checkpoint("lora"), checkpoint("lora", 4)
    assert (lora["weights"], lora["optimizer"]) == (qlora["weights"], qlora["optimizer"])
    adapter = lora["weights"] / 4  # fp32
    assert lora["optimizer"] == pytest.approx(8 * adapter, rel=0.01)
