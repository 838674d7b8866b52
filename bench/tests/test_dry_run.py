"""Every phase of bench/gpu runs dry here, in seconds (issue 46; bench/gpu/dry.py): a command left
for the GPU machine cannot fail there on what the CPU could have caught. `cards24-14blora`, named
as a ready command, raised KeyError before training because the GPU mode had no 14b size."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "gpu"))

import baselines  # noqa: E402
import dry  # noqa: E402
import harness  # noqa: E402
import memory_grid  # noqa: E402
from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import (  # noqa: E402
    PlanError,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import (  # noqa: E402
    llamafactory_names,
)

BASELINE_KINDS = ("base", "cd", "target", "fp8", "cap24", "cards24", "cards48")


def dry_run(module, tmp_path: Path, phases: list[str], **extra) -> dict[str, str]:
    """Run phases of harness.py or baselines.py dry; the phases that failed, with why."""
    args = argparse.Namespace(
        mode="gpu", playbook="ansible-playbook", out=tmp_path, work=tmp_path / "work",
        base_dir="/opt/llama-cluster", env_bin=None, deadline_s=1e9, gpu_cap_gib=None,
        gpu_memory_gib=None, product_extra=None, dry=True, phases=phases, nodes=None,
        **extra,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert module.run(args) == 0
    failed = (tmp_path / "results").glob("*.error.txt")
    return {f.name.removesuffix(".error.txt"): f.read_text() for f in failed}


def test_every_baselines_phase_runs_dry_and_only_the_7b_full_fine_tune_is_refused(tmp_path):
    phases = ["setup", *(f"{k}-{g}" for k in BASELINE_KINDS for g in baselines.GOALS)]
    failed = dry_run(baselines, tmp_path, phases)
    # A 7B full fine-tune fits no stage of an H100 (its 16 bytes a parameter), so every phase
    # of it is a command for an H200 alone (and, there, one without checkpoints: the disk).
    assert set(failed) == {p for p in phases if p.endswith("-7bfull")}
    assert all("does not fit even with ZeRO-3" in why for why in failed.values())


def test_every_harness_phase_runs_dry(tmp_path):
    stages = [f"shard-{s}" for s in harness.STAGES]
    phases = ["setup", *(f"goal-{k}" for k in harness.GOALS), *stages, "scale-1.5b"]
    assert dry_run(harness, tmp_path, phases) == {}
    summary = (tmp_path / "summary.md").read_text()
    assert "Scaling" in summary


def test_the_14b_cards_phase_plans_qlora_for_its_cap_and_writes_every_hand_config(tmp_path):
    assert dry_run(baselines, tmp_path, ["cards24-14blora"]) == {}
    dest = tmp_path / "results" / "cards24-14blora"
    plan = (dest / "d_train_yml" / "train.yaml").read_text()
    assert "quantization_bit: 4" in plan
    hand = {p.parent.name for p in dest.glob("*/example.yaml")}
    assert hand == set(baselines.CARD_VARIANTS["lora"])


def test_a_hand_config_with_an_argument_llamafactory_does_not_take_fails_the_dry_run():
    cfg = {"cutoff_len": 2048, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 4}
    assert dry.example(cfg)["ok"]
    with pytest.raises(ValueError, match="enable_liger"):
        dry.example({**cfg, "enable_liger": True})


def test_a_run_the_gpu_machines_disk_cannot_hold_fails_the_dry_run_unless_it_saves_nothing():
    extra = {"model": "qwen2.5-7b", "finetuning_type": "full", "train_args": {}}
    with pytest.raises(PlanError, match="disk"):
        dry.plan_for(extra, dry.CARDS["H200"], 1, 12000)
    quiet = {**extra, "train_args": {"save_strategy": "no"}}
    assert dry.plan_for(quiet, dry.CARDS["H200"], 1, 12000)["deepspeed"] == "none"


def test_the_extra_vars_of_a_command_line_are_read_as_ansible_reads_them():
    cmd = ["ansible-playbook", "train.yml", "-e", "model=m", "-e", "detach=true"]
    cmd += ["-e", '{"train_args": {"max_steps": 3}, "fp8": true}', "-e", "model=n"]
    assert dry.extra_vars(cmd) == {
        "model": "n",
        "detach": True,
        "train_args": {"max_steps": 3},
        "fp8": True,
    }


@pytest.mark.parametrize("grid", sorted(memory_grid.GRIDS))
def test_every_memory_grid_point_is_a_shape_and_a_config_llamafactory_takes(grid, tmp_path):
    names = llamafactory_names()["train_args"]
    points, smoke = memory_grid.GRIDS[grid]
    for point in [*points, *smoke]:
        assert point.shape in memory_grid.SHAPES
        cfg = memory_grid.train_config(point, tmp_path / "m", tmp_path / "d", tmp_path, True)
        assert set(cfg) <= names, point.name
