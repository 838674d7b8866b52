"""A provisioned lab node runs the pinned stack from cluster_env_dir (testinfra, via molecule)."""

from __future__ import annotations

import json
import re

import pytest
from testinfra.host import Host

ENV = "/opt/llama-cluster/env"
BIN = f"{ENV}/bin"


def run(host: Host, command: str) -> str:
    result = host.run(command)
    assert result.rc == 0, f"{command}: {result.stdout}{result.stderr}"
    return result.stdout


def test_pinned_torch_trio_imports(host: Host) -> None:
    out = run(
        host,
        f"{BIN}/python -c 'import torch, torchvision, torchaudio;"
        " print(torch.__version__, torchvision.__version__, torchaudio.__version__)'",
    )
    # PyPI's 2.11.0 trio is the CUDA 13.0 build: every version carries the same local tag.
    versions = [v.split("+") for v in out.split()]
    assert [v[0] for v in versions] == ["2.11.0", "0.26.0", "2.11.0"]
    assert {v[1] for v in versions} == {"cu130"}


def test_llamafactory_cli_reports_the_pinned_version(host: Host) -> None:
    out = run(host, f"{BIN}/llamafactory-cli version")
    assert "0.9.5" in out


def test_torchrun_resolves_from_the_env_bin_for_the_training_user(host: Host) -> None:
    out = run(host, f"runuser -u llama -- env PATH={BIN}:/usr/bin:/bin sh -c 'command -v torchrun'")
    assert out.strip() == f"{BIN}/torchrun"
    run(host, f"runuser -u llama -- {BIN}/torchrun --help")


def test_deepspeed_imports_at_the_pinned_version(host: Host) -> None:
    out = run(host, f"{BIN}/python -c 'import deepspeed; print(deepspeed.__version__)'")
    assert out.strip().splitlines()[-1] == "0.19.8"


def test_no_host_wide_port_range_is_pinned_by_default(host: Host) -> None:
    # The firewall lets the nodes reach each other on every port instead (roles/firewall).
    live = host.file("/proc/sys/net/ipv4/ip_local_port_range").content_string.split()
    assert live != ["40000", "40999"]
    assert not host.file("/etc/sysctl.d/60-llama-cluster-nccl.conf").exists


def test_llama_stack_fact_records_the_stack(host: Host) -> None:
    fact = json.loads(host.file("/etc/ansible/facts.d/llama_stack.fact").content_string)
    assert fact["torch"] == "2.11.0"
    assert fact["llamafactory"] == "0.9.5"
    assert fact["deepspeed"] == "0.19.8"
    assert fact["transformers"] == "5.6.0"
    assert fact["python"].startswith("3.11.")
    assert fact["torch_cuda"] == "13.0"  # PyPI's build, running on the lab's CPU
    assert "llamafactory_env" in fact
    for key in ("torchaudio", "torchvision", "accelerate", "peft", "nccl"):
        assert key in fact


def test_llama_host_fact_describes_a_cpu_debian_node(host: Host) -> None:
    fact = json.loads(host.file("/etc/ansible/facts.d/llama_host.fact").content_string)
    assert fact["os"]["key"] == "debian-12"
    assert fact["gpu_count"] == 0
    assert fact["gpus"] == []
    assert fact["driver_version"] is None


def test_no_package_floats_outside_the_pins(host: Host) -> None:
    lock = {
        line.split("==")[0]
        for line in host.file(f"{ENV}/constraints.txt").content_string.splitlines()
        if line and not line.startswith("#")
    }
    top = {"pip"}  # the lock pins the top-level packages too
    for line in run(host, f"{BIN}/pip freeze --all").splitlines():
        name = re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
        if name in top or name.startswith(("nvidia-", "cuda-")) or name == "triton":
            continue
        assert name in lock, f"{line} is not pinned by the lock"


@pytest.mark.parametrize(
    ("path", "owner", "mode"),
    [
        ("/opt/llama-cluster", "root", 0o755),
        ("/opt/llama-cluster/wheelhouse", "root", 0o755),
        ("/opt/llama-cluster/runs", "llama", 0o775),
        ("/opt/llama-cluster/models", "llama", 0o775),
    ],
)
def test_cluster_directories_have_sane_ownership(
    host: Host, path: str, owner: str, mode: int
) -> None:
    d = host.file(path)
    assert d.is_directory
    assert d.user == owner
    assert d.group == "llama"
    assert d.mode == mode


def test_the_environment_was_filled_by_uv_and_its_dependencies_agree(host: Host) -> None:
    # python_env_installer: uv (the default) installs uv from the wheelhouse, then everything else.
    assert run(host, f"{BIN}/uv --version").split()[:2] == ["uv", "0.13.9"]
    check = host.run(f"{BIN}/uv pip check --python {BIN}/python")
    assert check.rc == 0, check.stdout + check.stderr
    assert "All installed packages are compatible" in check.stdout + check.stderr


def test_node_got_the_controllers_deepspeed_wheel(host: Host) -> None:
    assert host.file("/opt/llama-cluster/wheelhouse/deepspeed-0.19.8-py3-none-any.whl").is_file
