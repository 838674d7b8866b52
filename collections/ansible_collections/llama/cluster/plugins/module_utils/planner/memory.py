"""The memory model the planner decides with: GPU memory of a training process by stage,
checkpointing and micro-batch, and the host memory of a node's processes. Both are budgets: a
plan that does not fit either is not chosen.

One process on one GPU is what was measured (`measured_memory`: LLaMA-Factory 0.9.5 on an H200,
46 trained points and 9 out-of-memory ones, BENCHMARKS.md section 5; held-out error within 10 %).
Several processes are extrapolated from it by how each stage splits its per-parameter state
(coefficients: training_memory in group_vars/all/training.yml), not measured beyond the two
2-node DDP points of BENCHMARKS.md section 1:

- none (DDP): every rank holds everything, plus DDP's fp32 gradient buckets (4 bytes/param);
- zero2: the bf16 weights stay whole, the rest (fp32 master weights, gradients, AdamW) is split;
- zero1 (measured as zero2: on one GPU they hold the same): the bf16 weights and gradients stay
  whole, the fp32 master weights and AdamW are split;
- zero2_offload: as zero2 on the GPU; host memory holds 1/world of the optimizer's state;
- zero3: everything per-parameter is split over the world;
- zero3_offload: nothing per-parameter on the GPU; host memory holds 1/world of the offload;
- zero3_hpz (ZeRO++ hpZ): zero3's split over the world, plus a second copy of the bf16 weights
  split over the node's own ranks (the backward gathers them there, not across nodes);
- hsdp (FSDP's hybrid shard): zero3's state split over the node's own ranks only (each node
  holds a whole replica).

The memory-saving techniques (planner/techniques.py: 8-bit AdamW, Liger, QLoRA) were measured
with plain DDP on one GPU (tests/data/cards_grid.json); `technique` is the candidate's.

Fine-tuning `freeze` is planned as LoRA (frozen bf16 bulk; not measured), `zero0` as none,
`fsdp` as zero3 and the hybrid stages from zero3's measured terms as above (measured on the CPU
lab for speed only: bench/links.py, BENCHMARKS.md section 11).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import measured_memory as measured
from .plan import Stage
from .techniques import PLAIN, Technique

GIB = 1024**3
BF16 = 2.0  # bytes of a bf16 weight: what ZeRO-2 keeps whole on every rank


@dataclass(frozen=True)
class Memory:
    """What a run needs on each GPU and on each node, and the budgets it must fit.

    `budget`: bytes one process may allocate on the smallest GPU (its memory less the CUDA
    context, divided by the allocator's headroom: measured_memory.fits); `host_budget`: bytes of
    the smallest node's RAM the training may use; None: not planned for (CPU runs, unknown).
    """

    params: float
    finetuning: str
    shape: Mapping[str, Any] | None
    world: int
    coefficients: Mapping[str, Any]
    budget: float | None
    host_budget: float | None = None
    nproc: int = 1
    technique: Technique = PLAIN
    on_cpu: bool = False  # a CPU cluster: the training itself lives in host memory

    @staticmethod
    def usable(gpu_gib: float) -> float:
        """Bytes a process may allocate on a GPU of `gpu_gib`, as measured_memory.fits counts."""
        c = measured.COEFFICIENTS
        return (gpu_gib * GIB - c["context_gib"] * GIB) / c["allocator_headroom"]

    def _kind(self) -> str:
        return "full" if self.finetuning == "full" else "lora"

    def _coefficients(self, stage: Stage) -> dict[str, float]:
        """measured_memory's coefficients, their per-parameter terms split over the world."""
        c = dict(measured.COEFFICIENTS)
        world = self.world
        if world == 1:
            return c
        group = f"{self._kind()}/{stage.measured}"
        for moment in ("step", "backward"):
            key = f"{moment}/{group}"
            if key not in c:
                continue
            if stage is Stage.HSDP:  # a whole replica per node, split over its ranks
                c[key] = c[key] / max(1, self.nproc)
            elif stage is Stage.ZERO3_HPZ:  # and the node's secondary copy of the bf16 weights
                c[key] = c[key] / world + BF16 / max(1, self.nproc)
            elif stage.measured is Stage.ZERO3:
                c[key] = c[key] / world
            elif stage is Stage.ZERO1:  # the gradients stay whole beside the weights until the step
                c[key] = 2 * BF16 + (c[key] - 2 * BF16) / world
            elif stage.zero == 2:
                c[key] = BF16 + (c[key] - BF16) / world
            elif self._kind() == "full":  # DDP's gradient buckets beside every rank's state
                c[key] = c[key] + float(self.coefficients["ddp_bucket_bytes_per_param"])
        return c

    def measured_shape(self) -> measured.Shape | None:
        """The shape as measured_memory (and the cost model) read it; None when unknown."""
        if self.shape is None:
            return None
        return measured.Shape(
            params=self.params,
            hidden=int(self.shape["hidden"]),
            layers=int(self.shape["layers"]),
            intermediate=int(self.shape.get("intermediate") or 4 * int(self.shape["hidden"])),
            vocab=int(self.shape["vocab"]),
            tied=bool(self.shape.get("tied", False)),
        )

    def state(self, stage: Stage | str) -> float:
        """Bytes at the optimizer step, without activations (all that is known without a shape)."""
        stage = Stage(stage)
        c = self._coefficients(stage)
        if stage.offload_params:
            return c["overhead_gib"] * GIB * c["margin"]
        key = f"step/{self._kind()}/{stage.measured}"
        return (
            c.get(key, c[f"step/{self._kind()}/{Stage.NONE}"]) * self.params
            + c["overhead_gib"] * GIB
        ) * c["margin"]

    def need(self, stage: Stage | str, tokens: int, checkpointing: bool) -> float:
        """Peak bytes one process allocates. While the shape is unknown (no config.json) the
        activations cannot be counted: the state plus unknown_shape_reserve of it stands in."""
        shape = self.measured_shape()
        if shape is None:
            return self.state(stage) * (1 + float(self.coefficients["unknown_shape_reserve"]))
        stage = Stage(stage)
        measured_stage = stage.measured
        kind = self._kind()
        if (
            kind == "lora" and measured_stage is Stage.ZERO2
        ):  # ZeRO-2 splits nothing LoRA holds much of
            measured_stage = Stage.NONE
        return measured.gpu_bytes(
            shape,
            kind,
            measured_stage,
            checkpointing,
            tokens,
            technique=self.technique,
            coefficients=self._coefficients(stage),
        )

    def fits(self, stage: Stage | str, tokens: int, checkpointing: bool) -> bool:
        """Whether that fits the budget (always, without a budget: CPU runs)."""
        return self.budget is None or self.need(stage, tokens, checkpointing) <= self.budget

    def host_need(self, stage: Stage | str) -> float:
        """Bytes of host memory the node's `nproc` training processes hold together: each loads
        the bf16 weights; with zero3_offload each also holds 1/world of the offloaded state,
        with zero2_offload 1/world of the optimizer's state and DeepSpeed's pinned buffers."""
        c = measured.COEFFICIENTS
        per_param, base = c["host.load"], c["host.base_gib"]
        stage = Stage(stage)
        if self.on_cpu:
            per_param = c[f"host.cpu_{self._kind()}"]
        elif stage.offload_params:
            per_param = max(per_param, c[f"host.offload_{self._kind()}"] / self.world)
        elif stage.offload_optimizer:
            per_param = max(per_param, c["host.offload2_full"] / self.world)
            base = c["host.offload2_base_gib"]
        return self.nproc * (base * GIB + per_param * self.params)

    def host_fits(self, stage: Stage | str) -> bool:
        """Whether the node's processes fit its host memory (always, where it is not known)."""
        return self.host_budget is None or self.host_need(stage) <= self.host_budget


def gib_text(value: float | None) -> str:
    return "unknown" if value is None else f"{value / GIB:.1f} GiB"
