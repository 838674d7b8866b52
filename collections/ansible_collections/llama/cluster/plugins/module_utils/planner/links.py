"""The link between the run's nodes, as the cost model needs it (`run_link`): bandwidth from the
nodes' link facts (`ansible_local.llama_links`, written by playbooks/check.yml) or the knob
`link_gbps`, and where the figure came from.

The facts of a node: {"measured_at", "interfaces": {ifname: {"kind", "speed_mbps", "mtu",
"address"}}, "ifname" (the interface the run uses), "peers": {host: {"ifname", "tcp_gbps",
"rtt_ms"}}, "allreduce": {"backend", "ifname", "size_mib", "busbw_gbps", "nodes"}}. Every *_gbps
is gigabits per second.

The run's figure: the all-reduce bus bandwidth when a node records one (what a ring all-reduce
over the cluster reached, the figure the cost model's arithmetic is in), else the slowest TCP
stream between two of the run's nodes on the interface the run uses; the latency is half the
largest round trip between them (0 when none is recorded). `link_gbps` (a host variable, or -e
for every node; -e wins, as always in Ansible) wins over the facts: the slowest node's knob.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .cost import Link
from .schema import POSITIVE

CHECK = "playbooks/check.yml"


def _number(value: Any) -> float | None:  # noqa: ANN401 - fact data
    try:
        return float(POSITIVE.coerce(value))
    except (ValueError, TypeError):
        return None


def node_links(facts: Mapping[str, Any], knob: float | None) -> dict[str, Any]:
    """What one node knows of its links: its link_gbps knob (None: not set) and its facts'
    all-reduce and peers on the interface the run uses."""
    allreduce = facts.get("allreduce") if isinstance(facts.get("allreduce"), Mapping) else {}
    peers = facts.get("peers") if isinstance(facts.get("peers"), Mapping) else {}
    ifname = facts.get("ifname")
    return {
        "link_gbps": knob,
        "measured_at": facts.get("measured_at"),
        "ifname": ifname,
        "allreduce_gbps": _number(allreduce.get("busbw_gbps")),
        "allreduce_nodes": allreduce.get("nodes"),
        "allreduce_backend": allreduce.get("backend"),
        "peers": {
            str(peer): {"gbps": _number(p.get("tcp_gbps")), "rtt_ms": _number(p.get("rtt_ms"))}
            for peer, p in peers.items()
            if isinstance(p, Mapping) and (not ifname or p.get("ifname") in (None, ifname))
        },
    }


def run_link(nodes: Sequence[Mapping[str, Any]]) -> tuple[Link | None, str]:
    """The link the run's collectives cross between nodes, and where it came from; None with
    the reason when it is not known (one node: no link between nodes is used)."""
    if len(nodes) < 2:
        return None, "one node: no link between nodes"
    hosts = {n["host"] for n in nodes}
    links = [n.get("links") or {} for n in nodes]
    knobs = [
        (n["host"], n["links"]["link_gbps"])
        for n in nodes
        if (n.get("links") or {}).get("link_gbps")
    ]
    rtts = [
        p["rtt_ms"]
        for link in links
        for peer, p in (link.get("peers") or {}).items()
        if peer in hosts and p["rtt_ms"]
    ]
    latency = max(rtts) / 2 if rtts else 0.0
    if knobs:
        host, gbps = min(knobs, key=lambda k: k[1])
        return Link.from_gbps(gbps, latency, f"link_gbps (inventory or -e, {host})"), ""
    allreduce = [(link["allreduce_gbps"], link) for link in links if link.get("allreduce_gbps")]
    if allreduce:
        gbps, link = min(allreduce, key=lambda a: a[0])
        source = (
            f"check.yml's {link.get('allreduce_backend') or ''} all-reduce bus bandwidth over "
            f"{link.get('allreduce_nodes') or '?'} nodes, measured "
            f"{link.get('measured_at') or 'at an unknown time'}"
        )
        return Link.from_gbps(gbps, latency, " ".join(source.split())), ""
    pairs = [
        (p["gbps"], node["host"], peer)
        for node, link in zip(nodes, links, strict=True)
        for peer, p in (link.get("peers") or {}).items()
        if peer in hosts and p["gbps"]
    ]
    if pairs:
        gbps, a, b = min(pairs)
        return (
            Link.from_gbps(gbps, latency, f"check.yml's slowest TCP stream, {a} to {b}"),
            "",
        )
    return None, "the nodes' facts hold no link figures"
