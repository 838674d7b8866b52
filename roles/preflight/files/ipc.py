#!/usr/bin/env python3
"""What a node gives processes that share it: /dev/shm (its filesystem, size and free space:
NCCL's shared-memory transport between a node's GPUs and the DataLoader's workers put their
buffers there) and the locked-memory limit (NCCL pins host memory; over InfiniBand/RoCE it must
be unlimited). Read-only, standard library. Prints one JSON line; plugins/filter/preflight.py's
preflight_ranks decides from it.
"""

from __future__ import annotations

import json
import os
import resource
import sys

SHM = "/dev/shm"
MIB = 1 << 20


def mount_type(path: str) -> str | None:
    """The filesystem type mounted at `path` (None where nothing is mounted there)."""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) > 2 and fields[1] == path:
                    return fields[2]
    except OSError:
        return None
    return None


def shared_memory() -> dict:
    """/dev/shm's type, size and free space in MiB (exists false where there is none)."""
    if not os.path.isdir(SHM):
        return {"path": SHM, "exists": False}
    stat = os.statvfs(SHM)
    return {
        "path": SHM,
        "exists": True,
        "fstype": mount_type(SHM),
        "size_mib": stat.f_blocks * stat.f_frsize // MIB,
        "free_mib": stat.f_bavail * stat.f_frsize // MIB,
        "writable": os.access(SHM, os.W_OK),
    }


def limit(value: int) -> str | int:
    return "unlimited" if value == resource.RLIM_INFINITY else value


def main() -> int:
    """Print what was read."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    found = {"shm": shared_memory(), "memlock": {"soft": limit(soft), "hard": limit(hard)}}
    sys.stdout.write(json.dumps(found) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
