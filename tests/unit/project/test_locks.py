"""The node locks (requirements/node-py*.txt): one per supported Python, generated from group_vars
by scripts/lock-node-env.py, agreeing on the packages every node must share, and carrying the
hashes of PyPI's files, which the nodes' installers and the wheelhouse check (issue 40)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter import python_env as env_filters

from tests.support.role_cases import LOCAL, run_cases

PROJECT = Path(__file__).resolve().parents[3]
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
    for pin, _hashes in lock.entries(path.read_text()):
        name, version = pin.split("==")
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
        assert lines == lock.body_lines(lock.entries(text), INPUTS)[0]
        assert header.group(1) == lock.inputs_digest(INPUTS, python), f"{path.name} is stale"
        assert header.group(2) == lock.body_digest(lines), f"{path.name} was edited by hand"


def test_a_moved_pin_changes_the_inputs_digest():
    moved = {**INPUTS, "pins": [p.replace("peft==0.18.1", "peft==0.18.2") for p in INPUTS["pins"]]}
    assert lock.inputs_digest(moved, "3.12") != lock.inputs_digest(INPUTS, "3.12")


def test_a_moved_resolution_date_changes_the_inputs_digest():
    # The lock is compared with its inputs offline (the header's digest); resolving again
    # against the live index is a command of its own, not a test (`scripts/lock-node-env.py
    # --check`): the index gains files within a past resolution date, so the same inputs need
    # not resolve to the same lock on a later day.
    moved = {**INPUTS, "resolved_at": "2001-01-01T00:00:00Z"}
    assert lock.inputs_digest(moved, "3.12") != lock.inputs_digest(INPUTS, "3.12")


# ---- the hashes ------------------------------------------------------------------------------
UNHASHED = {"torch", "torchvision", "torchaudio", "deepspeed"}


def test_every_pin_carries_pypis_hashes_but_the_index_builds_and_deepspeed():
    for python in INPUTS["pythons"]:
        text = lock.lock_path(python).read_text()
        found = lock.entries(text)
        bare = sorted(lock.normalise(pin.split("==")[0]) for pin, hashes in found if not hashes)
        assert set(bare) == UNHASHED, python
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for _, hashes in found for h in hashes)
        # DeepSpeed's source (the wheelhouse builds its wheel from it) is recorded in the header.
        (source,) = re.findall(r"^# sdist (deepspeed==\S+) --hash=sha256:[0-9a-f]{64}$", text, re.M)
        assert source == f"deepspeed=={group_vars()['deepspeed']}"


def test_the_lock_is_read_the_same_by_the_filters_and_the_script():
    text = lock.lock_path("3.11").read_text()
    assert env_filters.lock_pins(text) == [
        f"{lock.normalise(pin.split('==')[0])}=={pin.split('==')[1]}"
        for pin, _ in lock.entries(text)
    ]
    (uv_line,) = env_filters.lock_requirements(text, ["uv==0.13.9"]).splitlines()
    assert uv_line.startswith("uv==0.13.9 --hash=sha256:")
    with pytest.raises(Exception, match=re.escape("The lock has no hash for torch==2.11.0")):
        env_filters.lock_requirements(text, ["torch==2.11.0"])


def test_a_file_of_a_pin_whose_hash_is_none_of_the_locks_is_named():
    lock_text = (
        "# sdist deepspeed==0.19.8 --hash=sha256:" + "a" * 64 + "\n"
        "tyro==0.8.14 \\\n    --hash=sha256:"
        + "b" * 64
        + " \\\n    --hash=sha256:"
        + "c" * 64
        + "\n"
        "torch==2.11.0\n"
    )
    files = [
        {"path": "/w/tyro-0.8.14-py3-none-any.whl", "checksum": "c" * 64},
        {"path": "/w/torch-2.11.0+cu128-cp311-cp311-linux_x86_64.whl", "checksum": "0" * 64},
        {"path": "/w/other-1.0-py3-none-any.whl", "checksum": "0" * 64},
        {"path": "/w/src/deepspeed-0.19.8.tar.gz", "checksum": "a" * 64},
    ]
    assert env_filters.wheelhouse_hash_problems(files, lock_text) == []
    files[0]["checksum"] = "d" * 64
    files[3]["checksum"] = "e" * 64
    assert env_filters.wheelhouse_hash_problems(files, lock_text) == [
        f"/w/tyro-0.8.14-py3-none-any.whl: sha256 {'d' * 64} is none of the 2 the lock records "
        "for tyro==0.8.14",
        f"/w/src/deepspeed-0.19.8.tar.gz: sha256 {'e' * 64} is none of the 1 the lock records "
        "for deepspeed==0.19.8",
    ]


# ---- torch's builds -------------------------------------------------------------------------
def _torch_lock(python: str, build: str = "pypi") -> str:
    return lock.build_lock_path(python, build).read_text()


def test_the_pypi_build_of_torch_is_locked_whole_with_every_files_hash():
    # Issue 45: torch, torchvision and torchaudio were pinned without hashes, the CUDA runtime
    # wheels and triton not at all. The lab's and the CUDA 13.0 build come from PyPI alone.
    assert {e["build"] for e in yaml.safe_load((PROJECT / "group_vars/all/versions.yml")
            .read_text())["torch_matrix"].values()} == set(INPUTS["builds"])  # fmt: skip
    expected = {name: group_vars()[name] for name in lock.INDEX_BUILDS}
    for python in INPUTS["pythons"]:
        text = _torch_lock(python)
        found = lock.entries(text)
        names = {lock.normalise(pin.split("==")[0]): pin.split("==")[1] for pin, _ in found}
        assert {name: names[name] for name in lock.INDEX_BUILDS} == expected
        runtime = [n for n in names if lock.TORCH_RUNTIME.match(n)]
        assert "triton" in runtime
        assert [n for n in runtime if n.startswith("nvidia-")]
        assert set(names) == set(lock.INDEX_BUILDS) | set(runtime)  # nothing else
        assert all(hashes for _, hashes in found)
        assert all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for _, hs in found for h in hs)
        assert f"# index: {INPUTS['builds']['pypi']}" in text.splitlines()


def test_torch_build_lock_headers_match_their_inputs_and_lines():
    for path in sorted((PROJECT / "requirements").glob("torch-*-py*.txt")):
        build, major, minor = re.fullmatch(r"torch-(\w+)-py(\d)(\d+)\.txt", path.name).groups()
        python = f"{major}.{minor}"
        text = path.read_text()
        header = re.search(r"^# inputs: (\w+)  body: (\w+)", text, re.M)
        lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
        assert text.startswith(lock.TORCH_GENERATED + "\n")
        assert lines == lock.hashed_lines(lock.entries(text))
        assert header.group(1) == lock.build_digest(INPUTS, python, build), f"{path.name} is stale"
        assert header.group(2) == lock.body_digest(lines), f"{path.name} was edited by hand"


@pytest.mark.parametrize("required", [False, True])
def test_a_torch_build_without_its_lock_is_named_and_refused_where_required(
    tmp_path: Path, required: bool
):
    # A build whose index this machine cannot reach (download.pytorch.org) has no lock until
    # scripts/lock-node-env.py --builds <build> runs where it can: provision's pre-flight says so
    # and installs it by its pins, or refuses it where torch_require_lock asks.
    unlocked = [b for b in INPUTS["builds"] if not lock.build_lock_path("3.11", b).exists()]
    if not unlocked:
        pytest.skip("every torch build has its lock")
    build = unlocked[0]
    cuda = next(k for k, e in yaml.safe_load((PROJECT / "group_vars/all/versions.yml")
                .read_text())["torch_matrix"].items() if e["build"] == build)  # fmt: skip
    play = [
        {
            "hosts": "all",
            "gather_facts": False,
            "tasks": [
                {
                    "ansible.builtin.include_role": {
                        "name": "python_env",
                        "tasks_from": "validate.yml",
                    }
                }
            ],
        }
    ]
    host = {**LOCAL, "host_facts_os_key": "debian-12", "cluster_accelerator": "nvidia",
            "cuda_version": cuda, "torch_require_lock": required}  # fmt: skip
    out = run_cases(tmp_path, {"all": {"hosts": {"n1": host}}}, play)
    said = " ".join(out.split())
    assert f"No lock torch-{build}-py311.txt for torch's {build} build" in said, said[-3000:]
    assert f"scripts/lock-node-env.py --builds {build}" in said
    assert ("torch_require_lock is true: nothing was changed" in said) is required
    assert ("Installing it by its version pins from that index alone" in said) is not required


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


CACHE = Path(os.environ.get("LLAMA_CLUSTER_CACHE", "/var/cache/llama-cluster"))
WHEELHOUSE = CACHE / "wheelhouse" / "cp311-pypi"
needs_wheelhouse = pytest.mark.skipif(
    not (WHEELHOUSE / "src").is_dir(),
    reason=f"no wheelhouse at {WHEELHOUSE} (ansible-playbook playbooks/wheelhouse.yml fills it)",
)


@needs_wheelhouse
def test_the_wheelhouse_pypi_filled_matches_the_locks_hashes():
    text = lock.lock_path("3.11").read_text() + _torch_lock("3.11")
    files = [
        {"path": str(path), "checksum": _sha256(path)}
        for path in [*WHEELHOUSE.glob("*.whl"), *WHEELHOUSE.glob("src/*.tar.gz")]
    ]
    assert len(files) > 100
    assert [f for f in files if Path(f["path"]).name.startswith(("torch-", "nvidia_"))]
    assert env_filters.wheelhouse_hash_problems(files, text) == []
    # Every wheel but DeepSpeed's (built from its hashed source) has a hash in one lock.
    hashed = {pin for pin, hashes in env_filters._entries(text) if hashes}
    unhashed = set(env_filters.wheel_pins(f["path"] for f in files)) - hashed
    assert unhashed == {f"deepspeed=={group_vars()['deepspeed']}"}


@needs_wheelhouse
def test_pip_installs_uv_in_hash_checking_mode_and_refuses_a_forged_wheel(tmp_path: Path):
    # python_env's bootstrap: pip installs uv's pin with the lock's hashes (--require-hashes).
    text = lock.lock_path("3.11").read_text()
    requirements = tmp_path / "requirements-uv.txt"
    requirements.write_text(env_filters.lock_requirements(text, ["uv==0.13.9"]))
    (wheel,) = WHEELHOUSE.glob("uv-0.13.9-*.whl")
    forged = tmp_path / "forged"
    forged.mkdir()
    shutil.copy2(wheel, forged / wheel.name)
    with (forged / wheel.name).open("ab") as handle:
        handle.write(b"\0")  # one byte more: another file under the same name
    for house, ok in ((WHEELHOUSE, True), (forged, False)):
        argv = env_filters.install_argv(
            [], {"installer": "pip", "env_bin": "/x", "requirements": str(requirements),
                 "wheelhouse": str(house)},
        )  # fmt: skip
        target = tmp_path / f"target-{ok}"
        argv = [sys.executable, *argv[1:], "--target", str(target)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300)
        assert (done.returncode == 0) is ok, done.stdout + done.stderr
        if not ok:
            assert "THESE PACKAGES DO NOT MATCH THE HASHES" in done.stdout + done.stderr
