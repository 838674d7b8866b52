"""The llamafactory role's stack probe: its cache answers only for the environment it was made in.

Run with the controller's training venv (the same stack as a node's): a cache whose key is this
environment's is used as it is; one made for another environment is probed again.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "roles/llamafactory/files/stack_probe.py"
TRAIN_VENV = Path(
    os.environ.get(
        "LLAMA_CLUSTER_TRAIN_VENV",
        Path(os.environ.get("LLAMA_CLUSTER_CACHE", "~/.cache/llama-cluster")) / "venv-train",
    )
).expanduser()
PYTHON = TRAIN_VENV / "bin/python"
CLI = TRAIN_VENV / "bin/llamafactory-cli"
SAVED = {"torch_cuda": "saved", "nccl": "saved", "llamafactory_env": "- saved: yes"}

pytestmark = pytest.mark.skipif(
    not CLI.exists(), reason=f"no training venv at {TRAIN_VENV}: run scripts/setup-train-venv.sh"
)


def probe(cli: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """Run the probe as the llamafactory role does, with this venv's python."""
    return subprocess.run(
        [str(PYTHON), str(PROBE), str(cli), str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def this_key(cli: Path) -> str:
    """The probe's key for this environment and CLI."""
    code = "import runpy, sys; print(runpy.run_path(sys.argv[1])['probe_key'](sys.argv[2]))"
    done = subprocess.run(
        [str(PYTHON), "-c", code, str(PROBE), str(cli)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_a_cache_of_this_environment_answers(tmp_path: Path) -> None:
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({"key": this_key(CLI), "runtime": SAVED}))
    done = probe(CLI, cache)
    assert done.returncode == 0, done.stderr[-2000:]
    stack = json.loads(done.stdout)
    assert {k: stack[k] for k in SAVED} == SAVED
    # The versions are read on every run, from the distributions' metadata.
    assert stack["torch"]
    assert stack["llamafactory"]


def test_a_cache_of_another_environment_is_probed_again(tmp_path: Path) -> None:
    """Another key: the probe runs the CLI (here /bin/false, so it fails) instead of the cache."""
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({"key": this_key(Path("/bin/false")) + "x", "runtime": SAVED}))
    done = probe(Path("/bin/false"), cache)
    assert done.returncode != 0
    assert "CalledProcessError" in done.stderr
    assert json.loads(cache.read_text())["runtime"] == SAVED, "a failed probe left its cache"
