"""The run on fewer nodes (`-e min_nodes=N`): planned once at launch, on the controller, for every
count of nodes from N up to the cluster's less one, so that a node lost for good past the
restart window lets the master's llama-job agent continue on the nodes that remain with a plan
made here (the nodes need no planner: the zipapp carries llama_job/ alone).

Each count keeps the run's effective batch (micro-batch x accumulation x processes) through
accumulation, with the largest micro-batch up to the run's that divides it; the planner plans it
again for that many of the nodes with the least memory (the same stage and technique), so its
memory is checked again; a count whose plan does not fit, or whose batch cannot be split, is
refused before launch. A run whose checkpoints are sharded (each node's holds only its own
ranks' state: DeepSpeed, FSDP) cannot go on without a node: refused, naming the way out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from .planner.assembly import assemble
from .planner.errors import PlanError
from .planner.plan import Plan, Request

BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps")


def _split(per_process: int, micro: int) -> tuple[int, int]:
    """(micro-batch, accumulation) whose product is `per_process`, the micro-batch the largest
    divisor of it up to `micro`."""
    best = max(m for m in range(1, min(micro, per_process) + 1) if per_process % m == 0)
    return best, per_process // best


def _least_memory(nodes: Sequence[Mapping[str, Any]], count: int) -> list[Mapping[str, Any]]:
    """The `count` nodes with the least GPU (then host) memory: the plan for any of that many."""

    def memory(node: Mapping[str, Any]) -> tuple[float, float]:
        return (float(node.get("gpu_memory_gib") or 0), float(node.get("host_memory_gib") or 0))

    return sorted(nodes, key=memory)[:count]


def _refused(min_nodes: int, why: str) -> PlanError:
    return PlanError(f"-e min_nodes={min_nodes}: {why} Nothing was changed on any node.")


def plan_fewer_nodes(
    plan: Plan,
    request: Request,
    *,
    model: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
    min_nodes: int,
) -> Plan:
    """The plan with its `min_nodes`, `fewer_nodes` (count: args, note) and its lines on them;
    raises PlanError where a count cannot carry the run."""
    count = plan.nnodes
    if not min_nodes or min_nodes == count:
        return plan
    if not 1 <= min_nodes <= count:
        raise _refused(min_nodes, f"the cluster has {count} node(s); give 1 to {count}.")
    if plan.stage.stage.sharded:
        raise _refused(
            min_nodes,
            f"the plan's {plan.stage.stage} writes checkpoints of which each node holds only its "
            "own ranks' part, so a node lost for good takes its part with it. Train with "
            "-e deepspeed=none (each node's checkpoint whole), or leave min_nodes out.",
        )
    args = plan.train_args
    micro, effective = int(args.get("per_device_train_batch_size", 1)), plan.batch.effective
    nproc, fewer, lines = plan.nproc_per_node, {}, []
    for nnodes in range(min_nodes, count):
        world = nnodes * nproc
        if effective % world:
            raise _refused(
                min_nodes,
                f"the effective batch {effective} cannot be split over {nnodes} node(s) x {nproc} "
                f"process(es); choose a batch that {world} divides (-e tokens_per_step).",
            )
        batch = dict(zip(BATCH_KEYS, _split(effective // world, micro), strict=True))
        asked = replace(
            request,
            stage=plan.stage.stage,
            allow_slow_scaling=True,  # a degraded run: fewer nodes are slower by design
            train_args={**request.train_args, **batch},
        )
        subset = _least_memory(nodes, nnodes)
        ranks = {node["host"]: rank for rank, node in enumerate(subset)}
        try:
            again = assemble(
                asked, model=model, nodes=subset, ranks=ranks, datasets=datasets, settings=settings
            )
        except PlanError as refused:
            why = f"the run on {nnodes} node(s) does not fit: {refused}"
            raise _refused(min_nodes, why) from None
        if again.batch.effective != effective:
            raise _refused(min_nodes, f"the run on {nnodes} node(s) would change its batch.")
        words = ", ".join(f"{k} {args.get(k, 1)} -> {again.train_args[k]}" for k in BATCH_KEYS)
        note = f"{words}: effective batch {again.batch.effective} kept (memory checked again)"
        fewer[str(nnodes)] = {
            "args": [f"{k}={again.train_args[k]}" for k in BATCH_KEYS],
            "note": note,
        }
        lines.append(f"On {nnodes} node(s), should the others stay away: {note}")
    return replace(plan, min_nodes=min_nodes, fewer_nodes=fewer, summary=(*plan.summary, *lines))
