"""Print the node's NVIDIA GPUs as JSON: from the PCI bus, and from nvidia-smi once a driver runs;
and the node's RAM (the planner's host memory budget).

Read-only. Usage: gpu_probe.py PCI_DEVICES_DIR
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers; NVSwitches are bridges (0x0680)


def pci_gpus(devices_dir: Path) -> list[dict]:
    """NVIDIA display/3D controllers on the PCI bus; they exist before any driver does."""
    gpus = []
    for dev in sorted(devices_dir.glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip()
            pci_class = (dev / "class").read_text().strip()
            device = (dev / "device").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and pci_class.startswith(GPU_CLASSES):
            gpus.append(
                {
                    "index": len(gpus),
                    "name": f"NVIDIA PCI device {device}",
                    "memory_mib": None,
                    "pci_bus_id": dev.name.lower(),
                }
            )
    return gpus


def smi(*args: str) -> str | None:
    """nvidia-smi's output, or None when it is missing or the driver is not loaded."""
    if shutil.which("nvidia-smi") is None:
        return None
    proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else None


# The memory limit of the cgroup the node's processes run in (v2, then v1): a container or a
# rented slice of a machine has less than /proc/meminfo says.
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def host_memory_mib(
    meminfo: Path = Path("/proc/meminfo"), limits: tuple[Path, ...] = CGROUP_LIMITS
) -> int | None:
    """The memory the node's processes may use, in MiB: MemTotal, or the cgroup's limit where it
    is lower (None where neither can be read)."""
    sizes = []
    try:
        match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
        if match:
            sizes.append(int(match.group(1)) * 1024)
    except OSError:
        pass
    for limit in limits:
        try:
            value = limit.read_text().strip()
        except OSError:
            continue
        if value.isdigit():
            sizes.append(int(value))
            break
    return min(sizes) // 2**20 if sizes else None


def main() -> None:
    """Print the probe's JSON."""
    gpus = pci_gpus(Path(sys.argv[1]))
    driver = cuda = None
    rows = smi(
        "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
        "--format=csv,noheader,nounits",
    )
    if rows:
        smi_gpus = []
        for line in rows.strip().splitlines():
            index, name, memory, driver, bus_id = (f.strip() for f in line.split(","))
            smi_gpus.append(
                {
                    "index": int(index),
                    "name": name,
                    "memory_mib": int(memory),
                    "pci_bus_id": bus_id.lower().removeprefix("0000"),
                }
            )
        gpus = smi_gpus
        match = re.search(r"CUDA Version:\s*([0-9.]+)", smi() or "")
        cuda = match.group(1) if match else None
    result = {
        "gpus": gpus,
        "gpu_count": len(gpus),
        "driver_loaded": rows is not None,
        "driver_version": driver,
        "cuda_version": cuda,
        "host_memory_mib": host_memory_mib(),
    }
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
