"""The nodes: accelerator, processes and GPU memory of every node, from the inventory and each
node's facts (`describe_nodes`); the plan is made for the smallest node. Where train.yml read
what each node's GPUs and memory hold at train time (llama.cluster.llama_node_usage), the plan is
made for what is free now, and a GPU the run needs that another process holds stops the plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
    if local_facts(hostvars).get("gpus") == []:
        raise PlanError(
            f"{host} has no NVIDIA GPU (provision.yml found none on its PCI bus) and "
            "cluster_accelerator is nvidia: to train on its CPUs, set cluster_accelerator=cpu for "
            "the cluster (e.g. [cluster:vars] in an INI inventory)."
        )
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


def node_host_memory(
    host: str,
    hostvars: Any,  # noqa: ANN401 - Ansible's hostvars
    found: Mapping[str, Any] | None = None,
) -> tuple[float | None, str]:
    """GiB of the node's RAM, and where the figure came from (None: not known, not checked).

    `host_memory_gib` (a host variable, or -e) wins over the facts, e.g. a node whose RAM other
    work uses, or a container limited below the machine's RAM. Otherwise, where train.yml read
    the node's usage (found: llama_node_usage's result), the smaller of the facts' total and what
    is available now."""
    knob = _knob(host, hostvars, "host_memory_gib")
    if knob is not None:
        return knob, "host_memory_gib (inventory or -e), over the facts"
    mib = local_facts(hostvars).get("host_memory_mib")
    facts = None
    if isinstance(mib, (int, float)) and not isinstance(mib, bool) and mib > 0:
        facts = round(float(mib) / 1024, 1)
    usage, why_not = usage_read(found)
    memory = _get(usage, "host_memory", {})
    now = _mib(_get(memory, "available_mib"))
    if now is not None:
        where = f"available now ({_get(memory, 'source') or 'read'} at train time)"
        if facts is None:
            return _gib_down(now), where
        if _gib_down(now) < facts:
            return _gib_down(now), f"{where}, of {facts:g} GiB in the facts"
        return facts, "facts (no less is available now)"
    if facts is not None:
        return facts, f"facts; {why_not}" if why_not else "facts"
    return None, "unknown (facts from before host memory was recorded: run provision.yml)"


# ---- what the nodes hold now (llama.cluster.llama_node_usage, read by train.yml) ----------------
# A GPU with more than this in use and no compute process listed is held by processes this node
# cannot see (another container); below it, a display server or an idle driver's own share.
BUSY_GPU_MIB = 1024


def usage_by_host(results: Any) -> dict[str, Mapping[str, Any]]:  # noqa: ANN401 - registered
    """llama_node_usage's results, looped over the nodes in train.yml (each result names its node
    as item), by node, whatever became of each read."""
    if not isinstance(results, Sequence) or isinstance(results, str):
        return {}
    return {
        str(result["item"]): result
        for result in results
        if isinstance(result, Mapping) and result.get("item") not in (None, "")
    }


def usage_read(found: Mapping[str, Any] | None) -> tuple[Mapping[str, Any] | None, str]:
    """The node's usage read at train time, or None and why not ("" where none was asked for:
    -e plan_free_memory=false, or a caller without reads)."""
    if not isinstance(found, Mapping) or found.get("skipped"):
        return None, ""
    if found.get("unreachable"):
        return None, "the node did not answer the read of its usage at train time"
    if found.get("failed") or not isinstance(found.get("gpus"), list):
        said = str(found.get("msg") or "no GPU list returned")
        return None, f"the read of its usage at train time failed: {said}"
    return found, ""


def _mib(value: Any) -> int | None:  # noqa: ANN401 - a figure of a node's read
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return int(value)


def _gib_down(mib: float) -> float:
    """MiB as GiB, rounded down to a tenth: what is free is never rounded up."""
    return math.floor(mib / 1024 * 10) / 10


def _free_mib(gpu: Mapping[str, Any]) -> int | None:
    total, used = _mib(gpu.get("memory_total_mib")), _mib(gpu.get("memory_used_mib"))
    return None if total is None or used is None else max(0, total - used)


def _processes(gpu: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in gpu.get("processes") or [] if isinstance(p, Mapping)]


def _busy(gpu: Mapping[str, Any]) -> bool:
    """Another process holds the GPU: one nvidia-smi lists, or memory in use that none explains."""
    used = _mib(gpu.get("memory_used_mib"))
    return bool(_processes(gpu)) or (used is not None and used > BUSY_GPU_MIB)


def _gpu_name(gpu: Mapping[str, Any]) -> str:
    return f"GPU {gpu.get('index')} ({gpu.get('name') or 'unnamed'})"


def _holder(process: Mapping[str, Any], runs_dir: str) -> str:
    """One process on a GPU as the refusal names it."""
    used = _mib(process.get("used_memory_mib"))
    size = f"{used / 1024:.1f} GiB" if used is not None else "memory not reported"
    if not process.get("visible"):
        name = process.get("process_name") or "no name reported"
        return (
            f"pid {process.get('pid')} ({name}, {size}), which this node cannot see (another "
            "container or PID namespace?)"
        )
    command = str(process.get("command") or "")
    ours = (
        " - a run of this cluster: playbooks/status.yml shows it, playbooks/stop.yml stops it"
        if runs_dir and runs_dir in command
        else ""
    )
    return f"pid {process.get('pid')} (user {process.get('user')}: {command}), {size}{ours}"


@dataclass(frozen=True)
class GpuUsage:
    """One node's GPUs as nvidia-smi listed them at train time: all of them (index order), those
    the run trains on, and what the refusals name (cluster_runs_dir, nvidia-smi's error)."""

    host: str
    gpus: list[Mapping[str, Any]]
    trained: list[Mapping[str, Any]]
    runs_dir: str = ""
    error: str = ""

    @property
    def busy(self) -> list[Mapping[str, Any]]:
        """The GPUs the run needs that other processes hold."""
        return [g for g in self.trained if _busy(g)]

    @property
    def least_free(self) -> float | None:
        """GiB free now on the GPU the run needs that has the least (None: not reported)."""
        frees = [f for f in (_free_mib(g) for g in self.trained) if f is not None]
        return _gib_down(min(frees)) if frees else None

    @property
    def unreported(self) -> list[Mapping[str, Any]]:
        """The GPUs the run needs whose used memory nvidia-smi does not report ([N/A]: MIG)."""
        return [g for g in self.trained if _free_mib(g) is None]

    def held(self) -> str:
        """What holds each busy GPU, and what is free on it."""
        return "; ".join(self._held(gpu) for gpu in self.busy)

    def _held(self, gpu: Mapping[str, Any]) -> str:
        processes = _processes(gpu)
        if processes:
            held = "held by " + "; ".join(_holder(p, self.runs_dir) for p in processes)
        else:
            used = _mib(gpu.get("memory_used_mib")) or 0
            held = (
                f"{used / 1024:.1f} GiB in use, held by processes this node cannot see (another "
                "container?)"
                + (f"; nvidia-smi could not list them: {self.error}" if self.error else "")
            )
        free, total = _free_mib(gpu), _mib(gpu.get("memory_total_mib"))
        if free is not None and total is not None:
            held += f"; {_gib_down(free):g} of {total / 1024:.1f} GiB free now"
        return f"{_gpu_name(gpu)} is {held}"

    def refusal(self) -> str:
        """Why this node stops the run, and the ways out."""
        busy, least = self.busy, self.least_free
        them = "it" if len(busy) == 1 else "them"
        idle = [g["index"] for g in self.gpus if not _busy(g)]
        out = (
            f"leave {them} out with gpu_ids (e.g. gpu_ids={idle} for {self.host} in the inventory)"
            if idle
            else "train without this node (every GPU of it is in use)"
        )
        share = (
            f"accept the smaller share with -e gpu_memory_gib=N (N <= {least:g}, the least free "
            "on a GPU this run needs; the plan is then made for N)"
            if least is not None
            else "accept a share with -e gpu_memory_gib=N (nvidia-smi reports no free figure)"
        )
        needed = ", ".join(str(g["index"]) for g in self.trained)
        return (
            f"{self.host}: another process holds a GPU this run needs (it trains on GPUs "
            f"{needed}): {self.held()}. Stop {them}, {out}, or {share}."
        )

    def shared(
        self, knob: float | None, planned: tuple[float | None, str]
    ) -> tuple[float | None, str, str]:
        """With a GPU the run needs held by others: the share gpu_memory_gib accepts (GiB,
        source, ""), or the figure planned and the refusal."""
        least = self.least_free
        if knob is None:
            return (*planned, self.refusal())
        if least is not None and knob > least:
            return (
                *planned,
                f"{self.host}: gpu_memory_gib = {knob:g} GiB is more than is free now on the GPUs "
                f"this run needs: {self.held()}. Set gpu_memory_gib to at most {least:g}, stop "
                "those processes, or leave those GPUs out with gpu_ids.",
            )
        held = ", ".join(_gpu_name(g) for g in self.busy)
        now = f"{least:g} GiB free now" if least is not None else "free memory not reported"
        source = (
            f"gpu_memory_gib (inventory or -e): a share of {held}, which other processes hold "
            f"({now}, nvidia-smi at train time)"
        )
        return knob, source, ""

    def free_now(self, planned: tuple[float | None, str]) -> tuple[float | None, str]:
        """With no GPU the run needs held by others: what is free now, the least of them (or
        the figure planned, saying why nvidia-smi's could not replace it)."""
        gib, source = planned
        if not self.gpus:
            said = f"nvidia-smi failed: {self.error}" if self.error else "nvidia-smi listed no GPU"
            return gib, f"{source} (at train time {said})"
        if self.unreported:
            unknown = ", ".join(_gpu_name(g) for g in self.unreported)
            return gib, (
                f"{source} (at train time nvidia-smi reports no used memory for {unknown}: a "
                "MIG GPU? set gpu_memory_gib to its slice)"
            )
        which = "GPU" if len(self.trained) == 1 else f"smallest of {len(self.trained)} GPUs"
        return self.least_free, f"free now (nvidia-smi at train time), {which}"


def _trained_gpus(
    gpus: list[Mapping[str, Any]],
    wanted: Any,  # noqa: ANN401 - the inventory's gpu_ids
    nproc: Any,  # noqa: ANN401 - the inventory's nproc_per_node
) -> list[Mapping[str, Any]]:
    """The GPUs the node's ranks use: gpu_ids (CUDA_VISIBLE_DEVICES), else one per process from
    the first (torchrun's local ranks)."""
    if wanted:
        return [g for g in gpus if g.get("index") in wanted]
    count = int(nproc) if _is_count(nproc) else len(gpus)
    return gpus[:count]


def gpu_usage(
    host: str,
    hostvars: Any,  # noqa: ANN401 - Ansible's hostvars
    usage: Mapping[str, Any],
    nproc: Any,  # noqa: ANN401 - the node's processes, checked later by check_nodes
) -> GpuUsage:
    """The node's GPUs from its usage read (usage_read's), and those the run trains on; raises
    where gpu_ids name a GPU nvidia-smi does not list now."""
    gpus = sorted(
        (g for g in usage["gpus"] if isinstance(g, Mapping) and _mib(g.get("index")) is not None),
        key=lambda g: g["index"],
    )
    wanted = _get(hostvars, "gpu_ids")
    listed = [g["index"] for g in gpus]
    missing = [i for i in wanted or [] if i not in listed]
    if gpus and missing:
        raise PlanError(
            f"{host}: gpu_ids {list(wanted)} name GPUs {missing} that nvidia-smi does not list "
            f"now (it lists GPUs {listed}). Fix gpu_ids in the inventory."
        )
    return GpuUsage(
        host,
        gpus,
        _trained_gpus(gpus, wanted, nproc),
        runs_dir=str(_get(hostvars, "cluster_runs_dir") or ""),
        error=str(usage.get("nvidia_smi_error") or ""),
    )


def node_gpu_usage(
    host: str,
    hostvars: Any,  # noqa: ANN401 - Ansible's hostvars
    found: Mapping[str, Any] | None,
    nproc: Any,  # noqa: ANN401 - the node's processes, checked later by check_nodes
    planned: tuple[float | None, str],
) -> tuple[float | None, str, str]:
    """GiB of GPU memory to plan this node for, where the figure came from, and what stops the
    run on this node ("" when nothing does), from its usage read at train time (found:
    llama_node_usage's result) and the figure planned from the facts and knobs (planned:
    node_gpu_memory's).

    What is free now (total - used, the least of the GPUs the node trains on) replaces the facts.
    A GPU the run needs that another process holds stops the run, unless gpu_memory_gib accepts
    a share no larger than what is free there. gpu_memory_gib wins otherwise, as without a read."""
    gib, source = planned
    usage, why_not = usage_read(found)
    if usage is None:
        return gib, f"{source}; {why_not}" if why_not else source, ""
    node = gpu_usage(host, hostvars, usage, nproc)
    knob = _knob(host, hostvars, "gpu_memory_gib")
    if node.busy:
        return node.shared(knob, planned)
    if knob is not None:
        return gib, source, ""
    return (*node.free_now(planned), "")


def describe_nodes(
    ranks: Mapping[str, int],
    hostvars: Any,  # noqa: ANN401 - Ansible's hostvars
    nprocs: Mapping[str, Any],
    usage: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Every node in rank order: host, rank, accelerator, processes, GPU and host memory and
    where each figure came from, and what it knows of its links (planner/links.py).

    usage: llama_node_usage's result per node, read at train time (usage_by_host); the plan
    then uses what is free now, and raises naming every node where another process holds a GPU
    the run needs."""
    usage = usage or {}
    nodes, problems = [], []
    for host, rank in sorted(ranks.items(), key=lambda item: item[1]):
        gib, source, refusal = node_gpu_usage(
            host,
            hostvars[host],
            usage.get(host) if node_accelerator(hostvars[host]) != "cpu" else None,
            nprocs[host],
            node_gpu_memory(host, hostvars[host]),
        )
        if refusal:
            problems.append(refusal)
        host_gib, host_source = node_host_memory(host, hostvars[host], usage.get(host))
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
                # A CPU node planned as a GPU node for the prediction only (assembly.py).
                "planning_profile": str(_get(hostvars[host], "cluster_planning_profile") or ""),
            }
        )
    if problems:
        raise PlanError(
            "Other work holds GPUs this run needs (read with nvidia-smi on every node just now; "
            "nothing was started): " + " ".join(problems)
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
        raise PlanError(uneven_nodes_message(nodes))
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


def uneven_nodes_message(nodes: Sequence[Mapping[str, Any]]) -> str:
    """The refusal of nodes that run different numbers of processes (a node with fewer GPUs).

    torchrun would run them (its rendezvous numbers each node's ranks after the processes of the
    nodes before it) and LLaMA-Factory's data split would agree (the sampler splits the data
    over the world size, whatever each node holds). The plan is refused all the same: the hybrid
    candidates (HSDP, ZeRO++ hpZ) shard over a node's ranks and need as many on every node, and
    each node's host memory, disk and the ways out of a refusal are worked out for one shape of
    node. Setting the smallest count on every node trains on every node, leaving GPUs idle."""
    fewest = min(int(n["nproc"]) for n in nodes)
    listed = ", ".join(f"{n['host']}: {n['nproc']}" for n in nodes)
    larger = [n["host"] for n in nodes if int(n["nproc"]) > fewest]
    smaller = [n["host"] for n in nodes if int(n["nproc"]) == fewest]
    return (
        f"Nodes run different numbers of processes ({listed}): this planner plans nodes of one "
        "shape (HSDP and ZeRO++ hpZ shard over a node's ranks, and memory, disk and the ways out "
        "are worked out per node), so nothing was changed on any node. Set nproc_per_node="
        f"{fewest} for the whole cluster (e.g. [cluster:vars] in an INI inventory: "
        f"{', '.join(larger)} then leave {'some GPUs' if fewest > 1 else 'all but one GPU'} idle), "
        f"or leave {', '.join(smaller)} out of the cluster group."
    )


def emulated_nodes(
    nodes: Sequence[Mapping[str, Any]], profiles: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], str] | None:
    """CPU nodes as the GPU nodes their cluster_planning_profile names (one GPU per process),
    and what the plan says of it; None where no node names one. For the prediction and the go/no-go
    only: the nodes still train on their CPUs. Raises on an unknown profile, or nodes that name
    different ones."""
    named = {str(n.get("planning_profile") or "") for n in nodes}
    if named == {""}:
        return None
    if len(named) > 1:
        listed = "; ".join(f"{n['host']}: {n.get('planning_profile') or 'none'}" for n in nodes)
        raise PlanError(
            f"The nodes name different planning profiles ({listed}): set "
            "cluster_planning_profile once for the cluster (or -e cluster_planning_profile=...)."
        )
    name = named.pop()
    profile = profiles.get(name)
    if not isinstance(profile, Mapping):
        raise PlanError(
            f"cluster_planning_profile={name} is no planning profile: use one of "
            f"{', '.join(sorted(profiles)) or 'none'} (training_planning_profiles, "
            "group_vars/all/training.yml), or leave it unset."
        )
    return [
        {
            **node,
            "accelerator": "nvidia",
            "gpu_memory_gib": float(profile["gpu_memory_gib"]),
            "memory_source": f"planning profile {name} ({profile.get('name', name)}, emulated)",
            "compute_capability": profile.get("compute_capability"),
            "planning_profile": "",
        }
        for node in nodes
    ], (
        f"cluster_planning_profile={name}: these CPU nodes planned as "
        f"{profile.get('name', name)} GPUs for the prediction only; they train on their CPUs"
    )
