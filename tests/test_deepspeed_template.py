"""templates/deepspeed.json.j2 renders, for every ZeRO stage, what the four per-stage templates
it replaced rendered (deepspeed_zero{0,2,3,3_offload}.json.j2), with the run's bucket size and
overlap setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
STAGES = ["zero0", "zero2", "zero3", "zero3_offload"]


@pytest.fixture(scope="module", params=[(500000000, False), (200000000, True)], ids=str)
def rendered(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
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
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_one_template_renders_what_the_per_stage_templates_did(rendered: Path, stage: str) -> None:
    new = json.loads((rendered / f"{stage}.json").read_text())
    old = json.loads((rendered / f"old_{stage}.json").read_text())
    assert new == old
