"""The nodes: accelerator, processes and GPU memory of every node, from the inventory and each
node's facts (`describe_nodes`); the plan is made for the smallest node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import PlanError
from .links import node_links
from .schema import AT_LEAST_1, POSITIVE, show
from .techniques import OPTIONAL


def _get(mapping: Any, key: str, default: Any = None) -> Any:  # noqa: ANN401 - Ansible's hostvars
    return mapping.get(key, default) if isinstance(mapping, Mapping) else default


def local_facts(hostvars: Any, name: str = "llama_host") -> Mapping[str, Any]:  # noqa: ANN401
    """A local fact of the node (llama_host: roles/host_facts; llama_links: playbooks/check.yml),
    from gathering or the fact cache; {} when it has none."""
    facts = _get(hostvars, "ansible_local")
    if not isinstance(facts, Mapping):
        gathered = _get(hostvars, "ansible_facts", {}) or {}
        facts = _get(gathered, "local") or _get(gathered, "ansible_local") or {}
    found = _get(facts, name, {}) or {}
    return found if isinstance(found, Mapping) else {}


def node_accelerator(hostvars: Any) -> str:  # noqa: ANN401 - Ansible's hostvars
    """The node's cluster_accelerator (nvidia unless the inventory says otherwise)."""
    return str(_get(hostvars, "cluster_accelerator", "nvidia") or "nvidia")


def cluster_accelerator(hosts: Sequence[str], hostvars: Any) -> str:  # noqa: ANN401
    """The one accelerator every node trains on; raises naming the nodes when they disagree."""
    seen: dict[str, list[str]] = {}
    for host in hosts:
        seen.setdefault(node_accelerator(hostvars[host]), []).append(host)
    if len(seen) > 1:
        raise PlanError(cluster_accelerator_message(seen))
    return next(iter(seen)) if seen else "nvidia"


def hosts_without_gpu_facts(hosts: Sequence[str], hostvars: Any) -> list[str]:  # noqa: ANN401
    """GPU nodes whose facts are neither gathered nor cached: train.yml reads them first."""
    return [
        host
        for host in hosts
        if node_accelerator(hostvars[host]) != "cpu"
        and not isinstance(local_facts(hostvars[host]).get("gpus"), list)
    ]


def _knob(host: str, hostvars: Any, name: str, unit: str = "GiB") -> float | None:  # noqa: ANN401
    """A planning knob (GiB, Gbit/s) set for this host in the inventory or for the run with -e."""
    value = _get(hostvars, name)
    if value in (None, ""):
        return None
    try:
        return float(POSITIVE.coerce(value))
    except (ValueError, TypeError):
        raise PlanError(
            f"{host}: {name} = {show(value)} must be a number of {unit} > 0 (set it per host in "
            f"the inventory, or for the run with -e {name}=N)"
        ) from None


def node_gpu_memory(host: str, hostvars: Any) -> tuple[float | None, str]:  # noqa: ANN401
    """GiB of the smallest GPU this node trains on (gpu_ids), and where the figure came from.

    `gpu_memory_gib` (a host variable, or -e for every node) wins over the facts: a share of a
    GPU (MIG, a card other work uses) is planned for as the user says."""
    if node_accelerator(hostvars) == "cpu":
        return None, "CPU node"
    knob = _knob(host, hostvars, "gpu_memory_gib")
    if knob is not None:
        return knob, "gpu_memory_gib (inventory or -e), over the facts"
    gpus = [g for g in local_facts(hostvars).get("gpus") or [] if isinstance(g, Mapping)]
    wanted = _get(hostvars, "gpu_ids")
    if wanted and gpus:
        indexes = [g.get("index") for g in gpus]
        missing = [i for i in wanted if i not in indexes]
        if missing:
            raise PlanError(
                f"{host}: gpu_ids {list(wanted)} name GPUs {missing} that the node does not have "
                f"(its facts list GPUs {indexes}). Fix gpu_ids in the inventory."
            )
        gpus = [g for g in gpus if g.get("index") in wanted]
    sizes = [int(g["memory_mib"]) for g in gpus if g.get("memory_mib")]
    if sizes:
        which = "GPU" if len(sizes) == 1 else f"smallest of {len(sizes)} GPUs"
        return round(min(sizes) / 1024, 1), f"facts, {which}"
    fallback = _get(hostvars, "training_gpu_memory_gib")
    try:
        gib = POSITIVE.coerce(fallback)
    except (ValueError, TypeError):
        raise PlanError(
            f"{host}: its facts report no GPU memory (no driver loaded, or provision.yml has not "
            f"run there) and training_gpu_memory_gib = {show(fallback)} is not a number > 0. "
            "Run provision.yml, or set training_gpu_memory_gib to the GPUs' memory in GiB."
        ) from None
    return float(gib), "training_gpu_memory_gib (the facts report no GPU memory)"


def node_compute_capability(hostvars: Any) -> float | None:  # noqa: ANN401 - Ansible's hostvars
    """The lowest CUDA compute capability of the GPUs this node trains on (gpu_ids), from the
    facts; None on a CPU node or where the facts do not record it."""
    if node_accelerator(hostvars) == "cpu":
        return None
    gpus = [g for g in local_facts(hostvars).get("gpus") or [] if isinstance(g, Mapping)]
    wanted = _get(hostvars, "gpu_ids")
    if wanted:
        gpus = [g for g in gpus if g.get("index") in wanted]
    caps = []
    for gpu in gpus:
        try:
            caps.append(float(gpu["compute_capability"]))
        except (KeyError, TypeError, ValueError):
            return None
    return min(caps) if caps else None


def node_host_memory(host: str, hostvars: Any) -> tuple[float | None, str]:  # noqa: ANN401
    """GiB of the node's RAM, and where the figure came from (None: not known, not checked).

    `host_memory_gib` (a host variable, or -e) wins over the facts, e.g. a node whose RAM other
    work uses, or a container limited below the machine's RAM."""
    knob = _knob(host, hostvars, "host_memory_gib")
    if knob is not None:
        return knob, "host_memory_gib (inventory or -e), over the facts"
    mib = local_facts(hostvars).get("host_memory_mib")
    if isinstance(mib, (int, float)) and not isinstance(mib, bool) and mib > 0:
        return round(float(mib) / 1024, 1), "facts"
    return None, "unknown (facts from before host memory was recorded: run provision.yml)"


def describe_nodes(
    ranks: Mapping[str, int],
    hostvars: Any,  # noqa: ANN401 - Ansible's hostvars
    nprocs: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """Every node in rank order: host, rank, accelerator, processes, GPU and host memory and
    where each figure came from, and what it knows of its links (planner/links.py)."""
    nodes = []
    for host, rank in sorted(ranks.items(), key=lambda item: item[1]):
        gib, source = node_gpu_memory(host, hostvars[host])
        host_gib, host_source = node_host_memory(host, hostvars[host])
        nodes.append(
            {
                "host": host,
                "rank": int(rank),
                "accelerator": node_accelerator(hostvars[host]),
                "nproc": nprocs[host],
                "gpu_memory_gib": gib,
                "memory_source": source,
                "host_memory_gib": host_gib,
                "host_memory_source": host_source,
                "compute_capability": node_compute_capability(hostvars[host]),
                "torchao": local_facts(hostvars[host], "llama_stack").get("torchao"),
                # The optional packages the memory-saving techniques need (techniques.OPTIONAL).
                "packages": {
                    name: local_facts(hostvars[host], "llama_stack").get(name) for name in OPTIONAL
                },
                "links": node_links(
                    local_facts(hostvars[host], "llama_links"),
                    _knob(host, hostvars[host], "link_gbps", "Gbit/s"),
                ),
            }
        )
    return nodes


def check_nodes(nodes: Sequence[Mapping[str, Any]]) -> tuple[str, int, int]:
    """The accelerator, processes per node and world size; raises on what cannot be planned."""
    if not nodes:
        raise PlanError("The inventory has no hosts in the group 'cluster'.")
    accelerators = {}
    for node in nodes:
        accelerators.setdefault(node["accelerator"], []).append(node["host"])
    if len(accelerators) > 1:
        raise PlanError(cluster_accelerator_message(accelerators))
    bad = [f"{n['host']}: {show(n['nproc'])}" for n in nodes if not _is_count(n["nproc"])]
    if bad:
        raise PlanError(
            f"nproc_per_node must be an integer >= 1 (got {', '.join(bad)}): it is the number of "
            "training processes on the node, one per GPU it trains on."
        )
    counts = {int(n["nproc"]) for n in nodes}
    if len(counts) > 1:
        listed = ", ".join(f"{n['host']}: {n['nproc']}" for n in nodes)
        raise PlanError(
            f"Nodes run different numbers of processes ({listed}). torchrun's static rendezvous "
            "needs the same nproc_per_node on every node: set nproc_per_node (or gpu_ids) so that "
            "they match, or leave the smaller nodes out of the cluster group."
        )
    nproc = counts.pop()
    return next(iter(accelerators)), nproc, nproc * len(nodes)


def cluster_accelerator_message(accelerators: Mapping[str, list[str]]) -> str:
    """The refusal for nodes that disagree on cluster_accelerator."""
    found = "; ".join(f"{acc} on {', '.join(hosts)}" for acc, hosts in sorted(accelerators.items()))
    return (
        f"The nodes disagree on cluster_accelerator ({found}). One run trains on one kind of "
        "device: set cluster_accelerator once for the whole cluster group, or fix the host "
        "variables of the nodes that differ."
    )


def _is_count(value: Any) -> bool:  # noqa: ANN401 - any user value
    try:
        AT_LEAST_1.coerce(value)
    except (ValueError, TypeError):
        return False
    return True
