"""The inventory: one place checks it and one place derives the cluster's topology from it.

`inventory_report` checks the inventory (roles/inventory_check calls it in the first play of every
playbook), `cluster_ranks` decides node ranks and `node_nproc` a node's processes, so the
launcher, the checks, the plan (llama.cluster.run_plan) and the training validation agree. The
filters of the same names are plugins/filter/cluster.py. Errors are filter errors that name the
problem and the fix.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from ansible.errors import AnsibleFilterError, AnsibleUndefinedVariable
from jinja2 import Undefined

from .llama_job.spec import NAME_RE, NAME_RULE

# The inventory's shape, as every playbook expects it.
EXPECTED = (
    "exactly one host in the group 'master' (node rank 0), the other nodes in 'workers', and, "
    "if the inventory has a group 'cluster', exactly the hosts of master and workers in it"
)
PORT_MIN = 1024
PORT_MAX = 65535
MISSING = object()
INVALID = object()


# ---- the numbers and names a user may set per host: one checker and its rule each -----------
def _whole(minimum: int) -> Callable[[object], int]:
    """A checker for a whole number >= minimum (an int, or a string of digits)."""

    def check(value: object) -> int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value.strip())
        if not isinstance(value, int) or value < minimum:
            raise ValueError
        return value

    return check


def _port(*, zero_is_none: bool = False) -> Callable[[object], int]:
    """A checker for a TCP port a user may open (and, with zero_is_none, 0 for none)."""

    def check(value: object) -> int:
        port = _whole(0)(value)
        if (zero_is_none and port == 0) or PORT_MIN <= port <= PORT_MAX:
            return port
        raise ValueError

    return check


def _gpu_ids(value: object) -> list[int]:
    """A checker for a non-empty list of distinct GPU indexes."""
    if not isinstance(value, list | tuple) or not value:
        raise ValueError
    ids = [_whole(0)(item) for item in value]
    if len(set(ids)) != len(ids):
        raise ValueError
    return ids


def _ip(value: object) -> str:
    """A checker for an IPv4 or IPv6 address."""
    return str(ipaddress.ip_address(str(value).strip()))


def _one_of(*choices: str) -> Callable[[object], str]:
    """A checker for one of a few words."""

    def check(value: object) -> str:
        if value not in choices:
            raise ValueError
        return value

    return check


PORT_RULE = f"a port from {PORT_MIN} to {PORT_MAX}"
# An environment variable's name as a shell and the job's env file take it.
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Every per-host setting the check reads: its checker and what is allowed, for the message.
HOST_SETTINGS: dict[str, tuple[Callable[[object], object], str]] = {
    "cluster_accelerator": (_one_of("nvidia", "cpu"), "nvidia or cpu"),
    "node_rank": (_whole(0), "a whole number >= 0 (the master 0, the workers 1 to N-1)"),
    "nproc_per_node": (_whole(1), "a whole number >= 1 (processes on this node)"),
    "gpu_ids": (_gpu_ids, "a non-empty list of distinct GPU indexes >= 0, e.g. [0, 1, 2, 3]"),
    "master_port": (_port(), PORT_RULE),
    "rendezvous_port": (_port(zero_is_none=True), f"0 (none) or {PORT_RULE}"),
    "watchdog_port": (_port(zero_is_none=True), f"0 (a cluster of one node only) or {PORT_RULE}"),
    "nccl_port_range_start": (_port(), PORT_RULE),
    "nccl_port_range_end": (_port(), PORT_RULE),
    "cluster_address": (
        _ip,
        "an IP address (the nodes' /etc/hosts and firewall rules are written with it); unset, it"
        " is ansible_host when that is an IP, else the address of the node's default route",
    ),
}


def _lookup(hostvars: Mapping[str, Any], host: str, name: str) -> object:
    """A host's value of `name`, or MISSING where it has none (or one that needs facts)."""
    values = hostvars[host]
    if name not in values:
        return MISSING
    try:
        value = values[name]
    except AnsibleUndefinedVariable:
        value = Undefined()
    # A default that needs facts (cluster_address) is undefined here: the roles that use it
    # check it once facts exist.
    return MISSING if isinstance(value, Undefined) else value


def _show(value: object, limit: int = 200) -> str:
    """A value as the user wrote it, for a message (cut after `limit` characters)."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad(name: str, host: str, value: object) -> str:
    """The message for a host's value that breaks its rule in HOST_SETTINGS."""
    return f"{name} of {host} is {_show(value)}: allowed is {HOST_SETTINGS[name][1]}."


def _host_settings(host: str, hostvars: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The host's checked settings (INVALID where a value breaks its rule), and a problem for
    each such value."""
    settings: dict[str, Any] = {}
    problems = []
    for name, (check, _rule) in HOST_SETTINGS.items():
        value = _lookup(hostvars, host, name)
        if value is MISSING:
            continue
        try:
            settings[name] = check(value)
        except (TypeError, ValueError):
            settings[name] = INVALID
            problems.append(_bad(name, host, value))
    valid = {name: value for name, value in settings.items() if value is not INVALID}
    problems += _port_problems(host, valid)
    nproc, gpus = valid.get("nproc_per_node"), valid.get("gpu_ids")
    if nproc is not None and gpus is not None and nproc > len(gpus):
        problems.append(
            f"nproc_per_node of {host} is {nproc}, but gpu_ids gives it {len(gpus)} GPUs "
            f"({_show(gpus)}): allowed is at most one process per GPU listed."
        )
    return settings, problems


def _port_problems(host: str, valid: Mapping[str, Any]) -> list[str]:
    """A problem for each pair of the host's ports that collide: the NCCL range against the
    master's ports, and the job's own ports (master, watchdog, rendezvous) against each other."""
    problems = []
    start, end = valid.get("nccl_port_range_start"), valid.get("nccl_port_range_end")
    if start is not None and end is not None:
        if start > end:
            problems.append(
                f"nccl_port_range_start of {host} ({start}) is above nccl_port_range_end ({end}):"
                " the range must run from start to end."
            )
        for name in ("master_port", "rendezvous_port", "watchdog_port"):
            port = valid.get(name)
            if port and start <= port <= end:
                problems.append(
                    f"{name} of {host} ({port}) is inside the NCCL port range {start}-{end}:"
                    " move one of them (NCCL's connections would take the port)."
                )
    # The rendezvous may share the master's port (torchrun's c10d store on MASTER_PORT).
    shareable = {"master_port", "rendezvous_port"}
    taken: dict[int, str] = {}
    for name in ("master_port", "watchdog_port", "rendezvous_port"):
        port = valid.get(name)
        if not port:
            continue
        if port in taken and {taken[port], name} != shareable:
            problems.append(
                f"{taken[port]} and {name} of {host} are both {port}: the master listens on "
                "each for a different purpose, so they must differ (the job would refuse the "
                "second only once it starts on the master)."
            )
        taken.setdefault(port, name)
    return problems


def environment_problems(environment: object, where: str) -> list[str]:
    """A problem for each way `environment` (a mapping NAME: value: cluster_environment, a job's
    environment, a service's secrets) cannot be written as an env file's NAME="value" lines: a
    name that is not [A-Za-z_][A-Za-z0-9_]*, or a value that is not one line of text, a number
    or a boolean. The messages name the variables, never their values (secrets pass here)."""
    if environment in (None, ""):
        return []
    if not isinstance(environment, Mapping):
        return [f"{where} is a {type(environment).__name__}: it must be a mapping of NAME: value."]
    problems = []
    names = [name for name in environment if not (isinstance(name, str) and ENV_NAME.match(name))]
    if names:
        problems.append(
            f"{where} has names an environment variable cannot have: "
            f"{', '.join(_show(name, 60) for name in names)} (allowed: letters, digits and '_', "
            "not starting with a digit)."
        )
    for name, value in environment.items():
        if isinstance(value, Mapping | list | tuple) or value is None:
            kind = "null" if value is None else f"a {type(value).__name__}"
            problems.append(
                f"{where}.{name} is {kind}: a variable's value is text, a number or true/false."
            )
        elif any(char in str(value) for char in "\n\r\0"):
            problems.append(
                f"{where}.{name} holds a line break (or a NUL): a variable's value is one line, "
                'which every node\'s env file writes as NAME="value".'
            )
    return problems


def source_problems(sources: list[str]) -> list[str]:
    """A problem for each inventory source (-i) that names no file or directory: Ansible only
    warns, and goes on with no hosts. A source with a comma is a list of hosts, not a path."""
    return [
        f"The inventory {source} does not exist (-i {source}): give the path of your inventory "
        "file or folder (e.g. -i inventory/mycluster), or leave -i out for the lab's "
        "inventory/lab.yml."
        for source in sources
        if "," not in source and not os.path.exists(source)
    ]


def become_problems(nodes: list[str], hostvars: Mapping[str, Any]) -> list[str]:
    """One problem naming the nodes Ansible reaches as an account other than root without
    becoming root there (ansible_user set, ansible_become not true, no --become): every
    playbook needs root on the nodes, and each failed later on a message of its own."""
    found: dict[str, list[str]] = {}
    for host in nodes:
        user = _lookup(hostvars, host, "ansible_user")
        become = _lookup(hostvars, host, "ansible_become")
        if user in (MISSING, None, "", "root") or str(become).lower() in ("true", "yes", "1"):
            continue
        found.setdefault(str(user), []).append(host)
    return [
        f"{', '.join(hosts)}: Ansible logs in as {user} (ansible_user), not root, and is not told "
        "to become root there: provision.yml, llama-job and a run's files need root on every "
        "node. Set ansible_become=true for the cluster ([all:vars] or [cluster:vars] in an INI "
        f"inventory; {user} needs sudo), or run with --become."
        for user, hosts in found.items()
    ]


def name_problems(nodes: list[str]) -> list[str]:
    """A problem for each node whose inventory name llama-job refuses (spec.py's NAME_RE): the
    name is in every node's unit, log, env and state file of a run, so a name the rule refuses
    would stop the run at launch, after its files were written on every node."""
    problems = []
    for host in nodes:
        if NAME_RE.match(host):
            continue
        plain = unicodedata.normalize("NFKD", host).encode("ascii", "ignore").decode()
        hint = re.sub(r"-+", "-", re.sub(r"[^A-Za-z0-9._-]", "-", plain)).strip("-._")[:128]
        problems.append(
            f"The host name {_show(host, 140)} cannot name a node's run files and units: a "
            f"host name must be {NAME_RULE} characters. Rename the host in the inventory"
            + (f" (e.g. {hint})" if hint else "")
            + "; where Ansible reaches it stays in ansible_host."
        )
    return problems


def _address_key(host: str, hostvars: Mapping[str, Any]) -> tuple[str, str] | None:
    """Where Ansible reaches `host` (its address, port and connection), as a key two entries for
    one machine share, and in words; None for a host on the controller itself
    (ansible_connection=local), which has no address of its own to compare (tests simulate
    several nodes on one controller that way; the facts rule still applies to them)."""
    connection = _lookup(hostvars, host, "ansible_connection")
    if connection == "local":
        return None
    address = _lookup(hostvars, host, "ansible_host")
    address = host if address is MISSING or not address else str(address).strip()
    port = _lookup(hostvars, host, "ansible_port")
    port = "" if port is MISSING or port in (None, "") else str(port).strip()
    kind = "" if connection is MISSING or connection in (None, "", "ssh") else str(connection)
    shown = f"address {address}" + (f" port {port}" if port else "")
    shown += f" ({kind})" if kind else ""
    return f"{kind}|{address.lower()}|{port}", shown


def _facts_key(host: str, hostvars: Mapping[str, Any]) -> tuple[str, str] | None:
    """The machine behind `host` as its facts (cached) show it: its machine-id and its addresses
    together. The machine-id alone is not enough: cloned images share one (the lab's
    containers all carry the image's), while two addresses of one machine show the same set."""
    facts = _lookup(hostvars, host, "ansible_facts")
    facts = facts if isinstance(facts, Mapping) else {}
    machine = facts.get("machine_id")
    addresses = sorted(str(a) for a in facts.get("all_ipv4_addresses") or [])
    if not machine or not addresses:
        return None
    return f"{machine}|{','.join(addresses)}", (
        f"machine-id {machine} and addresses {', '.join(addresses)}"
    )


def _split_gpus(hosts: list[str], settings: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether `hosts` split one machine's GPUs between them: each sets gpu_ids, and no GPU is
    given to two of them (logical nodes of one machine, as bench/gpu's inventory has)."""
    given = [settings[host].get("gpu_ids") for host in hosts]
    if any(not isinstance(ids, list) for ids in given):
        return False
    every = [gpu for ids in given for gpu in ids]
    return len(every) == len(set(every))


def _machine_problems(
    nodes: list[str],
    hostvars: Mapping[str, Any],
    settings: Mapping[str, Mapping[str, Any]],
    compare_facts: bool,
) -> list[str]:
    """A problem for each group of hosts that are one machine: the same address and port, the
    same cluster_address, or (compare_facts) facts with the same machine-id and addresses. Every
    rank of each would train on that machine, counted twice, on the same GPUs (or CPUs); unless
    they split its GPUs between them (disjoint gpu_ids: logical nodes of one machine)."""
    problems = []

    def cluster_address(host: str) -> tuple[str, str] | None:
        if _lookup(hostvars, host, "ansible_connection") == "local":
            return None  # as _address_key: simulated nodes on the controller share its address
        value = _lookup(hostvars, host, "cluster_address")
        try:
            address = _ip(value) if value is not MISSING else None
        except ValueError:
            return None
        return (address, f"cluster_address {address}") if address else None

    rules = [
        ("are reached at", lambda host: _address_key(host, hostvars)),
        ("have", cluster_address),
    ]
    if compare_facts:
        rules.append(("have, in their facts,", lambda host: _facts_key(host, hostvars)))
    for verb, key_of in rules:
        by_key: dict[str, list[str]] = {}
        shown: dict[str, str] = {}
        for host in nodes:
            found = key_of(host)
            if found:
                by_key.setdefault(found[0], []).append(host)
                shown[found[0]] = found[1]
        problems += [
            f"{' and '.join(hosts)} are one machine: they {verb} the same "
            f"{shown[key]}. Every rank of each would train on it, on the same devices, and the "
            "run would count it twice: list each machine once (or give each host its own "
            "address; to split one machine's GPUs between hosts, give each its own gpu_ids)."
            for key, hosts in by_key.items()
            if len(hosts) > 1 and not _split_gpus(hosts, settings)
        ]
    return problems


# ---- the groups ------------------------------------------------------------------------------
def cluster_nodes(groups: Mapping[str, list[str]]) -> list[str]:
    """The training nodes: the group cluster, or master + workers where there is none."""
    cluster = list(groups.get("cluster") or [])
    if cluster:
        return cluster
    nodes = list(groups.get("master") or []) + list(groups.get("workers") or [])
    return list(dict.fromkeys(nodes))


def named_master(groups: Mapping[str, list[str]], hostvars: Mapping[str, Any]) -> str | None:
    """The master of an inventory whose group cluster names none ([cluster] alone, as a
    tutorial writes it): the host that sets node_rank 0, else the first host of cluster that is
    not a worker. None where the inventory has a master, or no cluster group to take one from."""
    if groups.get("master") or not groups.get("cluster"):
        return None
    workers = set(groups.get("workers") or [])
    candidates = [h for h in groups["cluster"] if h not in workers]
    for host in candidates:
        value = _lookup(hostvars, host, "node_rank") if host in hostvars else MISSING
        if value is not MISSING and str(value).strip() == "0":
            return host
    return candidates[0] if candidates else None


def cluster_groups(
    groups: Mapping[str, list[str]], hostvars: Mapping[str, Any] | None = None
) -> dict[str, list[str]]:
    """The inventory's groups with master and workers filled in where the group cluster leaves
    them out: without a master, `named_master` is it; without workers, every other host of
    cluster is one, in inventory order. What roles/inventory_check adds in memory (add_host)
    for the plays that follow, and what every rule below reads."""
    found = {name: list(members or []) for name, members in groups.items()}
    cluster = found.get("cluster") or []
    if not cluster:
        return found
    master = named_master(found, hostvars or {})
    if master is not None:
        found["master"] = [master]
    if found.get("master") and not found.get("workers"):
        found["workers"] = [h for h in cluster if h not in found["master"]]
    return found


def _found(groups: Mapping[str, list[str]]) -> str:
    """The groups the inventory has, for a message."""

    def hosts(name: str) -> str:
        members = list(groups.get(name) or [])
        if members:
            return ", ".join(members)
        if name == "cluster":
            return "none (master + workers make it)"
        return "none" if name in groups else "no such group"

    found = [f"{name}: {hosts(name)}" for name in ("master", "workers", "cluster")]
    others = sorted(
        name
        for name, members in groups.items()
        if name not in ("all", "master", "workers", "cluster") and members
    )
    found += [f"{name}: {', '.join(groups[name])}" for name in others]
    return "; ".join(found)


def _group_problems(groups: Mapping[str, list[str]]) -> list[str]:
    """A problem for each way the groups fail to make one master plus workers."""
    masters = list(groups.get("master") or [])
    workers = list(groups.get("workers") or [])
    cluster = list(groups.get("cluster") or [])
    nodes = cluster_nodes(groups)
    if not nodes:
        return [
            "The inventory has no nodes: no hosts in the group 'cluster', nor in 'master' or "
            "'workers'. Start the lab (ansible-playbook playbooks/lab.yml) or pass your own "
            "inventory with -i (see inventory/example/hosts.yml)."
        ]
    problems = []
    if len(masters) != 1:
        problems.append(
            f"The group 'master' must hold exactly one host (found: {', '.join(masters) or 'none'})"
            ": put the node that is rank 0 in 'master' and the others in 'workers'."
        )
    both = [h for h in workers if h in masters]
    if both:
        problems.append(
            f"{', '.join(both)} in both 'master' and 'workers': a node is one or the other."
        )
    if cluster:
        strays = [h for h in cluster if h not in masters and h not in workers]
        if strays:
            problems.append(
                f"{', '.join(strays)} in 'cluster' but neither in 'master' nor in 'workers': "
                "put every training node in one of the two groups."
            )
        outside = [h for h in masters + workers if h not in cluster]
        if outside:
            problems.append(
                f"{', '.join(dict.fromkeys(outside))} in 'master' or 'workers' but not in "
                "'cluster': make master and workers the children of cluster (or drop the group "
                "cluster: master + workers are then the cluster)."
            )
    return problems


def _rank_problems(
    masters: list[str], workers: list[str], explicit: Mapping[str, int]
) -> list[str]:
    """A problem for each way explicit node_rank values fail to number the nodes 0 to N-1."""
    ordered = list(dict.fromkeys(masters + workers))
    explicit = {host: explicit[host] for host in ordered if host in explicit}
    if not explicit:
        return []
    unset = [h for h in ordered if h not in explicit]
    if unset:
        return [
            f"Some hosts set node_rank but {', '.join(unset)} do not: set it on every host or none."
        ]
    problems = []
    master = masters[0]
    if explicit[master] != 0:
        problems.append(
            f"The master {master} has node_rank {explicit[master]}; the master must be rank 0."
        )
    seen: dict[int, str] = {}
    for host in ordered:
        rank = explicit[host]
        if rank in seen:
            problems.append(
                f"{seen[rank]} and {host} both have node_rank {rank}; ranks must be unique."
            )
        seen.setdefault(rank, host)
    expected = list(range(len(ordered)))
    if not problems and sorted(explicit.values()) != expected:
        problems.append(
            f"node_rank values {sorted(explicit.values())} do not add up: with {len(ordered)} "
            f"nodes they must be exactly {expected}."
        )
    return problems


def _agreement_problems(
    nodes: list[str], hostvars: Mapping[str, Any], uniform: list[str]
) -> list[str]:
    """One problem naming every setting in `uniform` whose value differs between nodes."""
    differences = []
    for name in uniform:
        by_value: dict[str, list[str]] = {}
        shown: dict[str, Any] = {}
        for host in nodes:
            value = _lookup(hostvars, host, name)
            if value is MISSING:
                continue
            key = json.dumps(value, sort_keys=True, default=str)
            by_value.setdefault(key, []).append(host)
            shown[key] = value
        if len(by_value) > 1:
            values = "; ".join(
                f"{_show(shown[key], 60)} on {', '.join(hosts)}" for key, hosts in by_value.items()
            )
            differences.append(f"{name} ({values})")
    if not differences:
        return []
    return [
        f"Settings differ between nodes: {', '.join(differences)}. Every node must have the same:"
        " set each once for the whole cluster ([all:vars], the group cluster, or "
        "group_vars/all.yml beside the inventory), not per host."
    ]


def inventory_report(
    groups: Mapping[str, list[str]],
    hostvars: Mapping[str, Any],
    uniform: list[str] | None = None,
    compare_facts: bool = False,
    *,
    sources: list[str] | None = None,
    become: bool | None = None,
) -> dict[str, Any]:
    """Check the inventory: its sources (-i paths that exist), its groups, the settings in
    `uniform` that every node must share, every node's name, numbers (HOST_SETTINGS) and
    environment, and hosts that are one machine (by their facts too with `compare_facts`: only
    facts just read, as train.yml's node play does; a cached fact may predate a fix of the
    inventory), and (`become` False: the command line has no --become) nodes reached as another
    account than root that are not told to become root. Returns the nodes, the problems (empty
    when the inventory is fine) and a message that lists them with what was expected and
    found."""
    missing = source_problems(list(sources or []))
    if missing:  # the inventory's other problems would follow from it (no nodes)
        return {"nodes": [], "problems": missing, "message": "\n".join(f"- {p}" for p in missing)}
    nodes = cluster_nodes(groups)
    # Ansible computes a host's variables on every hostvars[host]: once per node is enough.
    hostvars = {host: hostvars[host] for host in nodes}
    groups = cluster_groups(groups, hostvars)
    problems = _group_problems(groups) + name_problems(nodes)
    problems += become_problems(nodes, hostvars) if become is False else []
    settings: dict[str, dict[str, Any]] = {}
    for host in nodes:
        settings[host], host_problems = _host_settings(host, hostvars)
        problems += host_problems
    masters = list(groups.get("master") or [])
    explicit = {h: s["node_rank"] for h, s in settings.items() if "node_rank" in s}
    if len(masters) == 1 and INVALID not in explicit.values():
        workers = [h for h in groups.get("workers") or [] if h not in masters]
        problems += _rank_problems(masters, workers, explicit)
    problems += _agreement_problems(nodes, hostvars, list(uniform or []))
    problems += _machine_problems(nodes, hostvars, settings, compare_facts)
    watchless = [h for h in nodes if settings[h].get("watchdog_port") == 0]
    if watchless and len(nodes) > 1:
        problems.append(
            f"watchdog_port is 0 on {', '.join(watchless)}, but the cluster has {len(nodes)} "
            "nodes: their agents keep their heartbeats with the master's on that port (0 is for "
            "a cluster of one node). Set a free port (default 29499)."
        )
    for host in nodes:
        environment = _lookup(hostvars, host, "cluster_environment")
        if environment is not MISSING:
            problems += environment_problems(environment, f"cluster_environment of {host}")
    found = _found(groups)
    return {
        "nodes": nodes,
        "problems": problems,
        "message": "\n".join(
            [f"- {problem}" for problem in problems] + [f"Expected {EXPECTED}.", f"Found {found}."]
        ),
    }


def cluster_ranks(groups: Mapping[str, list[str]], hostvars: Mapping[str, Any]) -> dict[str, int]:
    """Map every node to its node rank.

    The one host of `master` is rank 0; `workers` follow in inventory order, unless hosts set
    `node_rank`; an inventory of the group cluster alone takes its master and workers from it
    (cluster_groups). Raises a filter error that names the problem and the fix.
    """
    groups = cluster_groups(groups, hostvars)
    problems = _group_problems(groups)
    if problems:
        raise AnsibleFilterError(" ".join(problems))
    masters = list(groups.get("master") or [])
    workers = [h for h in groups.get("workers") or [] if h not in masters]
    explicit = {}
    for host in masters + workers:
        value = _lookup(hostvars, host, "node_rank")
        if value is MISSING:
            continue
        try:
            explicit[host] = _whole(0)(value)
        except (TypeError, ValueError) as err:
            raise AnsibleFilterError(_bad("node_rank", host, value)) from err
    problems = _rank_problems(masters, workers, explicit)
    if problems:
        raise AnsibleFilterError(" ".join(problems))
    if explicit:
        return dict(explicit)
    return {host: index for index, host in enumerate(masters + workers)}


def node_nproc(hostvars: Mapping[str, Any]) -> int:
    """Processes to start on one node: explicit, else one per selected or detected GPU."""
    host = hostvars.get("inventory_hostname", "a host")
    if "nproc_per_node" in hostvars:
        try:
            return _whole(1)(hostvars["nproc_per_node"])
        except (TypeError, ValueError) as err:
            raise AnsibleFilterError(
                _bad("nproc_per_node", host, hostvars["nproc_per_node"])
            ) from err
    if hostvars.get("gpu_ids"):
        return len(hostvars["gpu_ids"])
    facts = hostvars.get("ansible_local", {}).get("llama_host", {})
    if hostvars.get("cluster_accelerator", "nvidia") == "cpu":
        return 1
    count = int(facts.get("gpu_count", 0) or 0)
    if count < 1 and isinstance(facts.get("gpus"), list):
        raise AnsibleFilterError(
            f"{host} has no NVIDIA GPU (provision.yml found none on its PCI bus) and "
            "cluster_accelerator is nvidia: to train on its CPUs, set cluster_accelerator=cpu "
            "for the cluster (e.g. [cluster:vars] in an INI inventory)."
        )
    if count < 1:
        raise AnsibleFilterError(
            f"{host} reports no GPUs and sets no "
            "nproc_per_node: run provision.yml (it records the GPUs) or set nproc_per_node."
        )
    return count


def global_ranks(
    groups: Mapping[str, list[str]], hostvars: Mapping[str, Any]
) -> dict[str, list[int]]:
    """Every node's training processes as torchrun numbers them (RANK): nodes in rank order,
    then each node's processes in local order (LOCAL_RANK 0, 1, ...), so a node's ranks start
    after the processes of every node ranked before it. Raises as cluster_ranks and node_nproc
    do."""
    ranks = cluster_ranks(groups, hostvars)
    found, first = {}, 0
    for host in sorted(ranks, key=ranks.__getitem__):
        count = node_nproc({"inventory_hostname": host, **dict(hostvars[host])})
        found[host] = list(range(first, first + count))
        first += count
    return found
