"""The lines train.yml shows before it touches a node (`summary`): the plan in words, with every
decision's reason, the memory and disk figures, and the predicted speed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .disk import disk_summary


def _count(params_b: float) -> str:
    """7.62B, 494M, 11,152: a parameter count as people write it."""
    params = params_b * 1e9
    if params >= 1e9:
        return f"{params_b:g}B"
    return f"{params / 1e6:.0f}M" if params >= 1e6 else f"{params:,.0f}"


def summary(
    plan: Mapping[str, Any],
    smallest: Mapping[str, Any] | None,
    smallest_host: Mapping[str, Any] | None = None,
    performance: Sequence[str] = (),
) -> list[str]:
    """The lines train.yml shows before it touches a node."""
    model = plan["model"]
    args = plan["train_args"]
    lines = [
        f"Run {plan['run_id']}: {plan['model_name']} ({model['path']}), "
        f"{model['finetuning_type']}, {_count(model['params_b'])} parameters "
        f"({model['params_source']})"
        + (
            "; trust_remote_code: the model's own code from its repository runs on every node"
            if model["trust_remote_code"]
            else ""
        ),
        f"Nodes {plan['nnodes']} x {plan['nproc_per_node']} processes = world size "
        f"{plan['world_size']} ({plan['accelerator']})",
        f"Effective batch {plan['effective_batch']} = per-device "
        f"{args.get('per_device_train_batch_size')} x accumulation "
        f"{args.get('gradient_accumulation_steps')} x world size {plan['world_size']}"
        f" ({plan['decisions']['batch']})",
        f"Tokens per optimizer step: {plan['tokens_per_step']} per process x {plan['world_size']}"
        f" = {plan['tokens_per_optimizer_step']} "
        + (
            f"(packed rows of {model['cutoff_len']} tokens)"
            if plan["packing"]
            else f"(at most: samples of up to {model['cutoff_len']} tokens, padded)"
        ),
        f"DeepSpeed: {plan['deepspeed']} ({plan['decisions']['deepspeed']})",
        f"Memory-saving technique: {plan['decisions']['technique']}",
        f"Gradient checkpointing: {'on' if plan['gradient_checkpointing'] else 'off'} "
        f"({plan['decisions']['checkpointing']})",
        f"Packing: {'on' if plan['packing'] else 'off'}; torch.compile: "
        f"{'on' if plan['torch_compile'] else 'off'} ({plan['decisions']['torch_compile']})",
        f"First optimizer step: {plan['decisions']['first_step']}",
    ]
    if "fp8" in plan["decisions"]:
        lines.append(plan["decisions"]["fp8"])
    if smallest is not None:
        lines.append(
            f"GPU memory planned for: {plan['gpu_memory_gib']} GiB per GPU (smallest node: "
            f"{smallest['host']}, {smallest['memory_source']}); budget "
            f"{plan['memory_budget_gib']} GiB, estimated need "
            f"{plan['memory_estimate_gib'] if plan['memory_estimate_gib'] else 'unknown'} GiB"
        )
    if smallest is not None or smallest_host is not None:
        lines.append(
            f"Host memory planned for: {plan['host_memory_gib']} GiB per node (smallest node: "
            f"{smallest_host['host']}, {smallest_host.get('host_memory_source', 'as given')}); "
            f"budget "
            f"{plan['host_budget_gib']} GiB, estimated need {plan['host_estimate_gib']} GiB"
            if smallest_host is not None
            else "Host memory: not known (facts from before host memory was recorded: run "
            f"provision.yml, or set host_memory_gib); estimated need {plan['host_estimate_gib']} "
            "GiB per node"
        )
    lines.extend(performance)
    lines.extend(disk_summary(plan["disk"]))
    lines.append(f"Restarts after a failure: at most {plan['max_restarts']}")
    lines.append("Datasets: " + ", ".join(d.get("name", "") for d in plan["datasets"]))
    if plan["rules_applied"]:
        lines.append("Profile rules applied: " + "; ".join(plan["rules_applied"]))
    return lines
