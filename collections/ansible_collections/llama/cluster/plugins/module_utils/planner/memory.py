"""The memory model: GPU memory of a training process by stage, checkpointing and micro-batch,
and the host memory of a node's processes (coefficients: training_memory in
group_vars/all/training.yml). Both are budgets: a plan that does not fit either is not chosen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class Memory:
    """Bytes a run needs on each GPU (the fitting formula of BENCHMARKS.md), and its budget."""

    params: float
    finetuning: str
    shape: Mapping[str, int] | None
    world: int
    coefficients: Mapping[str, Any]
    budget: float | None
    host_budget: float | None = None
    nproc: int = 1

    def state(self, stage: str) -> float:
        """Weights, gradients and optimizer states (and DDP's gradient buckets) per GPU."""
        c, n, world = self.coefficients, self.params, self.world
        per_param = float(c["state_bytes_per_param"][self.finetuning])
        if self.finetuning != "full":  # frozen bf16 weights; the adapter's states are small
            if stage in ("zero3", "fsdp"):
                return per_param * n / world + self.gathered()
            return self.gathered() if stage == "zero3_offload" else per_param * n
        if stage in ("none", "zero0"):  # DDP keeps a second copy of the fp32 gradients
            buckets = float(c["ddp_bucket_bytes_per_param"]) * n if world > 1 else 0.0
            return per_param * n + buckets
        if stage == "zero2":  # bf16 weights kept; fp32 master weights, grads and Adam sharded
            return 2 * n + (per_param - 2) * n / world
        if stage in ("zero3", "fsdp"):
            return per_param * n / world + self.gathered()
        return self.gathered()  # zero3_offload: weights and optimizer states in CPU memory

    def gathered(self) -> float:
        """bf16 weights ZeRO-3 gathers at once (stage3_max_live_parameters, at most all)."""
        return 2.0 * min(self.params, float(self.coefficients["zero3_live_params"]))

    def activations(self, tokens: int, checkpointing: bool) -> float | None:
        """Activations and logits of one micro-batch of `tokens` tokens (None: shape unknown)."""
        if self.shape is None:
            return None
        layers, hidden, vocab = self.shape["layers"], self.shape["hidden"], self.shape["vocab"]
        if checkpointing:
            c = self.coefficients["checkpointed_bytes"]
            per_token = (
                c["layer_hidden"] * layers * hidden + c["hidden"] * hidden + c["vocab"] * vocab
            )
        else:
            c = self.coefficients["activation_bytes"]
            per_token = c["layer_hidden"] * layers * hidden + c["vocab"] * vocab
        return float(tokens) * per_token

    def need(self, stage: str, tokens: int, checkpointing: bool) -> float:
        """State plus activations (state alone while the shape is unknown)."""
        return self.state(stage) + (self.activations(tokens, checkpointing) or 0.0)

    def fits(self, stage: str, tokens: int, checkpointing: bool) -> bool:
        """Whether that fits the budget (always, without a budget: CPU runs)."""
        return self.budget is None or self.need(stage, tokens, checkpointing) <= self.budget

    def host_need(self, stage: str) -> float:
        """Bytes of host memory the node's `nproc` training processes hold together.

        Each process: the runtime (torch, CUDA context, LLaMA-Factory, the tokenised data),
        the bf16 weights that pass through host memory while the model loads, and with
        `zero3_offload` its shard of what DeepSpeed keeps in (pinned) host memory: fp32 master
        weights, gradients and AdamW states and the bf16 weights (full), or the frozen bf16
        weights (LoRA, freeze).
        """
        c, n = self.coefficients, self.params
        per_process = float(c["host_process_gib"]) * GIB + float(c["host_load_bytes_per_param"]) * n
        if stage == "zero3_offload":
            offload = float(c["host_offload_bytes_per_param"][self.finetuning])
            per_process += offload * n / self.world
        return self.nproc * per_process

    def host_fits(self, stage: str) -> bool:
        """Whether the node's processes fit its host memory (always, where it is not known)."""
        return self.host_budget is None or self.host_need(stage) <= self.host_budget


def gib_text(value: float | None) -> str:
    return "unknown" if value is None else f"{value / GIB:.1f} GiB"
