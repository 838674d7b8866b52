"""Jinja filters that check the inventory and derive the cluster's topology from it: the rules
are module_utils/inventory.py (inventory_report, cluster_groups, cluster_ranks, node_nproc,
global_ranks, and environment_problems, which the inventory check, the job and the service roles
share), and unknown_vars (module_utils/known_vars.py: an extra variable that nothing reads)."""

from __future__ import annotations

from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.inventory import (
    HOST_SETTINGS,
    cluster_groups,
    cluster_ranks,
    environment_problems,
    global_ranks,
    inventory_report,
    node_nproc,
)
from ansible_collections.llama.cluster.plugins.module_utils.known_vars import unknown_vars

__all__ = [
    "HOST_SETTINGS",
    "FilterModule",
    "cluster_groups",
    "cluster_ranks",
    "environment_problems",
    "global_ranks",
    "inventory_report",
    "node_nproc",
    "unknown_vars",
]


class FilterModule:
    """Cluster topology filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "inventory_report": inventory_report,
            "cluster_groups": cluster_groups,
            "cluster_ranks": cluster_ranks,
            "global_ranks": global_ranks,
            "node_nproc": node_nproc,
            "environment_problems": environment_problems,
            "unknown_vars": unknown_vars,
        }
