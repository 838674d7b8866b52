"""Jinja filters that derive the cluster's topology from the inventory.

One place decides node ranks, so the launcher, the checks and the training validation agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError


def _check_groups(cluster: list[str], masters: list[str], workers: list[str]) -> None:
    """Fail unless cluster = one master + workers, each host in exactly one of the two."""
    if not cluster:
        raise AnsibleFilterError(
            "The inventory has no hosts in the group 'cluster'. Start the lab "
            "(ansible-playbook playbooks/lab.yml) or pass your own inventory with -i "
            "(see inventory/example/hosts.yml)."
        )
    if len(masters) != 1:
        found = ", ".join(masters) or "none"
        raise AnsibleFilterError(
            f"The group 'master' must hold exactly one host (found: {found}). "
            "Put the node that is rank 0 under cluster.children.master.hosts."
        )
    strays = [h for h in cluster if h not in masters and h not in workers]
    if strays:
        raise AnsibleFilterError(
            f"Hosts {', '.join(strays)} are in 'cluster' but neither in 'master' nor in "
            "'workers'. Put every training node in one of the two groups."
        )
    outside = [h for h in masters + workers if h not in cluster]
    if outside:
        raise AnsibleFilterError(
            f"Hosts {', '.join(outside)} are in 'master' or 'workers' but not in 'cluster'. "
            "Make master and workers children of cluster."
        )
    both = [h for h in workers if h in masters]
    if both:
        raise AnsibleFilterError(f"Host {both[0]} is in both 'master' and 'workers'.")


def cluster_ranks(groups: Mapping[str, list[str]], hostvars: Mapping[str, Any]) -> dict[str, int]:
    """Map every host of the `cluster` group to its node rank.

    The one host of `master` is rank 0; `workers` follow in inventory order, unless hosts set
    `node_rank`. Raises a filter error that names the problem and the fix.
    """
    cluster = list(groups.get("cluster", []))
    masters = list(groups.get("master", []))
    workers = list(groups.get("workers", []))
    _check_groups(cluster, masters, workers)
    ordered = masters + workers
    explicit = {h: hostvars[h]["node_rank"] for h in ordered if "node_rank" in hostvars[h]}
    if explicit:
        ranks = {}
        for host in ordered:
            if host not in explicit:
                raise AnsibleFilterError(
                    f"Some hosts set node_rank but {host} does not: set it on every host or none."
                )
            try:
                ranks[host] = int(explicit[host])
            except (TypeError, ValueError) as err:
                raise AnsibleFilterError(
                    f"node_rank of {host} is {explicit[host]!r}, not an integer."
                ) from err
    else:
        ranks = {host: index for index, host in enumerate(ordered)}

    master = masters[0]
    if ranks[master] != 0:
        raise AnsibleFilterError(
            f"The master {master} has node_rank {ranks[master]}; the master must be rank 0."
        )
    expected = list(range(len(ordered)))
    if sorted(ranks.values()) != expected:
        seen: dict[int, str] = {}
        for host, rank in ranks.items():
            if rank in seen:
                raise AnsibleFilterError(
                    f"{seen[rank]} and {host} both have node_rank {rank}; ranks must be unique."
                )
            seen[rank] = host
        raise AnsibleFilterError(
            f"node_rank values {sorted(ranks.values())} do not add up: with {len(ordered)} "
            f"nodes they must be exactly {expected}."
        )
    return ranks


def node_nproc(hostvars: Mapping[str, Any]) -> int:
    """Processes to start on one node: explicit, else one per selected or detected GPU."""
    if "nproc_per_node" in hostvars:
        return int(hostvars["nproc_per_node"])
    if hostvars.get("gpu_ids"):
        return len(hostvars["gpu_ids"])
    facts = hostvars.get("ansible_local", {}).get("llama_host", {})
    if hostvars.get("cluster_accelerator", "nvidia") == "cpu":
        return 1
    count = int(facts.get("gpu_count", 0) or 0)
    if count < 1:
        raise AnsibleFilterError(
            f"{hostvars.get('inventory_hostname', 'a host')} reports no GPUs and sets no "
            "nproc_per_node: run provision.yml (it records the GPUs) or set nproc_per_node."
        )
    return count


class FilterModule:
    """Cluster topology filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "cluster_ranks": cluster_ranks,
            "node_nproc": node_nproc,
        }
