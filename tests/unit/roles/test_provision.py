"""Provisioning without containers: what the GPU roles would install on each supported OS, and
bad input failing in provision.yml's pre-flight plays, before any node changes.

The hosts are throwaway inventory entries on the local connection whose OS facts are seeded into
a private fact cache (set_fact cacheable), so the real role tasks run against Ubuntu 22.04,
Ubuntu 24.04 and Debian 12 as Ansible sees them. Everything that could change a host runs in
check mode; the roles' plan/validate tasks are read-only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# One worker takes the whole module, so its module-scoped fixture (ansible-playbook runs)
# runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("provision")

PROJECT = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = str(Path(sys.executable).with_name("ansible-playbook"))

OS_FACTS = {
    "ubuntu2204": ("Ubuntu", "22.04", "22", "jammy", "Debian", 3, 10),
    "ubuntu2404": ("Ubuntu", "24.04", "24", "noble", "Debian", 3, 12),
    "debian12": ("Debian", "12.12", "12", "bookworm", "Debian", 3, 11),
    "fedora40": ("Fedora", "40", "40", "", "RedHat", 3, 12),
}
KERNEL = "6.1.0-99-amd64"


def seed_playbook(hosts: dict[str, tuple]) -> list[dict]:
    """A play per host that gathers its facts, then replaces the OS in the fact cache."""
    plays = []
    for host, (dist, version, major, release, family, py_major, py_minor) in hosts.items():
        facts = {
            "ansible_distribution": dist,
            "ansible_distribution_version": version,
            "ansible_distribution_major_version": major,
            "ansible_distribution_release": release,
            "ansible_os_family": family,
            "ansible_kernel": KERNEL,
            "ansible_architecture": "x86_64",
            "ansible_python": {"version": {"major": py_major, "minor": py_minor}},
            "ansible_default_ipv4": {"address": "127.0.0.1"},
        }
        plays.append(
            {
                "name": f"Seed {host}",
                "hosts": host,
                "gather_facts": True,
                "tasks": [{"ansible.builtin.set_fact": {**facts, "cacheable": True}}],
            }
        )
    return plays


class Lab:
    """A throwaway inventory, fact cache and output directory."""

    def __init__(self, root: Path, hosts: list[str]) -> None:
        self.root = root
        self.out = root / "out"
        self.out.mkdir()
        pci = root / "pci"
        pci.mkdir()
        inventory = {
            "all": {
                "children": {
                    "cluster": {"hosts": {h: {} for h in hosts}},
                    "master": {"hosts": {hosts[0]: {}}},
                    "workers": {"hosts": {h: {} for h in hosts[1:]}},
                },
                "vars": {
                    "ansible_connection": "local",
                    "ansible_python_interpreter": sys.executable,
                    "host_facts_pci_devices_dir": str(pci),
                },
            }
        }
        self.inventory = root / "inventory.yml"
        self.inventory.write_text(json.dumps(inventory))
        self.env = {
            **os.environ,
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(root / "facts"),
            "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "LLAMA_CLUSTER_CACHE": str(root / "cache"),
        }
        seed = root / "seed.yml"
        seed.write_text(json.dumps(seed_playbook({h: OS_FACTS[h] for h in hosts})))
        self.run(seed, check=True)

    def run(self, playbook: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        """ansible-playbook from the project root (its ansible.cfg applies)."""
        proc = subprocess.run(
            [ANSIBLE_PLAYBOOK, "-i", str(self.inventory), str(playbook), *args],
            cwd=PROJECT,
            env=self.env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc


BARE_GPU_NODE = {
    "gpu_count": 1,
    "driver_loaded": False,
    "driver_version": None,
    "driver_installed": None,
    "nouveau_loaded": False,
    "secure_boot": False,
}

PLAN_PLAYBOOK = [
    {
        "name": "Render what the GPU roles would install",
        "hosts": "cluster",
        "vars": {"bare_gpu_node": BARE_GPU_NODE},
        "gather_facts": False,
        "tasks": [
            {"ansible.builtin.include_role": {"name": "host_facts", "tasks_from": "os.yml"}},
            # What host_facts' probe would find: a GPU, and the driver state a test gives.
            {
                "ansible.builtin.set_fact": {
                    "__host_facts_gpus": "{{ node_facts | default(bare_gpu_node) }}"
                }
            },
        ]
        + [
            {"ansible.builtin.include_role": {"name": role, "tasks_from": "plan.yml"}}
            for role in ("nvidia_driver", "cuda_toolkit", "nccl")
        ]
        + [
            {
                "ansible.builtin.copy": {
                    "dest": "{{ out_dir }}/{{ inventory_hostname }}.json",
                    "mode": "0644",
                    "content": "{{ {"
                    "'driver_packages': __nvidia_driver_packages,"
                    "'driver_repo_lines': __nvidia_driver_repo_lines,"
                    "'driver_decision': __nvidia_driver_decision,"
                    "'cuda_repo_line': __cuda_toolkit_repo_line,"
                    "'cuda_key_url': __cuda_toolkit_repo_key_url,"
                    "'toolkit_packages': __cuda_toolkit_packages,"
                    "'cuda_home': __cuda_toolkit_home,"
                    "'nccl_packages': __nccl_packages} | to_json }}",
                },
                "delegate_to": "localhost",
            }
        ],
    }
]

SUPPORTED = ["ubuntu2204", "ubuntu2404", "debian12"]


@pytest.fixture(scope="module")
def gpu_lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return Lab(tmp_path_factory.mktemp("gpu"), SUPPORTED)


def render(lab: Lab, *extra: str) -> dict[str, dict]:
    playbook = lab.root / "plan.yml"
    playbook.write_text(json.dumps(PLAN_PLAYBOOK))
    for f in lab.out.glob("*.json"):
        f.unlink()
    lab.run(
        playbook,
        "-e",
        json.dumps({"out_dir": str(lab.out), "cluster_accelerator": "nvidia", **dict(extra)}),
        check=True,
    )
    return {f.stem: json.loads(f.read_text()) for f in lab.out.glob("*.json")}


def test_gpu_plan_uses_each_distros_driver_packages_and_nvidias_cuda_repository(gpu_lab: Lab):
    plans = render(gpu_lab, ("nccl_system_install", True))
    headers = f"linux-headers-{KERNEL}"

    assert plans["ubuntu2204"]["driver_packages"] == [
        "nvidia-driver-580-server",
        "nvidia-utils-580-server",
        headers,
    ]
    assert plans["ubuntu2404"]["driver_packages"] == plans["ubuntu2204"]["driver_packages"]
    assert plans["debian12"]["driver_packages"] == [
        "nvidia-driver=535.309.01-0+deb12u1",
        "nvidia-kernel-dkms=535.309.01-0+deb12u1",
        "nvidia-smi=535.309.01-0+deb12u1",
        "firmware-misc-nonfree",
        headers,
    ]
    # A node without a driver gets the pinned one, loaded by modprobe (no reboot).
    assert plans["ubuntu2204"]["driver_decision"]["action"] == "install"
    assert plans["ubuntu2204"]["driver_decision"]["reason"] == (
        "no NVIDIA driver is loaded: install branch 580, then load it with modprobe"
    )
    assert plans["debian12"]["driver_decision"]["reason"] == (
        "no NVIDIA driver is loaded: install 535.309.01, then load it with modprobe"
    )
    # Only Debian needs its non-free components enabled; Ubuntu's drivers are in restricted.
    assert plans["ubuntu2204"]["driver_repo_lines"] == []
    assert plans["debian12"]["driver_repo_lines"] == [
        "deb http://deb.debian.org/debian bookworm contrib non-free non-free-firmware",
        "deb http://deb.debian.org/debian bookworm-updates contrib non-free non-free-firmware",
        "deb http://security.debian.org/debian-security bookworm-security contrib non-free"
        " non-free-firmware",
    ]
    repos = "https://developer.download.nvidia.com/compute/cuda/repos"
    for host, distro in [
        ("ubuntu2204", "ubuntu2204"),
        ("ubuntu2404", "ubuntu2404"),
        ("debian12", "debian12"),
    ]:
        plan = plans[host]
        assert plan["cuda_repo_line"] == (
            f"deb [signed-by=/etc/apt/keyrings/cuda-archive-keyring.asc] {repos}/{distro}/x86_64/ /"
        )
        assert plan["cuda_key_url"] == f"{repos}/{distro}/x86_64/3bf863cc.pub"
        assert plan["toolkit_packages"] == ["cuda-toolkit-12-8"]
        assert plan["cuda_home"] == "/usr/local/cuda-12.8"
        assert plan["nccl_packages"] == [
            "libnccl2=2.26.2-1+cuda12.8",
            "libnccl-dev=2.26.2-1+cuda12.8",
        ]


def test_gpu_plan_from_cuda_repository_uses_cuda_drivers_of_the_branch(gpu_lab: Lab):
    plans = render(
        gpu_lab,
        ("nvidia_driver_source", "cuda_repo"),
        ("nvidia_driver_fabricmanager", True),
        ("cuda_version", "13.0"),
        (
            "nvidia_driver_branch",
            {"ubuntu-22.04": "580", "ubuntu-24.04": "580", "debian-12": "580"},
        ),
        ("nvidia_driver_package_version", {}),
    )
    for host in SUPPORTED:
        assert plans[host]["driver_packages"] == [
            "cuda-drivers-580",
            f"linux-headers-{KERNEL}",
            "nvidia-fabricmanager-580",
        ]
        assert plans[host]["driver_repo_lines"] == []
        assert plans[host]["toolkit_packages"] == ["cuda-toolkit-13-0"]
        assert plans[host]["nccl_packages"] == []


def plan_failure(lab: Lab, extra: dict) -> str:
    """Render the plan expecting it to stop; its output on one line."""
    playbook = lab.root / "plan.yml"
    playbook.write_text(json.dumps(PLAN_PLAYBOOK))
    args = {"out_dir": str(lab.out), "cluster_accelerator": "nvidia", **extra}
    proc = lab.run(playbook, "-e", json.dumps(args))
    assert proc.returncode != 0, proc.stdout
    return " ".join(proc.stdout.split())


def test_gpu_plan_blocks_debians_535_driver_under_cuda_13_but_keeps_a_loaded_580(gpu_lab: Lab):
    out = plan_failure(gpu_lab, {"cuda_version": "13.0"})
    assert (
        "debian12: no NVIDIA driver is loaded, and the driver it would get, 535.309.01-0+deb12u1,"
        " is older than the minimum 580.65.06 of CUDA 13.0." in out
    )
    # The same OS with a 580 driver its operator installed: kept, the run goes on.
    loaded = {**BARE_GPU_NODE, "driver_loaded": True, "driver_version": "580.95.05"}
    plans = render(gpu_lab, ("cuda_version", "13.0"), ("node_facts", loaded))
    assert plans["debian12"]["driver_decision"]["action"] == "keep"


def test_gpu_plan_keeps_an_older_branch_that_meets_the_cuda_builds_minimum(gpu_lab: Lab):
    loaded = {**BARE_GPU_NODE, "driver_loaded": True, "driver_version": "550.54.15"}
    plans = render(gpu_lab, ("node_facts", loaded))
    for host in SUPPORTED:
        decision = plans[host]["driver_decision"]
        assert (decision["action"], decision["reboot"], decision["stop"]) == ("keep", False, "")


def test_gpu_plan_stops_a_node_needing_a_reboot_with_the_command_to_continue(gpu_lab: Lab):
    nouveau = {**BARE_GPU_NODE, "nouveau_loaded": True}
    out = plan_failure(gpu_lab, {"node_facts": nouveau})
    # The lab's hosts run on the local connection: each is the controller, never rebooted.
    assert (
        "ubuntu2404: nouveau is loaded (it holds the GPUs): install branch 580, then reboot to"
        " load it. ubuntu2404 is the controller itself, which provision.yml never reboots:"
        " reboot it by hand, then run provision.yml again." in out
    )
    pending = {**BARE_GPU_NODE, "driver_installed": "580.95.05"}
    out = plan_failure(gpu_lab, {"node_facts": pending, "ansible_connection": "ssh"})
    assert (
        "debian12: no NVIDIA driver is loaded; driver 580.95.05 is installed but not loaded: a"
        " reboot is pending, no reinstall. provision.yml reboots a node only when allowed."
        " Continue with: ansible-playbook -i"
        f" {gpu_lab.inventory} provision.yml -e allow_reboot=true --limit debian12 or reboot"
        " debian12 by hand and run provision.yml again." in out
    )


# provision.yml's pre-flight: each bad input stops the run before the Provision play.


@pytest.fixture(scope="module")
def debian_lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return Lab(tmp_path_factory.mktemp("debian"), ["debian12"])


def preflight_failure(lab: Lab, extra: dict) -> str:
    proc = lab.run(PROJECT / "provision.yml", "--check", "-e", json.dumps(extra))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "PLAY [Provision" not in out, "the Provision play started despite bad input"
    assert "changed=0" in out
    assert "changed=1" not in out
    return " ".join(out.split())


@pytest.fixture(scope="module")
def mixed_lab(tmp_path_factory: pytest.TempPathFactory) -> Lab:
    return Lab(tmp_path_factory.mktemp("mixed"), SUPPORTED)


def preflight(lab: Lab, *args: str) -> subprocess.CompletedProcess:
    """provision.yml in check mode with a tag no role has: only the pre-flight (tags: always)."""
    extra = json.dumps({"cluster_accelerator": "cpu"})
    return lab.run(PROJECT / "provision.yml", "--check", "--tags", "preflight", "-e", extra, *args)


@pytest.mark.parametrize(
    ("limit", "plans"),
    [
        # Ubuntu 22.04's python3 is 3.10 (seeded): its venv takes the python3.11 package.
        (
            "ubuntu2204,debian12",
            {
                "ubuntu2204": "venv with Python 3.11 (ubuntu-22.04), lock node-py311.txt",
                "debian12": "venv with Python 3.11 (debian-12), lock node-py311.txt",
            },
        ),
        ("ubuntu2404", {"ubuntu2404": "venv with Python 3.12 (ubuntu-24.04), lock node-py312.txt"}),
    ],
)
def test_preflight_passes_on_python_310_311_312_nodes_with_their_lock(
    mixed_lab: Lab, limit: str, plans: dict[str, str]
):
    proc = preflight(mixed_lab, "--limit", limit)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for host, plan in plans.items():
        assert f"ok: [{host}] => msg: {plan}, installer uv" in out
    assert "changed=1" not in out


def test_nodes_with_different_pythons_fail_naming_each_node_and_python(mixed_lab: Lab):
    proc = preflight(mixed_lab)
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert (
        "The nodes would get different Pythons, and every node must run the same stack on the"
        " same Python: ubuntu2204 (ubuntu-22.04) Python 3.11; ubuntu2404 (ubuntu-24.04) Python"
        " 3.12; debian12 (debian-12) Python 3.11." in out
    )
    assert "python_env_backend: conda" in out


def test_preflight_runs_with_tags_and_stops_bad_input(debian_lab: Lab):
    proc = debian_lab.run(
        PROJECT / "provision.yml",
        "--check",
        "--tags",
        "llamafactory",
        "-e",
        '{"cuda_version": "11.1"}',
    )
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert "PLAY [Pre-flight | Check every node before any node changes]" in out
    assert "cuda_version '11.1' has no entry in torch_matrix" in out


def test_unknown_os_fails_before_any_change(tmp_path: Path):
    lab = Lab(tmp_path, ["fedora40"])
    out = preflight_failure(lab, {"cluster_accelerator": "cpu"})
    assert "fedora40 runs Fedora 40 (fedora-40), which these roles do not support" in out
    assert "Supported: ubuntu-22.04, ubuntu-24.04, debian-12" in out


def test_unknown_cuda_version_fails_before_any_change(debian_lab: Lab):
    out = preflight_failure(debian_lab, {"cuda_version": "11.1"})
    assert "cuda_version '11.1' has no entry in torch_matrix" in out
    assert "known: 13.0, 12.8, 12.6, cpu" in out


def test_node_without_gpu_fails_in_a_gpu_cluster(debian_lab: Lab):
    out = preflight_failure(debian_lab, {"cluster_accelerator": "nvidia"})
    assert "debian12 has no NVIDIA GPU on its PCI bus" in out
    assert "set cluster_accelerator: cpu" in out


def test_wheelhouse_lacking_a_pinned_package_fails_before_any_change(debian_lab: Lab):
    wheelhouse = debian_lab.root / "cache" / "wheelhouse" / "cp311-pypi"
    wheelhouse.mkdir(parents=True)
    for name in (
        "torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torchaudio-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl",
        "llamafactory-0.9.5-py3-none-any.whl",
    ):
        (wheelhouse / name).touch()
    out = preflight_failure(
        debian_lab, {"cluster_accelerator": "cpu", "wheelhouse_download": False}
    )
    assert f"The wheelhouse {wheelhouse} lacks" in out
    assert "torchvision==0.26.0" in out
    assert "deepspeed==0.19.8" in out
    assert "transformers==5.6.0" in out
    assert "torch==2.11.0," not in out
    assert "Run once with wheelhouse_download: true" in out


def test_conda_backend_without_installer_checksum_fails_before_any_change(debian_lab: Lab):
    out = preflight_failure(
        debian_lab, {"cluster_accelerator": "cpu", "python_env_backend": "conda"}
    )
    assert "python_env_conda_installer_sha256 is not a sha256" in out


def test_unreachable_conda_installer_fails_naming_the_location(debian_lab: Lab):
    playbook = debian_lab.root / "conda.yml"
    base = debian_lab.root / "base"
    base.mkdir()
    url = "https://127.0.0.1:9/miniforge/Miniforge3-25.3.1-0-Linux-x86_64.sh"
    playbook.write_text(
        json.dumps(
            [
                {
                    "name": "Install Miniforge from an unreachable mirror",
                    "hosts": "cluster",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "ansible.builtin.include_role": {
                                "name": "python_env",
                                "tasks_from": "conda.yml",
                            }
                        }
                    ],
                }
            ]
        )
    )
    proc = debian_lab.run(
        playbook,
        "-e",
        json.dumps(
            {
                "cluster_base_dir": str(base),
                "python_env_conda_installer_url": url,
                "python_env_conda_installer_sha256": "0" * 64,
            }
        ),
    )
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert f"Could not download the Miniforge installer from {url}" in out
    assert not (base / "conda").exists()


def test_gpu_probe_finds_nvidia_gpus_on_the_pci_bus_without_a_driver(tmp_path: Path):
    def device(addr: str, vendor: str, pci_class: str, dev: str) -> None:
        d = tmp_path / addr
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(pci_class + "\n")
        (d / "device").write_text(dev + "\n")

    device("0000:17:00.0", "0x10de", "0x030200", "0x2335")  # H200: 3D controller
    device("0000:18:00.0", "0x10de", "0x068000", "0x22a3")  # NVSwitch: a bridge, not a GPU
    device("0000:00:02.0", "0x8086", "0x030000", "0x46a6")  # Intel VGA
    probe = PROJECT / "roles/host_facts/files/gpu_probe.py"
    env = {**os.environ, "PATH": str(tmp_path)}  # no nvidia-smi
    proc = subprocess.run(
        [sys.executable, str(probe), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result = json.loads(proc.stdout)
    assert result["gpu_count"] == 1
    assert result["gpus"][0]["pci_bus_id"] == "0000:17:00.0"
    assert result["driver_loaded"] is False
    assert result["driver_version"] is None


def test_a_python_312_cluster_wants_the_cp312_wheel_set(mixed_lab: Lab):
    wheelhouse = mixed_lab.root / "cache" / "wheelhouse" / "cp312-pypi"
    proc = preflight(mixed_lab, "--limit", "ubuntu2404", "-e", '{"wheelhouse_download": false}')
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert f"The wheelhouse {wheelhouse} lacks" in out
    assert "numpy==2.5.5" in out  # the 3.12 lock's numpy (3.11's is 2.4.6)
    assert "for CPython 3.12, manylinux x86_64" in out


def test_gpu_probe_reports_the_lower_of_the_machines_ram_and_its_cgroup_limit(tmp_path: Path):
    spec = importlib.util.spec_from_file_location(
        "gpu_probe", PROJECT / "roles/host_facts/files/gpu_probe.py"
    )
    assert spec is not None
    assert spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:        1000 kB\n")
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    assert probe.host_memory_mib(meminfo, (v2, v1)) == 128_000  # no cgroup limit files
    v2.write_text("max\n")  # cgroup v2 without a limit
    assert probe.host_memory_mib(meminfo, (v2, v1)) == 128_000
    v1.write_text(f"{16 * 2**30}\n")  # a container limited to 16 GiB
    assert probe.host_memory_mib(meminfo, (v2, v1)) == 16 * 1024
    assert probe.host_memory_mib(tmp_path / "absent", (tmp_path / "none",)) is None
