"""The node locks (requirements/node-py*.txt): one per supported Python, generated from group_vars
by scripts/lock-node-env.py, and agreeing on the packages every node must share."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

PROJECT = Path(__file__).resolve().parents[1]
SCRIPT = PROJECT / "scripts/lock-node-env.py"
# The packages whose versions must be identical on every node, whatever its Python.
SHARED = (
    "torch",
    "torchvision",
    "torchaudio",
    "transformers",
    "tokenizers",
    "llamafactory",
    "deepspeed",
    "accelerate",
    "peft",
    "datasets",
    "trl",
    "bitsandbytes",
    "liger-kernel",
)


def _script() -> object:
    """The lock script (a file with a dash in its name, not a module), executed once."""
    spec = importlib.util.spec_from_file_location("lock_node_env", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _script()
INPUTS = lock.load_inputs()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            out[lock.normalise(name)] = version
    return out


def group_vars() -> dict:
    versions = yaml.safe_load((PROJECT / "group_vars/all/versions.yml").read_text())
    expected = {
        "llamafactory": versions["llamafactory_version"],
        "deepspeed": versions["deepspeed_version"],
    }
    for name in ("torch", "torchvision", "torchaudio"):
        (version,) = {entry[name] for entry in versions["torch_matrix"].values()}
        expected[name] = version
    expected.update(versions["llamafactory_library_versions"])
    return expected


def test_every_supported_os_python_has_a_lock_and_no_other_lock_exists():
    defaults = yaml.safe_load((PROJECT / "roles/python_env/defaults/main.yml").read_text())
    supported = yaml.safe_load((PROJECT / "roles/host_facts/defaults/main.yml").read_text())
    os_python = defaults["python_env_os_python"]
    assert set(supported["host_facts_supported_os"]) <= set(os_python)
    wanted = {f"node-py{os_python[key].replace('.', '')}.txt" for key in os_python}
    wanted.add("node-py311.txt")  # the conda backend's Python 3.11
    assert {p.name for p in (PROJECT / "requirements").glob("node-py*.txt")} == wanted
    assert INPUTS["pythons"] == ["3.11", "3.12"]


def test_every_lock_pins_the_shared_packages_at_the_group_vars_versions():
    expected = group_vars()
    assert set(expected) == set(SHARED)
    for python in INPUTS["pythons"]:
        locked = pins(lock.lock_path(python))
        assert {name: locked.get(name) for name in SHARED} == expected, python


def test_the_shared_packages_are_the_same_in_every_lock():
    by_lock = {
        python: {name: pins(lock.lock_path(python))[name] for name in SHARED}
        for python in INPUTS["pythons"]
    }
    assert len({tuple(sorted(v.items())) for v in by_lock.values()}) == 1, by_lock


def test_locks_list_no_torch_runtime_package_and_carry_the_generated_header():
    for python in INPUTS["pythons"]:
        path = lock.lock_path(python)
        text = path.read_text()
        assert text.startswith(lock.GENERATED + "\n")
        assert not [n for n in pins(path) if re.match(r"^(nvidia-|cuda-|triton$)", n)]


def test_lock_headers_match_the_current_group_vars_and_the_lock_lines():
    # Offline and instant: the header records a hash of the inputs (a pin moved in group_vars
    # without regenerating shows here) and of the lines (a hand edit shows here).
    for python in INPUTS["pythons"]:
        path = lock.lock_path(python)
        text = path.read_text()
        header = re.search(r"^# inputs: (\w+)  body: (\w+)", text, re.M)
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        assert header.group(1) == lock.inputs_digest(INPUTS, python), f"{path.name} is stale"
        assert header.group(2) == lock.body_digest(lines), f"{path.name} was edited by hand"


def test_a_moved_pin_changes_the_inputs_digest():
    moved = {**INPUTS, "pins": [p.replace("peft==0.18.1", "peft==0.18.2") for p in INPUTS["pins"]]}
    assert lock.inputs_digest(moved, "3.12") != lock.inputs_digest(INPUTS, "3.12")


def generated_check(script: Path, env: dict[str, str] | None = None) -> None:
    """`script --check` (a generator of the repository's files) passes: what it would write is
    what the repository holds."""
    proc = subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_locks_are_what_the_script_generates():
    # Resolves again with uv (from its cache when warm: ~2 s; from PyPI when cold: ~20 s).
    generated_check(SCRIPT)
