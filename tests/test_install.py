"""`pip install .` gives the `llama-cluster` command, and the installed command drives the checkout
it runs in: a bad request is refused by train.yml's first play, on the controller."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project installed (not editable) into a target directory; its bin/llama-cluster.

    Installed from a copy of what the package is made of, so that the build leaves nothing in
    the tree."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "train_runner.py"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "llama_runner", source / "llama_runner")
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
         "--target", str(target), str(source)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    command = target / "bin" / "llama-cluster"
    assert command.is_file()
    return command


def _run(command: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(command.parents[1]), "NO_COLOR": "1"}
    env.pop("LLAMA_CLUSTER_DIR", None)
    return subprocess.run(
        [sys.executable, str(command), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_the_installed_command_is_the_cli(installed: Path) -> None:
    done = _run(installed, "--help", cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "usage: llama-cluster" in done.stdout
    for verb in ("provision", "train", "status", "stop"):
        assert verb in done.stdout


def test_the_installed_command_finds_the_checkout_it_runs_in(installed: Path) -> None:
    # The copy in the target directory, not the tree's llama_runner, runs: it finds the project
    # from the current directory, and train.yml refuses the unknown model before any node.
    inventory = str(ROOT / "inventory/example/hosts.yml")
    done = _run(installed, "-i", inventory, "train", "--model", "no-such-model", cwd=ROOT / "roles")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Unknown model" in done.stdout + done.stderr


def test_outside_a_checkout_it_says_where_to_run(installed: Path, tmp_path: Path) -> None:
    done = _run(installed, "status", cwd=tmp_path)
    assert done.returncode == 2
    assert "is not a llama-cluster checkout" in done.stdout + done.stderr
    assert "LLAMA_CLUSTER_DIR" in done.stdout + done.stderr
