"""Runs each molecule scenario (real containers on the lab node image) as one test.

Each scenario is an xdist group of its own (`make test` runs the suite with `--dist loadgroup`):
its containers, network and ephemeral directory are named after it, so scenarios run side by
side; tests/conftest.py starts the longest first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(p.parent.name for p in (ROOT / "molecule").glob("*/molecule.yml"))


@pytest.mark.molecule
@pytest.mark.parametrize(
    "scenario",
    [pytest.param(s, marks=pytest.mark.xdist_group(f"molecule-{s}")) for s in SCENARIOS],
)
def test_molecule_scenario_passes(scenario: str) -> None:
    """`molecule test -s <scenario>`: create, converge, idempotence, verify, destroy."""
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed")
    molecule = Path(sys.executable).with_name("molecule")
    log = ROOT / ".cache" / f"molecule-{scenario}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.run(
            [str(molecule), "test", "-s", scenario],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "ANSIBLE_FORCE_COLOR": "0", "PY_COLORS": "0"},
            check=False,
        )
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-150:]
        pytest.fail(f"molecule test -s {scenario} failed (full log: {log}):\n" + "\n".join(tail))
