"""Scaling measured for real: the run's plan trained for a few steps on every node, then on the
master alone, and their tokens/s side by side (`llama-cluster scaling`).

The planner predicts the scaling and refuses a cluster predicted to scale backwards (train.yml's
go/no-go); this measures it. Both runs are train.yml through ansible-runner. The one-node run
pins the plan of the run on all nodes (stage, micro-batch, accumulation, checkpointing,
compilation), so that the two differ in their node count alone, and goes to an inventory that
holds the master only: a copy of the user's YAML inventory beside it (a hidden file, so that its
group_vars/ and host_vars/ still apply, and a directory inventory never loads it), removed after.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llama_runner.errors import InvalidInput
from llama_runner.results import TrainSummary

DEFAULT_STEPS = 30
# Training arguments of both runs: a short run of the plan, every step logged, no checkpoint.
MEASURE_ARGS = {
    "logging_steps": 1,
    "save_steps": 1_000_000_000,
    "include_num_input_tokens_seen": "non_padding",
}


def _groups(group: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every child group under `group`, depth first, with its name."""
    for name, child in (group.get("children") or {}).items():
        yield name, child or {}
        yield from _groups(child or {})


def keep_hosts(document: Mapping[str, Any], keep: set[str]) -> dict[str, Any]:
    """A copy of the YAML inventory `document` with every host but those in `keep` taken out;
    groups, their variables and the kept hosts' own are kept as they are."""
    result = copy.deepcopy(dict(document))

    def prune(group: dict[str, Any]) -> None:
        hosts = group.get("hosts")
        if isinstance(hosts, dict):
            group["hosts"] = {h: v for h, v in hosts.items() if h in keep}
        for name, child in (group.get("children") or {}).items():
            if isinstance(child, dict):
                prune(child)
            elif child is None:
                group["children"][name] = {}

    prune(result["all"])
    return result


def one_node_inventory(document: Mapping[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """The YAML inventory `document` with every host but the master's taken out, and the master.

    Groups, their variables and the master's own are kept as they are. InvalidInput when it is
    no YAML inventory or its group `master` does not hold exactly one host.
    """
    top = document.get("all") if isinstance(document, Mapping) else None
    if not isinstance(top, Mapping):
        raise InvalidInput(
            f"{source} is no YAML inventory (no top-level 'all'): see inventory/example/hosts.yml"
        )
    masters = [
        host
        for name, group in _groups(top)
        if name == "master"
        for host in (group.get("hosts") or {})
    ]
    if len(set(masters)) != 1:
        raise InvalidInput(
            f"{source}: the group 'master' must hold exactly one host to measure scaling "
            f"(found: {', '.join(masters) or 'none'})"
        )
    master = masters[0]
    return keep_hosts(document, {master}), master


def _read_yaml(inventory: Path, what: str) -> Any:  # noqa: ANN401 - a YAML document
    """The YAML inventory file `inventory`, for `what` (InvalidInput for anything else)."""
    if inventory.is_dir() or inventory.suffix not in (".yml", ".yaml"):
        raise InvalidInput(
            f"{what} needs the inventory as one YAML file, not {inventory}: pass -i "
            "<inventory>/hosts.yml (its group_vars/ and host_vars/ still apply)"
        )
    try:
        return yaml.safe_load(inventory.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise InvalidInput(f"cannot read the inventory {inventory}: {err}") from err


@contextmanager
def _copy_beside(
    inventory: Path, document: Mapping[str, Any], tag: str, header: str
) -> Iterator[Path]:
    """`document` as a hidden YAML file beside `inventory` (so that its group_vars/ and
    host_vars/ still apply, and a directory inventory never loads it), removed on the way out."""
    copy_path = inventory.with_name(f".{inventory.stem}.{os.getpid()}.{tag}.yml")
    copy_path.write_text(header + yaml.safe_dump(dict(document), sort_keys=False), "utf-8")
    try:
        yield copy_path
    finally:
        copy_path.unlink(missing_ok=True)


@contextmanager
def master_only(inventory: Path) -> Iterator[tuple[Path, str]]:
    """A copy of the YAML inventory file `inventory` with the master alone (a hidden file beside
    it), and the master's name; the copy is removed on the way out."""
    document = _read_yaml(inventory, "scaling")
    pruned, master = one_node_inventory(document, str(inventory))
    header = (
        f"# {inventory.name} with its master alone, for `llama-cluster scaling` (removed after)\n"
    )
    with _copy_beside(inventory, pruned, "one-node", header) as copy_path:
        yield copy_path, master


def ranked_nodes(inventory: Path) -> list[str]:
    """The inventory's nodes in node rank order, as train.yml ranks them (Ansible's own reading
    of the inventory, llama.cluster's cluster_ranks)."""
    # Ansible's inventory and the collection's rules load only when asked (the CLI starts fast).
    from ansible.errors import AnsibleError  # noqa: PLC0415
    from ansible.inventory.manager import InventoryManager  # noqa: PLC0415
    from ansible.parsing.dataloader import DataLoader  # noqa: PLC0415
    from ansible.vars.manager import VariableManager  # noqa: PLC0415
    from ansible_collections.llama.cluster.plugins.module_utils.inventory import (  # noqa: PLC0415
        cluster_ranks,
    )

    loader = DataLoader()
    hosts = InventoryManager(loader=loader, sources=[str(inventory)])
    variables = VariableManager(loader=loader, inventory=hosts)
    hostvars = {host.name: variables.get_vars(host=host) for host in hosts.get_hosts()}
    try:
        ranks = cluster_ranks(hosts.get_groups_dict(), hostvars)
    except AnsibleError as err:
        raise InvalidInput(f"{inventory}: {err.message}") from err
    return sorted(ranks, key=ranks.__getitem__)


@contextmanager
def first_nodes(inventory: Path, count: int) -> Iterator[tuple[Path, list[str]]]:
    """A copy of the YAML inventory file `inventory` with its first `count` nodes in node rank
    order (the master first), and their names: what `train --nodes N` trains on, the way out
    the go/no-go names ("fewer nodes"); the copy is removed on the way out."""
    document = _read_yaml(inventory, "training on fewer nodes (--nodes)")
    ranked = ranked_nodes(inventory)
    if not 1 <= count <= len(ranked):
        raise InvalidInput(
            f"--nodes {count}: the inventory {inventory} has {len(ranked)} nodes "
            f"({', '.join(ranked)}); give 1 to {len(ranked)}"
        )
    keep = ranked[:count]
    header = (
        f"# {inventory.name} with its first {count} node(s), for `train --nodes {count}` "
        "(removed after)\n"
    )
    with _copy_beside(inventory, keep_hosts(document, set(keep)), "nodes", header) as copy_path:
        yield copy_path, keep


def pinned(summary: TrainSummary) -> tuple[str | None, dict[str, Any]]:
    """The DeepSpeed stage and the training arguments that run `summary`'s plan again."""
    args: dict[str, Any] = {}
    if summary.per_device_train_batch_size:
        args["per_device_train_batch_size"] = summary.per_device_train_batch_size
    if summary.gradient_accumulation_steps:
        args["gradient_accumulation_steps"] = summary.gradient_accumulation_steps
    if summary.gradient_checkpointing is not None:
        args["disable_gradient_checkpointing"] = not summary.gradient_checkpointing
    if summary.torch_compile is not None:
        args["torch_compile"] = summary.torch_compile
    return summary.deepspeed, args


@dataclass(frozen=True)
class Point:
    """One measured run: its nodes and what it reported."""

    nodes: int
    summary: TrainSummary

    @property
    def tokens_per_s(self) -> float | None:
        return self.summary.tokens_per_s


@dataclass(frozen=True)
class Scaling:
    """The plan measured on the master alone and on every node."""

    one: Point
    every: Point

    @property
    def speedup(self) -> float | None:
        """Every node's tokens/s over the master's alone."""
        if not self.one.tokens_per_s or not self.every.tokens_per_s:
            return None
        return self.every.tokens_per_s / self.one.tokens_per_s

    @property
    def efficiency(self) -> float | None:
        """The share of linear scaling: speedup over the node count."""
        speedup = self.speedup
        return speedup / self.every.nodes if speedup is not None and self.every.nodes else None

    @property
    def pays(self) -> bool | None:
        """Whether every node trains faster than the master alone."""
        speedup = self.speedup
        return speedup > 1.0 if speedup is not None else None

    def lines(self) -> list[str]:
        """The side-by-side figures, as the CLI prints them."""
        rows = []
        for point in (self.one, self.every):
            s = point.summary
            noun = "node" if point.nodes == 1 else "nodes"
            measured = f"{s.tokens_per_s:,.0f}" if s.tokens_per_s else "not measured"
            predicted = (
                f", predicted {s.predicted_tokens_per_s:,.0f}" if s.predicted_tokens_per_s else ""
            )
            loss = f"{s.final_loss:.4f}" if s.final_loss is not None else "-"
            rows.append(
                f"{point.nodes} {noun}: {measured} tokens/s{predicted} (run {s.run_id}, "
                f"world size {s.world_size}, {s.last_step or '-'} steps, final loss {loss})"
            )
        plan = self.every.summary
        rows.insert(
            0,
            f"Plan: {plan.deepspeed}, micro-batch {plan.per_device_train_batch_size} x "
            f"accumulation {plan.gradient_accumulation_steps} per rank",
        )
        if self.efficiency is None:
            rows.append("Scaling: not measured (a run logged no token counts)")
        else:
            verdict = "pays" if self.pays else "does not pay: fewer nodes train faster"
            rows.append(
                f"Scaling: x{self.speedup:.2f} on {self.every.nodes} nodes, "
                f"{self.efficiency:.0%} of linear; adding nodes {verdict}"
            )
        return rows
