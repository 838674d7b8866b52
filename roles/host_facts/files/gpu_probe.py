"""Print the node's NVIDIA GPUs as JSON: from the PCI bus, and from nvidia-smi once a driver runs;
with them what roles/nvidia_driver decides on (the driver module on disk, nouveau, Secure Boot)
and the node's RAM (the planner's host memory budget).

Read-only. Usage: gpu_probe.py PCI_DEVICES_DIR [SYSFS_DIR (default /sys)]
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers; NVSwitches are bridges (0x0680)
# The UEFI global variable SecureBoot: 4 bytes of attributes, then 1 (enabled) or 0.
SECURE_BOOT_VAR = "firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"


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


def installed_module() -> str | None:
    """The version of the nvidia kernel module on disk for the running kernel (what modprobe or the
    next boot loads), or None without one. modinfo lives in /sbin, off a user's PATH on Debian."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    modinfo = shutil.which("modinfo", path=path)
    if modinfo is None:
        return None
    proc = subprocess.run(
        [modinfo, "-F", "version", "nvidia"], capture_output=True, text=True, check=False
    )
    version = proc.stdout.strip()
    return version if proc.returncode == 0 and version else None


def secure_boot(sysfs: Path) -> bool | None:
    """Whether UEFI Secure Boot is on: False on a BIOS boot or without the variable, None when the
    variable cannot be read."""
    if not (sysfs / "firmware/efi").is_dir():
        return False
    try:
        data = (sysfs / SECURE_BOOT_VAR).read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return len(data) >= 5 and data[4] == 1


def main() -> None:
    """Print the probe's JSON."""
    gpus = pci_gpus(Path(sys.argv[1]))
    sysfs = Path(sys.argv[2] if len(sys.argv) > 2 else "/sys")
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
        # A separate query: an nvidia-smi too old for compute_cap fails it and nothing else.
        caps = smi("--query-gpu=index,compute_cap", "--format=csv,noheader,nounits") or ""
        for line in caps.strip().splitlines():
            index, _, cap = (f.strip() for f in line.partition(","))
            for gpu in gpus:
                if str(gpu["index"]) == index and re.fullmatch(r"\d+\.\d+", cap):
                    gpu["compute_capability"] = cap
        match = re.search(r"CUDA Version:\s*([0-9.]+)", smi() or "")
        cuda = match.group(1) if match else None
    result = {
        "gpus": gpus,
        "gpu_count": len(gpus),
        "driver_loaded": rows is not None,
        "driver_version": driver,
        "cuda_version": cuda,
        "host_memory_mib": host_memory_mib(),
        "driver_installed": installed_module(),
        "nouveau_loaded": (sysfs / "module/nouveau").is_dir(),
        "secure_boot": secure_boot(sysfs),
    }
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
