"""The networks the nodes share, the interface a run uses, and the link facts check.yml records.

Input: every node's interfaces as llama.cluster.llama_links (mode=interfaces) lists them. A
network is shared when every node has an address in the same IPv4 subnet, every address is
distinct (docker0's 172.17.0.1 on every server is no link between them) and the interface is up.
The run's network is the fastest shared one: InfiniBand, then RoCE, then Ethernet, then the
rest (bridges, others), and among one kind the highest speed every node reports; the inventory's
nccl_socket_ifname wins over it, and without a shared network the route to the master stays
(roles/nccl_network). With ufw on, only networks the firewall opens between the nodes count
(`links_open`: the one of their cluster_address, or inside firewall_cluster_cidrs).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

KIND_ORDER = ("infiniband", "roce", "ethernet", "bridge", "other")


def _rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def links_networks(interfaces: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[dict]:
    """The networks every node shares, best first: {network, kind, speed_mbps (the slowest
    node's; None when one does not say), hosts: {host: {ifname, address, mtu, kind}}}."""
    hosts = sorted(interfaces)
    by_network: dict[str, dict[str, dict[str, Any]]] = {}
    for host in hosts:
        for ifname, info in sorted((interfaces[host] or {}).items()):
            if not info.get("address") or info.get("prefix") is None:
                continue
            if info.get("operstate") not in (None, "up", "unknown"):
                continue
            network = str(ipaddress.ip_interface(f"{info['address']}/{info['prefix']}").network)
            entry = {
                "ifname": ifname,
                "address": info["address"],
                "mtu": info.get("mtu"),
                "kind": info.get("kind") or "other",
                "speed_mbps": info.get("speed_mbps"),
            }
            by_network.setdefault(network, {}).setdefault(host, entry)
    shared = []
    for network, members in by_network.items():
        addresses = [m["address"] for m in members.values()]
        if len(hosts) < 2 or sorted(members) != hosts or len(set(addresses)) != len(addresses):
            continue
        speeds = [m["speed_mbps"] for m in members.values()]
        # The network is of the kind its slowest member is (an Ethernet port on one node).
        kind = max((m["kind"] for m in members.values()), key=_rank)
        shared.append(
            {
                "network": network,
                "kind": kind,
                "speed_mbps": None if None in speeds else min(speeds),
                "hosts": members,
            }
        )
    shared.sort(key=lambda n: (_rank(n["kind"]), -(n["speed_mbps"] or 0), n["network"]))
    return shared


def links_open(
    networks: Sequence[Mapping[str, Any]],
    addresses: Mapping[str, str],
    firewall: bool = True,
    cidrs: Sequence[str] = (),
) -> list[dict]:
    """The shared networks the firewall lets the nodes talk on (roles/firewall allows every
    node's cluster_address, or firewall_cluster_cidrs instead): all of them with the firewall
    off; else those holding every node's cluster_address or inside one of the CIDRs."""
    allowed = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    open_ = []
    for net in networks:
        network = ipaddress.ip_network(net["network"])
        ours = {m["address"] for m in net["hosts"].values()}
        if (
            not firewall
            or all(addresses.get(host) in ours for host in net["hosts"])
            or any(network.subnet_of(c) for c in allowed if c.version == network.version)
        ):
            open_.append(dict(net))
    return open_


def links_pairs(networks: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Every ordered pair of nodes on every shared network: who sends, to which address, and
    the sender's address there (the receiver connects to it: llama_links measures what it
    receives)."""
    return [
        {
            "source": source,
            "target": target,
            "network": net["network"],
            "ifname": net["hosts"][source]["ifname"],
            "address": net["hosts"][target]["address"],
            "source_address": net["hosts"][source]["address"],
        }
        for net in networks
        for source in sorted(net["hosts"])
        for target in sorted(net["hosts"])
        if source != target
    ]


def links_ifname(networks: Sequence[Mapping[str, Any]], host: str, override: str = "") -> str:
    """The interface `host` runs on: the inventory's override, else its interface on the best
    shared network, else "" (roles/nccl_network keeps the route to the master)."""
    if override:
        return override
    for net in networks:
        if host in net["hosts"]:
            return str(net["hosts"][host]["ifname"])
    return ""


def links_mtu_mismatches(networks: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per shared network whose nodes' MTUs differ, naming each node's MTU."""
    lines = []
    for net in networks:
        mtus = {host: m.get("mtu") for host, m in net["hosts"].items()}
        if len(set(mtus.values())) > 1:
            each = ", ".join(
                f"{host} {net['hosts'][host]['ifname']} {mtu}" for host, mtu in sorted(mtus.items())
            )
            lines.append(f"{net['network']}: MTU differs between nodes ({each})")
    return lines


def links_report(results: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The measured pairs as lines (`a -> b on 10.0.0.0/24 (eth1): 9.41 Gbit/s, round trip
    0.12 ms`) and the failed ones with the reason."""
    measured, failed = [], []
    for result in results:
        pair = result.get("item") or {}
        where = (
            f"{pair.get('source')} to {pair.get('target')} on {pair.get('network')} "
            f"({pair.get('ifname')})"
        )
        if result.get("failed") or result.get("tcp_gbps") is None:
            failed.append(f"{where}: {result.get('msg', 'no figure')}")
        else:
            measured.append(
                f"{where}: {result['tcp_gbps']:g} Gbit/s, round trip {result['rtt_ms']:g} ms"
            )
    return {"measured": measured, "failed": failed}


def links_fact(
    host: str,
    interfaces: Mapping[str, Mapping[str, Any]],
    networks: Sequence[Mapping[str, Any]],
    *,
    measured: Sequence[Mapping[str, Any]],
    ifname: str,
    allreduce: Mapping[str, Any] | None = None,
    measured_at: str = "",
    p2p: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The local fact llama_links of `host`, in the shape the planner reads
    (plugins/module_utils/planner/links.py): what this node measured sending to each peer, on
    every shared network (`networks`) and on the run's interface (`peers`)."""
    per_network: dict[str, dict[str, Any]] = {}
    for net in networks:
        if host in net["hosts"]:
            per_network[net["network"]] = {
                "ifname": net["hosts"][host]["ifname"],
                "kind": net["kind"],
                "speed_mbps": net["speed_mbps"],
                "peers": {},
            }
    for result in measured:
        pair = result.get("item") or {}
        if pair.get("source") != host or pair.get("network") not in per_network:
            continue
        per_network[pair["network"]]["peers"][pair["target"]] = {
            "ifname": pair["ifname"],
            "tcp_gbps": result.get("tcp_gbps"),
            "rtt_ms": result.get("rtt_ms"),
        }
    run = [n for n in per_network.values() if n["ifname"] == ifname]
    fact: dict[str, Any] = {
        "measured_at": measured_at,
        "interfaces": {
            name: {k: info.get(k) for k in ("kind", "speed_mbps", "mtu", "address")}
            for name, info in sorted(interfaces.items())
        },
        "ifname": ifname,
        "peers": run[0]["peers"] if run else {},
        "networks": per_network,
    }
    if allreduce:
        fact["allreduce"] = dict(allreduce)
    if p2p:
        fact["p2p"] = dict(p2p)
    return fact


def links_allreduce(result: Mapping[str, Any], ifname: str, size_mib: int | str) -> dict[str, Any]:
    """roles/preflight/files/allreduce.py's result as the fact records it."""
    return {
        "backend": result.get("backend"),
        "ifname": ifname,
        "size_mib": int(size_mib),
        "busbw_gbps": result.get("busbw_gbps"),
        "algbw_gbps": result.get("algbw_gbps"),
        "nodes": result.get("nnodes"),
        "world_size": result.get("world_size"),
        "sum_correct": result.get("sum_correct"),
    }


def links_p2p(probe: Mapping[str, Any]) -> dict[str, Any]:
    """Whether NCCL must not use P2P on this node, from roles/preflight/files/p2p.py's probe:
    set where a pair of its GPUs has no peer access (P2P absent: RTX 4090, PCIe ACS) or a copy
    arrived corrupted (P2P broken); not set on fewer than 2 GPUs or where every pair works."""
    pairs = [p for p in probe.get("pairs") or [] if isinstance(p, Mapping)]
    absent = [f"{p['from']}->{p['to']}" for p in pairs if not p.get("access")]
    broken = [f"{p['from']}->{p['to']}" for p in pairs if p.get("access") and not p.get("intact")]
    if int(probe.get("gpus") or 0) < 2:
        reason, disable = "fewer than 2 GPUs: no P2P used", False
    elif broken:
        reason, disable = f"P2P broken (a copy arrived corrupted): GPUs {', '.join(broken)}", True
    elif absent:
        reason, disable = f"P2P absent (no peer access): GPUs {', '.join(absent)}", True
    else:
        reason, disable = f"P2P works between all {probe['gpus']} GPUs", False
    return {
        "gpus": int(probe.get("gpus") or 0),
        "names": list(probe.get("names") or []),
        "nccl_p2p_disable": disable,
        "reason": reason,
    }


class FilterModule:
    """The link filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "links_networks": links_networks,
            "links_pairs": links_pairs,
            "links_open": links_open,
            "links_ifname": links_ifname,
            "links_mtu_mismatches": links_mtu_mismatches,
            "links_report": links_report,
            "links_fact": links_fact,
            "links_allreduce": links_allreduce,
            "links_p2p": links_p2p,
        }
