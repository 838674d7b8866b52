"""What the tests of a node's usage share: nvidia-smi's answers recorded on real machines
(tests/data/nvidia-smi), a /proc of their processes, and the read the module makes of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible_collections.llama.cluster.plugins.modules import llama_node_usage as usage

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "data" / "nvidia-smi"
MODULE = ROOT / "collections/ansible_collections/llama/cluster/plugins/modules/llama_node_usage.py"
H100 = "NVIDIA H100 80GB HBM3"
NOBODY = 65534  # another user, on every Debian and Ubuntu machine
HOG = {"pid": 48213, "argv": ["python3", "finetune.py", "--config", "big.yaml"]}


def _recorded(case: str, kind: str) -> str:
    return (SMI / f"{case}.{kind}.csv").read_text()


def fake_proc(tmp_path: Path) -> Path:
    """A /proc with one recorded entry: another user's (nobody's) python3, pid 48213 (the tests'
    fixture `proc`, tests/conftest.py)."""
    entry = tmp_path / "proc" / str(HOG["pid"])
    entry.mkdir(parents=True)
    entry.joinpath("status").write_text(
        f"Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nPid:\t{HOG['pid']}\n"
        f"Uid:\t{NOBODY}\t{NOBODY}\t{NOBODY}\t{NOBODY}\nGid:\t{NOBODY}\t{NOBODY}\t{NOBODY}\n"
    )
    entry.joinpath("cmdline").write_text("\0".join(HOG["argv"]) + "\0")
    entry.joinpath("comm").write_text("python3\n")
    return tmp_path / "proc"


def read(case: str, proc: Path) -> dict[str, Any]:
    """What llama_node_usage returns on a node whose nvidia-smi answers as recorded in `case`,
    with 96 GiB of host memory available."""
    gpus = usage.parse_gpus(_recorded(case, "gpus"))
    elsewhere = usage.attach_processes(gpus, usage.parse_apps(_recorded(case, "apps")), proc)
    return {
        "changed": False,
        "gpus": gpus,
        "unattributed_processes": elsewhere,
        "nvidia_smi_found": True,
        "nvidia_smi_error": "",
        "host_memory": {"available_mib": 96 * 1024, "source": "MemAvailable (/proc/meminfo)"},
    }


# ---- nvidia-smi's answers, parsed ----------------------------------------------------------------
