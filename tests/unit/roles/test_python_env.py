"""The node environment's install (roles/python_env, roles/llamafactory): the installer's command
line and the overlay's package list (filter/python_env.py), and the stack probe's cache
(roles/llamafactory/files/stack_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter import python_env as env_filters

PROJECT = Path(__file__).resolve().parents[3]


# The installer's command line and the overlay's package list (filter/python_env.py).


def test_install_argv_from_the_wheelhouse_is_offline_under_the_lock_for_uv_and_pip():
    spec = {
        "env_bin": "/e/bin",
        "constraints": "/e/constraints.txt",
        "wheelhouse": "/w",
        "index_urls": ["https://pypi.org/simple"],
    }
    uv = env_filters.install_argv(["torch==2.11.0"], {**spec, "installer": "uv"})
    assert uv == [
        "/e/bin/uv", "pip", "install", "--python", "/e/bin/python", "--no-index",
        "--find-links", "/w", "--constraint", "/e/constraints.txt", "--compile-bytecode",
        "torch==2.11.0",
    ]  # fmt: skip
    dry = env_filters.install_argv(["torch==2.11.0"], {**spec, "installer": "uv", "dry_run": True})
    assert dry[-2:] == ["--dry-run", "torch==2.11.0"]
    pip = env_filters.install_argv(["torch==2.11.0"], {**spec, "installer": "pip", "no_deps": True})
    assert pip[:5] == ["/e/bin/python", "-m", "pip", "install", "--disable-pip-version-check"]
    assert pip[5:] == [
        "--no-index", "--find-links", "/w", "--constraint", "/e/constraints.txt", "--no-deps",
        "torch==2.11.0",
    ]  # fmt: skip


def test_each_install_comes_from_one_named_index():
    # Issue 45: uv resolved with unsafe-best-match across torch's index and PyPI.
    spec = {
        "installer": "uv",
        "env_bin": "/e/bin",
        "requirements": "/e/torch-lock.txt",
        "no_deps": True,
        "index_urls": ["https://download.pytorch.org/whl/cu128"],
    }
    argv = env_filters.install_argv([], spec)
    assert argv[5:] == [
        "--index-url", "https://download.pytorch.org/whl/cu128",
        "--require-hashes", "--requirement", "/e/torch-lock.txt", "--no-deps",
        "--compile-bytecode",
    ]  # fmt: skip
    two = {**spec, "index_urls": [*spec["index_urls"], "https://pypi.org/simple"]}
    with pytest.raises(Exception, match="exactly one index: each install comes from one named"):
        env_filters.install_argv([], two)
    with pytest.raises(Exception, match="python_env_installer is 'conda'"):
        env_filters.install_argv(["x==1"], {**spec, "installer": "conda"})


def test_overlay_adds_the_locked_packages_the_wheelhouse_carries_at_their_pins():
    lock = "# header\naccelerate==1.11.0\nnumpy==2.5.5\ntorch==2.11.0\ntyro==0.8.14\n"
    carried = [
        "/w/tyro-0.8.14-py3-none-any.whl",
        "/w/accelerate-1.11.0-py3-none-any.whl",
        "/w/numpy-2.5.2-cp312-cp312-manylinux_2_28_x86_64.whl",  # not the lock's version
        "/w/torch-2.11.0+cu128-cp312-cp312-manylinux_2_28_x86_64.whl",
    ]
    assert env_filters.wheel_pins(carried[3:]) == ["torch==2.11.0"]
    assert env_filters.carried_pins(lock, carried, exclude=["torch==2.11.0"]) == [
        "accelerate==1.11.0",
        "tyro==0.8.14",
    ]


def test_installer_changed_reads_what_uv_and_pip_report():
    assert env_filters.installer_changed({"stderr": "Installed 3 packages in 9ms\n + a==1"}, "uv")
    assert not env_filters.installer_changed({"stderr": "Checked 3 packages in 1ms"}, "uv")
    assert env_filters.installer_changed({"stdout": "Successfully installed a-1\n"}, "pip")
    assert not env_filters.installer_changed({"stdout": "Requirement already satisfied: a"}, "pip")


def test_the_plan_s_dry_run_argv_and_what_it_says_would_change():
    spec = {"installer": "uv", "env_bin": "/e/bin", "constraints": "/c", "wheelhouse": "/w"}
    argv = env_filters.install_argv(["a==1"], {**spec, "dry_run": True})
    assert argv[-2:] == ["--dry-run", "a==1"]
    assert env_filters.installer_changed({"stderr": "Would install 2 packages\n + a==1"}, "uv")
    assert not env_filters.installer_changed({"stderr": "Would make no changes"}, "uv")
    assert env_filters.installer_changed({"stdout": "Would install a-1"}, "pip")


# -- The llamafactory role's stack probe: its cache answers only for the environment it was made in.
#
# Run with the controller's training venv (the same stack as a node's): a cache whose key is this
# environment's is used as it is; one made for another environment is probed again.

STACK_PROBE = PROJECT / "roles/llamafactory/files/stack_probe.py"
TRAIN_VENV = Path(
    os.environ.get(
        "LLAMA_CLUSTER_TRAIN_VENV",
        Path(os.environ.get("LLAMA_CLUSTER_CACHE", "~/.cache/llama-cluster")) / "venv-train",
    )
).expanduser()
TRAIN_PYTHON = TRAIN_VENV / "bin/python"
TRAIN_CLI = TRAIN_VENV / "bin/llamafactory-cli"
SAVED_RUNTIME = {"torch_cuda": "saved", "nccl": "saved", "llamafactory_env": "- saved: yes"}

needs_train_venv = pytest.mark.skipif(
    not TRAIN_CLI.exists(),
    reason=f"no training venv at {TRAIN_VENV}: run scripts/setup-train-venv.sh",
)


def run_stack_probe(cli: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """Run the probe as the llamafactory role does, with this venv's python."""
    return subprocess.run(
        [str(TRAIN_PYTHON), str(STACK_PROBE), str(cli), str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def stack_probe_key(cli: Path) -> str:
    """The probe's key for this environment and TRAIN_CLI."""
    code = "import runpy, sys; print(runpy.run_path(sys.argv[1])['probe_key'](sys.argv[2]))"
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", code, str(STACK_PROBE), str(cli)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


@needs_train_venv
def test_a_cache_of_this_environment_answers(tmp_path: Path) -> None:
    cache = tmp_path / "probe.json"
    cache.write_text(json.dumps({"key": stack_probe_key(TRAIN_CLI), "runtime": SAVED_RUNTIME}))
    done = run_stack_probe(TRAIN_CLI, cache)
    assert done.returncode == 0, done.stderr[-2000:]
    stack = json.loads(done.stdout)
    assert {k: stack[k] for k in SAVED_RUNTIME} == SAVED_RUNTIME
    # The versions are read on every run, from the distributions' metadata.
    assert stack["torch"]
    assert stack["llamafactory"]


@needs_train_venv
def test_a_cache_of_another_environment_is_probed_again(tmp_path: Path) -> None:
    """Another key: the probe runs the CLI (here /bin/false, so it fails) instead of the cache."""
    cache = tmp_path / "probe.json"
    cache.write_text(
        json.dumps({"key": stack_probe_key(Path("/bin/false")) + "x", "runtime": SAVED_RUNTIME})
    )
    done = run_stack_probe(Path("/bin/false"), cache)
    assert done.returncode != 0
    assert "CalledProcessError" in done.stderr
    assert json.loads(cache.read_text())["runtime"] == SAVED_RUNTIME, (
        "a failed probe left its cache"
    )
