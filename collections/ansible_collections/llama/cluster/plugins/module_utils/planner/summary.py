"""The lines train.yml shows before it touches a node (`summary`): the plan in words, with every
decision's reason, the memory and disk figures, and the predicted speed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .disk import disk_summary
from .plan import MemoryPlan, Plan


def _count(params_b: float) -> str:
    """7.62B, 494M, 11,152: a parameter count as people write it."""
    params = params_b * 1e9
    if params >= 1e9:
        return f"{params_b:g}B"
    return f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params:,.0f}"


def summary(
    plan: Plan,
    smallest: Mapping[str, Any] | None,
    smallest_host: Mapping[str, Any] | None = None,
    performance: Sequence[str] = (),
) -> list[str]:
    """The lines train.yml shows before it touches a node."""
    batch = plan.batch
    lines = [
        _model_line(plan),
        f"Nodes {plan.nnodes} x {plan.nproc_per_node} processes = world size "
        f"{plan.world_size} ({plan.accelerator})",
        f"Effective batch {batch.effective} = per-device {batch.micro} x accumulation "
        f"{batch.accumulation} x world size {plan.world_size} ({batch.why})",
        f"Tokens per optimizer step: {batch.tokens_per_step} per process x {plan.world_size}"
        f" = {batch.tokens_per_optimizer_step} "
        + (
            f"(packed rows of {plan.model['cutoff_len']} tokens)"
            if batch.packing
            else f"(at most: samples of up to {plan.model['cutoff_len']} tokens, padded)"
        ),
        f"DeepSpeed: {plan.stage.stage} ({plan.stage.why})",
        f"Memory-saving technique: {plan.technique.why}",
        f"Gradient checkpointing: {'on' if batch.checkpointing else 'off'} "
        f"({batch.checkpointing_why})",
        f"Packing: {'on' if batch.packing else 'off'}; torch.compile: "
        f"{'on' if batch.torch_compile else 'off'} ({batch.compile_why})",
        f"First optimizer step: {batch.first_step}",
    ]
    if plan.technique.fp8:
        lines.append(plan.technique.fp8)
    lines.extend(_memory_lines(plan.memory, smallest, smallest_host))
    lines.extend(performance)
    lines.extend(disk_summary(plan.disk))
    lines.append(f"Restarts after a failure: at most {plan.max_restarts}")
    lines.append("Datasets: " + ", ".join(d.get("name", "") for d in plan.datasets))
    if plan.rules_applied:
        lines.append("Profile rules applied: " + "; ".join(plan.rules_applied))
    return lines


def _model_line(plan: Plan) -> str:
    """Run <id>: <name> (<path>), <fine-tuning>, <size> parameters (<source>)."""
    model = plan.model
    return (
        f"Run {plan.run_id}: {plan.model_name} ({model['path']}), "
        f"{model['finetuning_type']}, {_count(model['params_b'])} parameters "
        f"({model['params_source']})"
        + (
            "; trust_remote_code: the model's own code from its repository runs on every node"
            if model["trust_remote_code"]
            else ""
        )
    )


def _memory_lines(
    memory: MemoryPlan,
    smallest: Mapping[str, Any] | None,
    smallest_host: Mapping[str, Any] | None,
) -> list[str]:
    """The GPU and host memory planned for, the budgets and the needs."""
    lines = []
    if smallest is not None:
        lines.append(
            f"GPU memory planned for: {memory.gpu_gib} GiB per GPU (smallest node: "
            f"{smallest['host']}, {smallest['memory_source']}); budget "
            f"{memory.budget_gib} GiB, estimated need "
            f"{memory.estimate_gib if memory.estimate_gib else 'unknown'} GiB"
        )
    if smallest_host is not None:
        lines.append(
            f"Host memory planned for: {memory.host_gib} GiB per node (smallest node: "
            f"{smallest_host['host']}, {smallest_host.get('host_memory_source', 'as given')}); "
            f"budget {memory.host_budget_gib} GiB, estimated need {memory.host_estimate_gib} GiB"
        )
    elif smallest is not None:
        lines.append(
            "Host memory: not known (facts from before host memory was recorded: run "
            f"provision.yml, or set host_memory_gib); estimated need {memory.host_estimate_gib} "
            "GiB per node"
        )
    return lines
