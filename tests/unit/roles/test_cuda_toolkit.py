"""roles/cuda_toolkit on a server in use: NVIDIA's repository never replaces the driver's packages,
and the toolkit is on PATH for the cluster's jobs only unless cuda_toolkit_host_wide asks.

The pin (module_utils/driver.py apt_preferences) is read by the real apt of this machine: a
private apt root (its own sources, lists, status and preferences.d; nothing of the machine's)
holds two file: repositories, one labelled as NVIDIA's CUDA repository is, with a newer driver
and the toolkit, one as the distro, with the driver the node runs. apt-get's simulation then
says what an `apt upgrade` or an install would do. NVIDIA's repository itself is unreachable
here: its Release label ("NVIDIA CUDA") is the one NVIDIA's own pin file names.

The role's files are written by its real tasks (tasks/environment.yml) on this machine, into a
directory per case (the role's paths pointed there), and the jobs' environment is rendered from
roles/job's real template after `setup` reads the fact the role wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils import driver
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.logs import read_env_file

# One worker takes the whole module, so its module-scoped fixture (ansible-playbook runs)
# runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("cuda-toolkit")

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
HOME = "/usr/local/cuda-12.8"

# ---- the pin, read by apt ------------------------------------------------------------------------
NVIDIA = "NVIDIA CUDA"
DISTRO = "Ubuntu"


def _stanza(package: str, version: str, status: bool = False) -> str:
    lines = [f"Package: {package}", f"Version: {version}", "Architecture: amd64"]
    lines += ["Maintainer: test <test@example.com>", "Description: test"]
    lines += ["Status: install ok installed"] if status else [f"Filename: {package}.deb", "Size: 1"]
    return "\n".join(lines) + "\n"


class Apt:
    """A private apt root: two repositories, the packages installed, a preferences.d."""

    def __init__(
        self, root: Path, repos: dict[str, list[tuple[str, str]]], installed: dict[str, str]
    ):
        self.root = root
        sources = []
        for label, packages in repos.items():
            repo = root / label.replace(" ", "-")
            repo.mkdir(parents=True)
            (repo / "Packages").write_text("\n".join(_stanza(*p) for p in packages))
            (repo / "Release").write_text(
                f"Origin: {label}\nLabel: {label}\nArchitectures: amd64\n"
                "Date: Sat, 05 Dec 2026 00:00:00 UTC\n"
            )
            sources.append(f"deb [trusted=yes] file:{repo} ./")
        for name in ("etc/preferences.d", "etc/apt.conf.d", "etc/sources.list.d", "log"):
            (root / name).mkdir(parents=True)
        for name in ("state/lists/partial", "cache/archives/partial"):
            (root / name).mkdir(parents=True)
        (root / "etc/sources.list").write_text("\n".join(sources) + "\n")
        (root / "status").write_text("\n".join(_stanza(p, v, True) for p, v in installed.items()))
        self.options = [
            f"-oDir::Etc={root}/etc",
            f"-oDir::Etc::sourcelist={root}/etc/sources.list",
            f"-oDir::Etc::sourceparts={root}/etc/sources.list.d",
            f"-oDir::Etc::preferencesparts={root}/etc/preferences.d",
            f"-oDir::Etc::parts={root}/etc/apt.conf.d",
            f"-oDir::State={root}/state",
            f"-oDir::State::status={root}/status",
            f"-oDir::Cache={root}/cache",
            f"-oDir::Log={root}/log",
            "-oDebug::NoLocking=1",
            "-oAPT::Architecture=amd64",
        ]
        self.run("apt-get", "update")

    def run(self, tool: str, *args: str) -> str:
        done = subprocess.run(
            [tool, *self.options, *args], capture_output=True, text=True, check=True, timeout=60
        )
        return done.stdout

    def pin(self, text: str) -> None:
        (self.root / "etc/preferences.d/llama-cluster-cuda").write_text(text)

    def would_install(self, *args: str) -> dict[str, str]:
        """Package -> (version, origin label) that apt-get's simulation would install."""
        lines = self.run("apt-get", "-s", *args).splitlines()
        found = {}
        for line in lines:
            if line.startswith("Inst "):
                words = line.split()
                version, label = line.split("(", 1)[1].split(" ", 1)
                found[words[1]] = f"{version} {label.split(':', 1)[0]}"
        return found


needs_apt = pytest.mark.skipif(shutil.which("apt-get") is None, reason="apt-get is not installed")

# A node whose driver came from the distro: NVIDIA's repository carries a newer build of the same
# packages, under the same names (as it does for Ubuntu), and the toolkit.
NEWER = "580.105.08-0ubuntu1"
DISTRO_DRIVER = "580.95.05-0ubuntu0.22.04.1"
REPOS = {
    NVIDIA: [
        ("nvidia-driver-580", NEWER),
        ("libnvidia-compute-580", NEWER),
        ("cuda-drivers-580", "580.105.08-1"),
        ("cuda-toolkit-12-8", "12.8.1-1"),
    ],
    DISTRO: [("nvidia-driver-580", DISTRO_DRIVER), ("libnvidia-compute-580", DISTRO_DRIVER)],
}
FROM_DISTRO = {"nvidia-driver-580": DISTRO_DRIVER, "libnvidia-compute-580": DISTRO_DRIVER}
# A node whose driver came from NVIDIA's repository: 580.95.05, beside a newer build there.
HELD = "580.95.05-0ubuntu1"
HELD_REPOS = {NVIDIA: [*REPOS[NVIDIA], ("nvidia-driver-580", HELD)], DISTRO: REPOS[DISTRO]}
KEEP = {"action": "keep", "loaded": "580.95.05", "installed": "580.95.05"}


@needs_apt
def test_unpinned_an_apt_upgrade_swaps_the_driver_for_nvidia_s_build(tmp_path: Path) -> None:
    # The harm the pin prevents: the userspace of 580.105 under the running 580.95 module.
    apt = Apt(tmp_path, REPOS, FROM_DISTRO)
    assert apt.would_install("upgrade") == {
        "nvidia-driver-580": f"{NEWER} {NVIDIA}",
        "libnvidia-compute-580": f"{NEWER} {NVIDIA}",
    }


@needs_apt
def test_pinned_the_distro_s_driver_stays_and_the_toolkit_still_installs(tmp_path: Path) -> None:
    apt = Apt(tmp_path, REPOS, FROM_DISTRO)
    apt.pin(driver.apt_preferences(driver_from_repo=False, held=driver.held_driver(KEEP)))
    assert apt.would_install("upgrade") == {}
    assert apt.would_install("install", "cuda-toolkit-12-8") == {
        "cuda-toolkit-12-8": f"12.8.1-1 {NVIDIA}"
    }
    # Not even asked by name does the repository give a driver package.
    with pytest.raises(subprocess.CalledProcessError):
        apt.would_install("install", "cuda-drivers-580")


@needs_apt
def test_a_driver_from_nvidia_s_repository_is_held_at_the_version_the_node_runs(
    tmp_path: Path,
) -> None:
    apt = Apt(tmp_path, HELD_REPOS, {"nvidia-driver-580": HELD})
    assert apt.would_install("upgrade") == {"nvidia-driver-580": f"{NEWER} {NVIDIA}"}
    apt.pin(driver.apt_preferences(driver_from_repo=True, held=driver.held_driver(KEEP)))
    assert apt.would_install("upgrade") == {}


@needs_apt
def test_before_a_driver_from_the_repository_is_installed_nothing_holds_it_back(
    tmp_path: Path,
) -> None:
    apt = Apt(tmp_path, REPOS, {})
    install = {"action": "install", "loaded": None, "installed": None}
    apt.pin(driver.apt_preferences(driver_from_repo=True, held=driver.held_driver(install)))
    assert apt.would_install("install", "cuda-drivers-580") == {
        "cuda-drivers-580": f"580.105.08-1 {NVIDIA}"
    }


@pytest.mark.parametrize(
    ("decision", "held"),
    [
        (KEEP, "580.95.05"),
        # A reboot pending: the driver on disk is the one the node will run.
        ({"action": "keep", "loaded": "550.54.15", "installed": "580.95.05"}, "580.95.05"),
        ({"action": "keep", "loaded": "580.95.05", "installed": None}, "580.95.05"),
        # The packages to come must not be held back by the driver they replace.
        ({"action": "upgrade", "loaded": "470.256.02", "installed": "470.256.02"}, ""),
        ({"action": "install", "loaded": None, "installed": None}, ""),
        ({"action": "keep", "loaded": None, "installed": None}, ""),
        (None, ""),
    ],
)
def test_the_driver_held_is_the_one_the_node_keeps(decision: dict | None, held: str) -> None:
    assert driver.held_driver(decision) == held


def test_a_held_version_that_is_no_version_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not a version such as 580\.95\.05"):
        driver.apt_preferences(driver_from_repo=True, held="580*")


# ---- the toolkit's files and the jobs' environment, by the role's own tasks ----------------------
OPERATORS_PROFILE = "# mine\nexport PATH=/opt/cuda-11.8/bin:$PATH\n"
EARLIER_RELEASE_PROFILE = (
    "#\n# Ansible managed\n#\n"
    "# CUDA 12.8 toolkit for login shells: nvcc on PATH, its libraries on the loader path.\n"
    "export CUDA_HOME=/usr/local/cuda-12.8\n"
)
FILES = {
    "script": "opt/cuda.sh",
    "fact": "facts.d/llama_cuda.fact",
    "apt_preferences": "apt/llama-cluster-cuda",
    "profile": "profile.d/llama-cluster-cuda.sh",
    "ldconf": "ld.so.conf.d/llama-cluster-cuda.conf",
    "old_profile": "profile.d/cuda.sh",
    "old_ldconf": "ld.so.conf.d/cuda-llama-cluster.conf",
}
# Each case a host: the toolkit's files with cuda_toolkit_host_wide or without it, over what an
# operator or an earlier release left; and a node without a toolkit (no fact).
CASES: dict[str, dict] = {
    "host_wide": {
        "wide": True,
        "before": {"old_profile": OPERATORS_PROFILE},
        "driver": {"nvidia_driver_source": "cuda_repo", "__nvidia_driver_decision": KEEP},
    },
    "default_after_host_wide": {
        "wide": False,
        "before": {"old_profile": OPERATORS_PROFILE, "profile": "x\n", "ldconf": f"{HOME}/lib64\n"},
    },
    "default_after_earlier_release": {
        "wide": False,
        "before": {"old_profile": EARLIER_RELEASE_PROFILE, "old_ldconf": f"{HOME}/lib64\n"},
    },
    "no_toolkit": {"toolkit": False},
}
JOB_VARS = {
    "job_id": "run1",
    "job_dir": "/opt/llama-cluster/runs/run1",
    "__job_rank": 0,
    "__job_nnodes": 2,
    "__job_nproc": 1,
    "__job_master_addr": "10.0.0.11",
    "__job_ifname": "",
    "__job_p2p_disable": False,
    "job_cluster_environment": {},
    "job_environment": {},
    "job_one_gpu_per_process": False,
}
PLAYBOOK = [
    {
        "name": "The toolkit's files, then the jobs' environment from the fact",
        "hosts": "all",
        "gather_facts": False,
        "vars": JOB_VARS,
        "tasks": [
            {
                "ansible.builtin.include_role": {
                    "name": "cuda_toolkit",
                    "tasks_from": "environment.yml",
                },
                "when": "toolkit | default(true)",
            },
            {
                "ansible.builtin.include_role": {"name": "cuda_toolkit", "tasks_from": "pin.yml"},
                "when": "toolkit | default(true)",
            },
            {
                "ansible.builtin.setup": {
                    "gather_subset": ["!all", "!min", "local"],
                    "fact_path": "{{ case_dir }}/facts.d",
                }
            },
            {
                "ansible.builtin.copy": {
                    "content": "{{ lookup('ansible.builtin.template', job_env_template) }}",
                    "dest": "{{ case_dir }}/job.env",
                    "mode": "0644",
                }
            },
        ],
    }
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's directory after one ansible-playbook run of the role's tasks."""
    if os.geteuid() != 0:
        pytest.skip("the role writes its files as root (owner root)")
    tmp = tmp_path_factory.mktemp("cuda-toolkit")
    hosts = {}
    for name, case in CASES.items():
        where = tmp / name
        for key, text in case.get("before", {}).items():
            (where / FILES[key]).parent.mkdir(parents=True, exist_ok=True)
            (where / FILES[key]).write_text(text)
        for path in FILES.values():
            (where / path).parent.mkdir(parents=True, exist_ok=True)
        hosts[name] = {
            "case_dir": str(where),
            "cuda_toolkit_host_wide": case.get("wide", False),
            "toolkit": case.get("toolkit", True),
            **case.get("driver", {"__nvidia_driver_decision": KEEP}),
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
        }
    (tmp / "hosts.yml").write_text(json.dumps({"all": {"hosts": hosts}}))
    (tmp / "play.yml").write_text(json.dumps(PLAYBOOK))
    # The role's paths (its vars) under each case's directory, and no loader cache refreshed.
    paths = {key: "{{ case_dir }}/" + path for key, path in FILES.items()}
    extra = {
        "cuda_version": "12.8",
        "__cuda_toolkit_home": HOME,
        "__cuda_toolkit_paths": paths,
        "__cuda_toolkit_ldconfig": ["true"],
        "job_env_template": str(ROOT / "roles/job/templates/job.env.j2"),
    }
    argv = [str(ANSIBLE_PLAYBOOK), "-i", str(tmp / "hosts.yml"), str(tmp / "play.yml")]
    env = {**os.environ, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp / "facts")}
    done = subprocess.run(
        [*argv, "-e", json.dumps(extra)], check=False, cwd=ROOT, env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return {name: tmp / name for name in CASES}


def _exists(where: Path) -> set[str]:
    return {key for key, path in FILES.items() if (where / path).exists()}


@needs_apt
@pytest.mark.parametrize(
    ("case", "repos", "installed"),
    [
        ("default_after_host_wide", REPOS, FROM_DISTRO),
        ("host_wide", HELD_REPOS, {"nvidia-driver-580": HELD}),
    ],
)
def test_the_role_s_pin_keeps_the_driver_through_an_apt_upgrade(
    cases: dict[str, Path], tmp_path: Path, case: str, repos: dict, installed: dict[str, str]
) -> None:
    # Written by the role's pin.yml, read by apt.
    apt = Apt(tmp_path, repos, installed)
    assert apt.would_install("upgrade")
    apt.pin((cases[case] / FILES["apt_preferences"]).read_text())
    assert apt.would_install("upgrade") == {}
    assert "cuda-toolkit-12-8" in apt.would_install("install", "cuda-toolkit-12-8")


def test_by_default_nothing_is_host_wide(cases: dict[str, Path]) -> None:
    # Only the cluster's own script and fact; the operator's /etc/profile.d/cuda.sh stays.
    where = cases["default_after_host_wide"]
    assert _exists(where) == {"script", "fact", "old_profile", "apt_preferences"}
    assert (where / FILES["old_profile"]).read_text() == OPERATORS_PROFILE


def test_an_earlier_release_s_host_wide_files_go(cases: dict[str, Path]) -> None:
    assert _exists(cases["default_after_earlier_release"]) == {"script", "fact", "apt_preferences"}


def test_host_wide_puts_the_toolkit_first_for_every_login_shell_and_program(
    cases: dict[str, Path],
) -> None:
    where = cases["host_wide"]
    assert _exists(where) == {
        "script",
        "fact",
        "profile",
        "ldconf",
        "old_profile",
        "apt_preferences",
    }
    assert (where / FILES["ldconf"]).read_text() == f"{HOME}/lib64\n"
    assert (where / FILES["profile"]).read_text() == (where / FILES["script"]).read_text()
    assert (where / FILES["old_profile"]).read_text() == OPERATORS_PROFILE


def test_the_script_puts_nvcc_first_on_path_once_and_leaves_the_loader_alone(
    cases: dict[str, Path],
) -> None:
    script = cases["default_after_host_wide"] / FILES["script"]
    shell = f". {script}; . {script}; echo $CUDA_HOME; echo $PATH; echo ${{LD_LIBRARY_PATH-unset}}"
    done = subprocess.run(
        ["bash", "-c", shell], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert done.stdout.splitlines() == [HOME, f"{HOME}/bin:/usr/bin:/bin", "unset"]


def test_the_fact_says_where_the_toolkit_is(cases: dict[str, Path]) -> None:
    fact = json.loads((cases["host_wide"] / FILES["fact"]).read_text())
    assert fact == {"version": "12.8", "home": HOME, "bin": f"{HOME}/bin"}


def test_the_jobs_get_the_toolkit_from_the_fact_after_the_cluster_s_environment(
    cases: dict[str, Path],
) -> None:
    env = read_env_file((cases["default_after_host_wide"] / "job.env").read_text())
    assert env["CUDA_HOME"] == HOME
    path = env["PATH"].split(":")
    assert path[:2] == ["/opt/llama-cluster/env/bin", f"{HOME}/bin"]
    assert "LD_LIBRARY_PATH" not in env


def test_a_node_without_the_toolkit_gets_no_cuda_in_its_jobs(cases: dict[str, Path]) -> None:
    env = read_env_file((cases["no_toolkit"] / "job.env").read_text())
    assert "CUDA_HOME" not in env
    assert (
        env["PATH"]
        == "/opt/llama-cluster/env/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    )
