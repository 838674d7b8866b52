#!/usr/bin/python
"""Ansible module: what a node's GPUs and memory hold now (nvidia-smi, /proc, the cgroup)."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_node_usage
short_description: Report the GPU memory, GPU processes and host memory in use on a node now
description:
  - Read-only; never changes anything (C(changed) is always false) and runs in check mode.
    train.yml runs it on every node just before the plan, so that the run is planned for the
    memory that is free at train time rather than the fact cache's figures (up to 2 hours old).
  - Each GPU (index, UUID, name, total and used memory in MiB) from
    C(nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used
    --format=csv,noheader,nounits).
  - The compute processes on each GPU from
    C(nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name
    --format=csv,noheader,nounits), each with its user (the Uid line of /proc/PID/status) and
    command line (/proc/PID/cmdline). A process of another container or PID namespace is
    listed by nvidia-smi with a PID this node's /proc does not have, or has for another
    program; such a process is returned with C(visible) false and the reason.
  - The host memory available now, in MiB - the smaller of MemAvailable (/proc/meminfo) and,
    where a cgroup memory limit applies to the module's own cgroup or a parent of it
    (/proc/self/cgroup; v2 C(memory.max), v1 C(memory.limit_in_bytes) under /sys/fs/cgroup), the
    tightest such limit less its cgroup's usage (less its inactive page cache, which the kernel
    reclaims).
  - A node without nvidia-smi (a CPU node) returns an empty C(gpus) list; an nvidia-smi that
    fails (no driver loaded, "No devices were found") returns C(gpus) as far as it was read and
    the error in C(nvidia_smi_error). Neither fails the task.
options:
  nvidia_smi:
    description: The nvidia-smi to run, a name looked up on PATH or a path.
    type: str
    default: nvidia-smi
  timeout:
    description: Seconds each nvidia-smi query may take.
    type: int
    default: 30
author: llama-cluster
"""

EXAMPLES = r"""
- name: Read what the GPUs and memory of every node hold now
  llama.cluster.llama_node_usage:
  delegate_to: "{{ item }}"
  become: true  # /proc of other users' processes, where /proc is mounted with hidepid
  loop: "{{ groups['cluster'] }}"
  register: usage

- name: Show the processes on GPU 1 of the first node
  ansible.builtin.debug:
    msg: "{{ usage.results[0].gpus[1].processes }}"
"""

RETURN = r"""
gpus:
  description:
    - One entry per GPU, in nvidia-smi's order. index (int), uuid, name, memory_total_mib and
      memory_used_mib (int, or null where nvidia-smi reports [N/A], e.g. MIG), and processes.
    - Each process has pid (int), used_memory_mib (int or null), process_name (nvidia-smi's;
      empty where it reports none), visible (the PID is this node's process that nvidia-smi
      named), and where visible uid (int), user and command (the command line, at most 400
      characters); where not visible, why.
  type: list
  elements: dict
  returned: always
  sample:
    - index: 1
      uuid: GPU-6e1c2c4f-0a7d-4d1e-9b43-7c1f2f0a9b11
      name: NVIDIA H200
      memory_total_mib: 143771
      memory_used_mib: 53801
      processes:
        - pid: 41822
          used_memory_mib: 53792
          process_name: python3
          visible: true
          uid: 1001
          user: alice
          command: python3 finetune.py --config big.yaml
unattributed_processes:
  description:
    - Compute processes whose gpu_uuid names no GPU of C(gpus) (a MIG device's UUID), in the
      same shape, with gpu_uuid.
  type: list
  elements: dict
  returned: always
nvidia_smi_found:
  description: Whether nvidia-smi is on this node (false on a CPU node).
  type: bool
  returned: always
nvidia_smi_error:
  description: What nvidia-smi said when a query failed; empty when both queries answered.
  type: str
  returned: always
host_memory:
  description:
    - available_mib, the memory the node's processes can have now (the smaller of the two
      figures below; null where neither can be read), and source (which of them it is);
      meminfo_available_mib (MemAvailable); cgroup_limit_mib and cgroup_available_mib (null
      where no limit applies).
  type: dict
  returned: always
  sample:
    available_mib: 118530
    source: MemAvailable (/proc/meminfo)
    meminfo_available_mib: 118530
    cgroup_limit_mib: null
    cgroup_available_mib: null
"""

QUERY_GPUS = "index,uuid,name,memory.total,memory.used"
QUERY_APPS = "pid,gpu_uuid,used_memory,process_name"
# The longest command line returned (a long one is cut, with "...").
COMMAND_CHARS = 400
# A cgroup v1 limit at or above this is "no limit" (the kernel writes PAGE_COUNTER_MAX pages).
NO_LIMIT = 1 << 60
CGROUP = Path("/sys/fs/cgroup")
MIB = 1 << 20


def number(field: str) -> int | None:
    """A figure of nvidia-smi's CSV (nounits) as an int; None for [N/A], [Not Supported] and
    the like, or for anything that is not a number."""
    try:
        return round(float(field))
    except ValueError:
        return None


def _rows(text: str, count: int) -> Iterator[list[str]]:
    """nvidia-smi's CSV rows (it quotes nothing), each split into count fields, the last keeping
    any comma (a process name); lines of another shape (a message) are left out."""
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",", count - 1)]
        if len(fields) == count and number(fields[0]) is not None:
            yield fields


def _named(field: str) -> str:
    """nvidia-smi's placeholders ([N/A], [Not Found], [Insufficient Permissions]) as empty."""
    return "" if re.fullmatch(r"\[.*\]|N/A", field) else field


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """The rows of QUERY_GPUS: index, uuid, name, memory_total_mib, memory_used_mib."""
    return [
        {
            "index": number(index),
            "uuid": _named(uuid),
            "name": _named(name),
            "memory_total_mib": number(total),
            "memory_used_mib": number(used),
            "processes": [],
        }
        for index, uuid, name, total, used in _rows(text, 5)
    ]


def parse_apps(text: str) -> list[dict[str, Any]]:
    """The rows of QUERY_APPS: pid, gpu_uuid, used_memory_mib, process_name."""
    return [
        {
            "pid": number(pid),
            "gpu_uuid": _named(uuid),
            "used_memory_mib": number(used),
            "process_name": _named(name),
        }
        for pid, uuid, used, name in _rows(text, 4)
    ]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid} (no name on this node)"


def _same_program(smi_name: str, argv0: str, comm: str) -> bool:
    """Whether nvidia-smi's name and this node's process name one program (python and
    python3.11 do; the kernel's comm is cut at 15 characters)."""
    wanted = os.path.basename(smi_name)
    names = [n for n in (os.path.basename(argv0), comm) if n]
    return not names or any(wanted.startswith(n[:15]) or n.startswith(wanted[:15]) for n in names)


def describe_process(app: dict[str, Any], proc: Path = Path("/proc")) -> dict[str, Any]:
    """nvidia-smi's process with its uid, user and command line from this node's /proc; or,
    where this node does not see it, visible false and why."""
    found = {k: app[k] for k in ("pid", "used_memory_mib", "process_name")}
    where = proc / str(app["pid"])
    status = _read(where / "status")
    uid = re.search(r"^Uid:\s+(\d+)", status or "", re.MULTILINE)
    if status is None or uid is None:
        why = (
            f"no process {app['pid']} in this node's /proc: it runs in another container or PID "
            "namespace (nvidia-smi sees the GPU's processes of the whole machine)"
        )
        return {**found, "visible": False, "why": why}
    argv = (_read(where / "cmdline") or "").split("\0")
    comm = (_read(where / "comm") or "").strip()
    if app["process_name"] and not _same_program(app["process_name"], argv[0], comm):
        why = (
            f"process {app['pid']} of this node is {argv[0] or comm}, not nvidia-smi's "
            f"{app['process_name']}: the GPU's process runs in another container or PID namespace"
        )
        return {**found, "visible": False, "why": why}
    command = " ".join(a for a in argv if a) or f"[{comm}]"
    if len(command) > COMMAND_CHARS:
        command = command[: COMMAND_CHARS - 3] + "..."
    user_id = int(uid.group(1))
    return {**found, "visible": True, "uid": user_id, "user": _user(user_id), "command": command}


def attach_processes(
    gpus: list[dict[str, Any]], apps: list[dict[str, Any]], proc: Path = Path("/proc")
) -> list[dict[str, Any]]:
    """Each process put on its GPU (by UUID), described from /proc; returns those whose UUID
    names no GPU (a MIG device's), with their gpu_uuid."""
    by_uuid = {gpu["uuid"]: gpu for gpu in gpus if gpu["uuid"]}
    elsewhere = []
    for app in apps:
        described = describe_process(app, proc)
        if app["gpu_uuid"] in by_uuid:
            by_uuid[app["gpu_uuid"]]["processes"].append(described)
        else:
            elsewhere.append({**described, "gpu_uuid": app["gpu_uuid"]})
    return elsewhere


def _meminfo_available(text: str | None) -> int | None:
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text or "", re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _stat(text: str | None, key: str) -> int:
    match = re.search(rf"^{key} (\d+)$", text or "", re.MULTILINE)
    return int(match.group(1)) if match else 0


def _int(text: str | None) -> int | None:
    value = (text or "").strip()
    return int(value) if value.isdigit() else None


def _cgroup_dirs(root: Path, membership: str | None) -> list[tuple[Path, str]]:
    """The memory cgroups this process is in, its own first, then each parent up to the root:
    (directory, version) pairs. /proc/self/cgroup names them (v2 `0::/path`, v1
    `N:...memory...:/path`); a container with its own cgroup namespace sees its cgroup as `/`,
    one that shares the host's (systemd in a container) sees its whole path."""
    found: list[tuple[Path, str]] = []
    for line in (membership or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, version = root, "v2"
        elif "memory" in controllers.split(","):
            base, version = root / "memory", "v1"
        else:
            continue
        rel = Path(path.strip() or "/").relative_to("/")
        while True:
            found.append((base / rel, version))
            if rel == Path("."):
                break
            rel = rel.parent
    return found or [(root, "v2"), (root / "memory", "v1")]


def cgroup_memory(
    root: Path = CGROUP, membership: Path = Path("/proc/self/cgroup")
) -> tuple[int | None, int | None]:
    """The tightest memory limit of this process's cgroups and what of it is free, in bytes:
    v2 (memory.max, memory.current), v1 (memory.limit_in_bytes, memory.usage_in_bytes); the usage
    less the inactive page cache, which the kernel reclaims before it refuses memory. (None,
    None) where no limit applies."""
    names = {
        "v2": ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat",
               "total_inactive_file"),
    }  # fmt: skip
    tightest: tuple[int | None, int | None] = (None, None)
    for directory, version in _cgroup_dirs(root, _read(membership)):
        limit_name, usage_name, stat_name, inactive = names[version]
        limit = _int(_read(directory / limit_name))
        if limit is None or limit >= NO_LIMIT:
            continue
        usage = _int(_read(directory / usage_name))
        used = max(0, (usage or 0) - _stat(_read(directory / stat_name), inactive))
        free = max(0, limit - used)
        if tightest[1] is None or free < tightest[1]:
            tightest = (limit, free)
    return tightest


def host_memory(
    meminfo: Path = Path("/proc/meminfo"),
    cgroup: Path = CGROUP,
    membership: Path = Path("/proc/self/cgroup"),
) -> dict[str, Any]:
    """The memory the node's processes can have now (MiB) and which figure that is."""
    available = _meminfo_available(_read(meminfo))
    limit, free = cgroup_memory(cgroup, membership)

    def mib(value: int | None) -> int | None:
        return None if value is None else value // MIB

    result: dict[str, Any] = {
        "available_mib": None,
        "source": "unknown (neither /proc/meminfo's MemAvailable nor a cgroup limit was read)",
        "meminfo_available_mib": mib(available),
        "cgroup_limit_mib": mib(limit),
        "cgroup_available_mib": mib(free),
    }
    if free is not None and (available is None or free < available):
        result.update(available_mib=mib(free), source="the cgroup's limit less its usage")
    elif available is not None:
        result.update(available_mib=mib(available), source="MemAvailable (/proc/meminfo)")
    return result


def _query(program: str, query: str, timeout: int) -> tuple[str, str]:
    """One nvidia-smi query's output, and what went wrong ("" when it answered)."""
    try:
        done = subprocess.run(
            [program, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "", f"{query}: no answer within {timeout} s"
    except OSError as err:
        return "", f"{query}: {err.strerror or err}"
    if done.returncode != 0:
        said = " ".join((done.stdout + " " + done.stderr).split())
        return "", f"{query}: exit status {done.returncode}" + (f": {said}" if said else "")
    return done.stdout, ""


def gpu_usage(nvidia_smi: str, timeout: int, proc: Path = Path("/proc")) -> dict[str, Any]:
    """The GPUs and their processes as nvidia-smi reports them now; gpus [] without it."""
    program = shutil.which(nvidia_smi)
    found: dict[str, Any] = {
        "gpus": [],
        "unattributed_processes": [],
        "nvidia_smi_found": program is not None,
        "nvidia_smi_error": "",
    }
    if program is None:
        return found
    text, found["nvidia_smi_error"] = _query(program, f"--query-gpu={QUERY_GPUS}", timeout)
    found["gpus"] = parse_gpus(text)
    if found["nvidia_smi_error"]:
        return found
    text, found["nvidia_smi_error"] = _query(program, f"--query-compute-apps={QUERY_APPS}", timeout)
    found["unattributed_processes"] = attach_processes(found["gpus"], parse_apps(text), proc)
    return found


def main() -> None:
    """Run the module."""
    module = AnsibleModule(
        argument_spec={
            "nvidia_smi": {"type": "str", "default": "nvidia-smi"},
            "timeout": {"type": "int", "default": 30},
        },
        supports_check_mode=True,
    )
    found = gpu_usage(module.params["nvidia_smi"], module.params["timeout"])
    module.exit_json(changed=False, host_memory=host_memory(), **found)


if __name__ == "__main__":
    main()
