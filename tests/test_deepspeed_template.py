"""templates/deepspeed.json.j2 renders, for every ZeRO stage, what the four per-stage templates
it replaced rendered (deepspeed_zero{0,2,3,3_offload}.json.j2, compared file by file before they
were deleted), with the run's bucket size and overlap setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

# What every stage shares: transformers fills the "auto" values from train.yaml.
COMMON = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "bf16": {"enabled": "auto"},
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
}


def zero3(overlap: bool) -> dict[str, Any]:
    return {
        "stage": 3,
        "overlap_comm": overlap,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "sub_group_size": 1000000000,
        "stage3_max_live_parameters": 1000000000,
        "stage3_max_reuse_distance": 1000000000,
        "stage3_gather_16bit_weights_on_model_save": True,
    }


def expected(stage: str, bucket: int, overlap: bool) -> dict[str, Any]:
    """The old per-stage template's output for these settings."""
    offload = {"device": "cpu", "pin_memory": True}
    zero = {
        "zero0": {"stage": 0, "reduce_bucket_size": bucket},
        # New with the cost model (no per-stage template had it): stage 1.
        "zero1": {
            "stage": 1,
            "reduce_scatter": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "zero2": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": bucket,
            "reduce_scatter": True,
            "reduce_bucket_size": bucket,
            "overlap_comm": overlap,
            "contiguous_gradients": True,
            "round_robin_gradients": True,
        },
        "zero3": zero3(overlap),
        "zero3_offload": {**zero3(overlap), "offload_optimizer": offload, "offload_param": offload},
    }[stage]
    return {**COMMON, "zero_optimization": zero}


SETTINGS = [(500000000, False), (200000000, True)]


@pytest.fixture(scope="module", params=SETTINGS, ids=str)
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, int, bool]:
    bucket, overlap = request.param
    out = tmp_path_factory.mktemp("ds")
    done = subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "tests/playbooks/render_deepspeed.yml",
            "-e",
            json.dumps(
                {
                    "render_root": str(out),
                    "run_config_ds_bucket_size": bucket,
                    "run_config_ds_overlap_comm": overlap,
                }
            ),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return out, bucket, overlap


@pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
def test_one_template_renders_what_the_per_stage_templates_did(
    rendered: tuple[Path, int, bool], stage: str
) -> None:
    out, bucket, overlap = rendered
    assert json.loads((out / f"{stage}.json").read_text()) == expected(stage, bucket, overlap)


def test_every_deepspeed_stage_has_its_data(rendered: tuple[Path, int, bool]) -> None:
    out, _, _ = rendered
    stages = sorted(p.stem for p in out.glob("*.json"))
    assert stages == ["zero0", "zero1", "zero2", "zero3", "zero3_offload"]
