"""Filters for the preflight: compare what every node reports and say which node is odd."""

from __future__ import annotations

from collections import Counter
from typing import Any

MISSING = "-"


def _text(value: Any) -> str:  # noqa: ANN401 - facts are arbitrary JSON
    """One cell of the table: lists of GPUs become their distinct model names, the OS its key."""
    if value is None or value == "":
        return MISSING
    if isinstance(value, dict):
        for field in ("name", "key", "model", "version"):
            if field in value:
                return _text(value[field])
        return ",".join(f"{k}={_text(v)}" for k, v in sorted(value.items()))
    if isinstance(value, list | tuple):
        names = sorted({_text(item) for item in value})
        return "+".join(names) if names else MISSING
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).strip()


def _value(facts: dict[str, Any], key: dict[str, Any]) -> str:
    """One cell: the fact's key, or with `field` that field of each item of a list (the memory
    of every GPU)."""
    value = (facts.get(key["fact"]) or {}).get(key["key"])
    field = key.get("field")
    if field and isinstance(value, list):
        value = [item.get(field) if isinstance(item, dict) else item for item in value]
    return _text(value)


def preflight_consistency(
    local_facts: dict[str, dict[str, Any]],
    keys: list[dict[str, Any]],
    reference: str,
    allow_hardware: bool = False,
) -> dict[str, Any]:
    """Compare the local facts of every node.

    local_facts maps a host to its ansible_local; keys lists {name, fact, key, field?,
    hardware?}; reference is the host whose value wins a tie (the master). Returns missing
    (host: facts it lacks), rows, a printable table and one message per odd value: in
    mismatches (refused), or in reported for a hardware key (GPU model, memory, count, driver)
    when allow_hardware is set.
    """
    facts_needed = sorted({key["fact"] for key in keys})
    missing = {
        host: [fact for fact in facts_needed if not isinstance(facts.get(fact), dict)]
        for host, facts in local_facts.items()
    }
    missing = {host: facts for host, facts in missing.items() if facts}

    hosts = list(local_facts)
    rows = {host: {key["name"]: _value(local_facts[host], key) for key in keys} for host in hosts}

    mismatches: list[str] = []
    reported: list[str] = []
    for key in keys:
        name = key["name"]
        values = {host: rows[host][name] for host in hosts}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        leaders = [value for value, count in counts.items() if count == top]
        usual = values.get(reference) if values.get(reference) in leaders else leaders[0]
        agreeing = sorted(host for host, value in values.items() if value == usual)
        odd = reported if allow_hardware and key.get("hardware") else mismatches
        for host in hosts:
            if values[host] != usual:
                odd.append(
                    f"{host}: {name} is {values[host]}, but {usual} on {', '.join(agreeing)}"
                )

    return {
        "missing": missing,
        "rows": rows,
        "table": _table(hosts, [key["name"] for key in keys], rows),
        "mismatches": mismatches,
        "reported": reported,
    }


def _table(hosts: list[str], names: list[str], rows: dict[str, dict[str, str]]) -> list[str]:
    """Lines of a fixed-width table: one row per node, one column per checked value."""
    header = ["node", *names]
    body = [[host, *(rows[host][name] for name in names)] for host in hosts]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in [header, *body]
    ]


def preflight_gpu_ids(gpu_ids: dict[str, Any], local_facts: dict[str, dict[str, Any]]) -> list[str]:
    """One message per node whose inventory gpu_ids name GPUs it does not have.

    gpu_ids maps a host to its gpu_ids (None or "": every GPU it has); local_facts maps a host
    to its ansible_local, whose llama_host.gpus lists the GPUs with their index.
    """
    problems = []
    for host, wanted in gpu_ids.items():
        if wanted is None or wanted == "":
            continue
        gpus = ((local_facts.get(host) or {}).get("llama_host") or {}).get("gpus") or []
        have = sorted(
            {int(gpu["index"]) for gpu in gpus if isinstance(gpu, dict) and "index" in gpu}
        )
        asked = wanted if isinstance(wanted, list | tuple) else [wanted]
        absent = [gpu for gpu in asked if _index(gpu) not in have]
        if absent:
            has = f"it has {', '.join(map(str, have))}" if have else "it has no GPUs"
            problems.append(
                f"{host}: gpu_ids {list(asked)} name {', '.join(map(str, absent))}, which "
                f"{host} does not have ({has}, in ansible_local.llama_host.gpus)"
            )
    return problems


def _index(value: Any) -> int | None:  # noqa: ANN401 - an inventory value
    """A GPU index as an int, or None when the value is not one."""
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# The locked memory NCCL needs over InfiniBand/RoCE: unlimited (LimitMEMLOCK=infinity); below
# this many MiB the report says so (a warning: TCP and NVLink do not pin through it).
MEMLOCK_WARN_MIB = 64


def _mib(value: Any) -> int | None:  # noqa: ANN401 - a probe's figure
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _p2p_line(accelerator: str, p2p: Any) -> str:  # noqa: ANN401 - the llama_links fact's p2p
    """What the node's jobs do about P2P between its GPUs (check.yml's probe decided it)."""
    if accelerator == "cpu":
        return "P2P: none (a CPU node: its ranks exchange over its loopback)"
    if not isinstance(p2p, dict) or "nccl_p2p_disable" not in p2p:
        return (
            "P2P: not probed (run playbooks/check.yml: it probes every pair of the node's GPUs "
            "and sets NCCL_P2P_DISABLE=1 for a node where P2P is absent or broken)"
        )
    if p2p["nccl_p2p_disable"]:
        return f"P2P: off, NCCL_P2P_DISABLE=1 for its jobs ({p2p.get('reason') or 'probed'})"
    return "P2P: on between its GPUs (probed by playbooks/check.yml)"


def preflight_ranks(
    probe: dict[str, Any],
    host: str,
    nproc: int,
    *,
    accelerator: str = "nvidia",
    p2p: dict[str, Any] | None = None,
    min_mib: int | None = None,
) -> dict[str, Any]:
    """Whether a node can run `nproc` training processes side by side, from files/ipc.py's probe:
    /dev/shm, where NCCL's shared-memory transport between a node's GPUs keeps its buffers
    (Docker's default of 64 MB is the classic failure: "unhandled system error" as NCCL creates
    a segment), the locked-memory limit, and the P2P decision of check.yml's probe.

    min_mib: the least /dev/shm a node of several processes needs (None: 1024 MiB on GPU nodes,
    what Docker's documentation suggests for NCCL, and nothing on CPU nodes, whose ranks talk
    over gloo's TCP). Returns ok, the refusal naming the fix (problem) and the report's line."""
    need = (1024 if accelerator != "cpu" else 0) if min_mib is None else int(min_mib)
    shm = probe.get("shm") if isinstance(probe.get("shm"), dict) else {}
    memlock = probe.get("memlock") if isinstance(probe.get("memlock"), dict) else {}
    size, free = _mib(shm.get("size_mib")), _mib(shm.get("free_mib"))
    parts = [f"{nproc} process(es)"]
    if not shm.get("exists", False):
        parts.append("no /dev/shm")
    else:
        parts.append(f"/dev/shm {size} MiB ({free} MiB free, {shm.get('fstype') or 'not mounted'})")
    locked = memlock.get("hard")
    if locked is not None:
        text = "unlimited" if locked == "unlimited" else f"{(_mib(locked) or 0) // 1024} KiB"
        parts.append(f"locked memory {text}")
    parts.append(_p2p_line(accelerator, p2p))
    problem = ""
    if nproc > 1 and need > 0:
        fix = (
            "start the container with --shm-size=1g (or --ipc=host), or on a server mount a "
            "larger tmpfs (mount -o remount,size=2G /dev/shm, and in /etc/fstab); or set "
            "cluster_environment={'NCCL_SHM_DISABLE': '1'} in the inventory (NCCL then copies "
            f"through P2P or the network, slower); or lower preflight_shm_min_mib ({need})"
        )
        if not shm.get("exists") or not shm.get("writable", True):
            problem = (
                f"{host} runs {nproc} processes but has no writable /dev/shm, where NCCL's "
                f"shared-memory transport and the DataLoader's workers put their buffers: {fix}."
            )
        elif size is not None and size < need:
            problem = (
                f"{host} runs {nproc} processes but its /dev/shm holds {size} MiB (Docker's "
                f'default is 64 MB: NCCL fails creating a segment there, "unhandled system '
                f'error"), less than the {need} MiB this check asks for: {fix}.'
            )
        elif free is not None and free < need // 2:
            problem = (
                f"{host} runs {nproc} processes but only {free} of its {size} MiB of /dev/shm "
                f"are free (other processes' segments: ls -la /dev/shm): free them, or {fix}."
            )
    warning = ""
    if (
        accelerator != "cpu"
        and locked not in (None, "unlimited")
        and (_mib(locked) or 0) < MEMLOCK_WARN_MIB << 20
    ):
        warning = (
            f"{host}: locked memory is limited to {(_mib(locked) or 0) // 1024} KiB: NCCL over "
            "InfiniBand/RoCE needs it unlimited (a container: --ulimit memlock=-1; llama-job "
            "raises it up to this hard limit)"
        )
    return {
        "ok": not problem,
        "problem": problem,
        "warning": warning,
        "line": f"{host}: " + "; ".join(parts),
    }


class FilterModule:
    """The preflight's filters."""

    def filters(self) -> dict[str, Any]:
        """Map filter names to functions."""
        return {
            "preflight_consistency": preflight_consistency,
            "preflight_gpu_ids": preflight_gpu_ids,
            "preflight_ranks": preflight_ranks,
        }
