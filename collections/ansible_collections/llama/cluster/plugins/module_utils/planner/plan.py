"""The plan's protocol, as llama_job/protocol.py is the status's: one definition of what a run is
planned as, from the request to the node and back to the user.

- `Stage`: how the model's state is split over the ranks, a closed enum (plain DDP, the DeepSpeed
  ZeRO stages, FSDP) whose members know their ZeRO stage, what they offload, FSDP, hybrid
  sharding, the stage the memory and cost models measured them as, whether their checkpoints
  are sharded, and their configuration file. A stage's name is spelt here and nowhere else
  (tests/unit/project/test_maps.py); Jinja reads the properties from the plan's JSON.
- `search_order`: the stages the search tries, one order per fine-tuning type.
- `Request`: what the planner reads of a checked request; `StageChoice`: the stage, where the
  choice came from and why; `Plan`: the plan, with its technique, batch and memory parts, the
  disk and performance estimates, and a version. `to_dict` is its JSON (plan.json, what the
  action returns); `from_dict` reads any version back (old plans are read here alone);
  `resumed` is the plan of a run continued from its checkpoint.
- `RunReport`: how a finished run went (train.yml's summary, set_stats `llama_run`), read back
  by the API as it is (llama_runner's TrainSummary).

Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from .errors import PlanError

PLAN_VERSION = 2


class Stage(str, Enum):
    """How the model's state is split over the ranks (-e deepspeed, the plan's stage)."""

    NONE = "none"  # plain DDP: every rank holds everything
    ZERO0 = "zero0"  # DDP under DeepSpeed's engine
    ZERO1 = "zero1"  # the optimizer's states split over the ranks
    ZERO2 = "zero2"  # ... and the gradients
    ZERO2_OFFLOAD = "zero2_offload"  # ZeRO-Offload: ZeRO-2, the optimizer in host memory
    ZERO3 = "zero3"  # ... and the weights
    ZERO3_HPZ = "zero3_hpz"  # ZeRO++ hpZ: ZeRO-3, and a copy of the weights split in a node
    ZERO3_OFFLOAD = "zero3_offload"  # ZeRO-3, the optimizer and the weights in host memory
    FSDP = "fsdp"  # FSDP's full shard (planned as ZeRO-3)
    HSDP = "hsdp"  # FSDP's hybrid shard: split inside a node, replicated across nodes

    def __str__(self) -> str:
        return self.value

    @property
    def zero(self) -> int | None:
        """DeepSpeed's ZeRO stage, None where DeepSpeed does not train (DDP, FSDP)."""
        return int(self.value[4]) if self.value.startswith("zero") else None

    @property
    def fsdp(self) -> bool:
        """Whether FSDP trains it (fsdp_config.json, accelerate's FSDP)."""
        return self in (Stage.FSDP, Stage.HSDP)

    @property
    def hybrid(self) -> bool:
        """Whether it shards inside a node and replicates across nodes: it needs several nodes
        of several ranks each."""
        return self in (Stage.ZERO3_HPZ, Stage.HSDP)

    @property
    def offload_optimizer(self) -> bool:
        """Whether the optimizer (fp32 master weights, AdamW) lives in host memory."""
        return self in (Stage.ZERO2_OFFLOAD, Stage.ZERO3_OFFLOAD)

    @property
    def offload_params(self) -> bool:
        """Whether the weights live in host memory too."""
        return self is Stage.ZERO3_OFFLOAD

    @property
    def cost(self) -> Stage:
        """The stage the cost model times it as: ZeRO-0 as DDP, the hybrid stages and FSDP as
        ZeRO-3 (planner/cost.py adds what the hybrid ones move across nodes)."""
        if self is Stage.ZERO0:
            return Stage.NONE
        return Stage.ZERO3 if self.hybrid or self.fsdp else self

    @property
    def measured(self) -> Stage:
        """The stage the memory model measured it as: the cost model's, ZeRO-1 as ZeRO-2 (on
        one GPU they hold the same; planner/memory.py splits them over several)."""
        return Stage.ZERO2 if self is Stage.ZERO1 else self.cost

    @property
    def flat(self) -> Stage:
        """The same sharding over every rank: a hybrid stage's one-level twin."""
        return {Stage.HSDP: Stage.FSDP, Stage.ZERO3_HPZ: Stage.ZERO3}.get(self, self)

    @property
    def sharded(self) -> bool:
        """Whether each node's checkpoint holds its own ranks' state alone (DeepSpeed's per-rank
        files, FSDP's shards): no node can stand in for another (llama_job/resume.py)."""
        return self is not Stage.NONE

    @property
    def config(self) -> str:
        """The configuration file of the run directory that trains it ("" for none)."""
        return (
            "ds_config.json" if self.zero is not None else "fsdp_config.json" if self.fsdp else ""
        )

    @property
    def environment(self) -> dict[str, str]:
        """What every rank's environment needs. hsdp: accelerate 1.11 takes FSDP's sharding
        strategy from FSDP_SHARDING_STRATEGY (default FULL_SHARD) and ignores the hybrid_shard
        that transformers 5.6 passes it from train.yaml (measured on the lab: without it every
        rank shards over the whole world)."""
        return {"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"} if self is Stage.HSDP else {}

    def properties(self) -> dict[str, Any]:
        """Its JSON in a plan: the name and what Jinja reads instead of the name."""
        keys = ("zero", "fsdp", "hybrid", "offload_optimizer", "offload_params", "sharded")
        return {"name": self.value, **{k: getattr(self, k) for k in keys}, "config": self.config}


# The stages the search tries, in the order that ranks them where the cost model does not apply
# (a model of unknown shape: the first that fits): the least sharding first, offload last. ZeRO-1
# and ZeRO-2 split nothing a LoRA (or freeze) run holds much of, so those skip them; the hybrid
# stages are candidates only where several nodes run several ranks each (search.py).
_FULL_ORDER = (Stage.NONE, Stage.ZERO1, Stage.ZERO2, Stage.ZERO3, Stage.ZERO3_HPZ, Stage.HSDP,
               Stage.ZERO2_OFFLOAD, Stage.ZERO3_OFFLOAD)  # fmt: skip
_ADAPTER_ORDER = (Stage.NONE, Stage.ZERO3, Stage.ZERO3_OFFLOAD)


def search_order(finetuning: str) -> tuple[Stage, ...]:
    """The stages a run of this fine-tuning type may be planned with, in order."""
    return _FULL_ORDER if finetuning == "full" else _ADAPTER_ORDER


def stage_of(value: object) -> Stage | None:
    """The stage a request names; None for auto (the planner chooses)."""
    text = str(value or "auto")
    return None if text == "auto" else Stage(text)


@dataclass(frozen=True)
class Request:
    """What the planner reads of a request that schema.check_request passed (the model's own
    settings went into the resolved model)."""

    model: str | None
    stage: Stage | None  # None: auto
    train_args: Mapping[str, Any]
    tokens_per_step: int
    numerics: str = "measured"
    quantization_bit: int = 0
    fp8: bool = False
    allow_slow_scaling: bool = False
    max_restarts: int = 0
    dataset_records: int | None = None
    timestamp: str = "now"

    @classmethod
    def of(cls, checked: Mapping[str, Any]) -> Request:
        """From check_request's mapping (its values coerced there; its deepspeed is the stage)."""
        given = {f.name: checked[f.name] for f in fields(cls) if checked.get(f.name) is not None}
        given["model"] = checked.get("model") or None
        return cls(**{**given, "stage": stage_of(checked.get("deepspeed"))})


@dataclass(frozen=True)
class StageChoice:
    """The stage, where the choice came from and why. `source`: asked (-e deepspeed), rule (a
    profile rule's deepspeed), search (the cost model's fastest), order (the first of the search
    order that fits: no cost model), cpu (a CPU cluster trains with plain DDP)."""

    stage: Stage
    source: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.stage.properties(), "source": self.source, "why": self.why}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageChoice:
        return cls(Stage(data["name"]), str(data.get("source", "")), str(data.get("why", "")))


@dataclass(frozen=True)
class TechniquePlan:
    """The memory-saving technique (planner/techniques.py), the numerics policy and FP8."""

    optim: str = "adamw_torch"
    liger: bool = False
    quantization_bit: int = 0
    label: str = "none"
    numerics: str = "measured"
    numerics_changes: tuple[str, ...] = ()
    why: str = ""
    fp8: str = ""  # the plan's line about FP8, "" where the run trains without it


@dataclass(frozen=True)
class BatchPlan:
    """The batch each process trains on, and the choices that shape its step."""

    micro: int
    accumulation: int
    effective: int  # micro x accumulation x world size: rows (or samples) per optimizer step
    tokens_per_step: int  # one process's per optimizer step: micro x accumulation x cutoff_len
    tokens_per_optimizer_step: int
    packing: bool
    checkpointing: bool
    torch_compile: bool
    steps: int | None = None  # optimizer steps estimated (None: not known)
    why: str = ""
    checkpointing_why: str = ""
    compile_why: str = ""
    first_step: str = ""  # the time to the first optimizer step, in words


@dataclass(frozen=True)
class MemoryPlan:
    """The GPU and host memory planned for (GiB): the smallest node's, the budget, the need; and
    where each node's figures came from."""

    gpu_gib: float | None = None
    budget_gib: float | None = None
    estimate_gib: float | None = None
    host_gib: float | None = None
    host_budget_gib: float | None = None
    host_estimate_gib: float | None = None
    nodes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """A run as planned: what every node renders and runs (roles/run_config, roles/job)."""

    run_id: str
    model_name: str | None
    model: Mapping[str, Any]  # as model.resolve_model made it; `path` is its path on every node
    datasets: tuple[Mapping[str, Any], ...]
    stage: StageChoice
    technique: TechniquePlan
    batch: BatchPlan
    memory: MemoryPlan
    accelerator: str
    nnodes: int
    nproc_per_node: int
    world_size: int
    ranks: Mapping[str, int]
    train_args: Mapping[str, Any]
    environment: Mapping[str, str] = field(default_factory=dict)
    disk: Mapping[str, Any] = field(default_factory=dict)  # planner/disk.py's disk_estimate
    performance: Mapping[str, Any] = field(default_factory=dict)  # planner/search.py's assess
    rules_applied: tuple[str, ...] = ()
    max_restarts: int = 0
    resume: bool = False
    model_stage: Mapping[str, Any] | None = None  # roles/model_stage's request (the action's)
    # -e min_nodes (0: every node) and the run planned on each count of nodes from it
    # (module_utils/fewer_nodes.py): {"<count>": {"args": [...], "note": ...}}.
    min_nodes: int = 0
    fewer_nodes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    summary: tuple[str, ...] = ()  # the lines shown before launch
    version: int = PLAN_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON (plan.json)."""
        data = asdict(self)
        data["stage"] = self.stage.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A plan from its JSON, of this version or an older one (the one place old plans are
        read); a newer one is refused."""
        version = int(data.get("version") or 1)
        if version > PLAN_VERSION:
            raise PlanError(
                f"The run's plan.json is of version {version}; this release reads plans up to "
                f"version {PLAN_VERSION}. Continue the run with the release that started it."
            )
        if version == 1:
            data = _from_version_1(data)
        parts = {"technique": TechniquePlan, "batch": BatchPlan, "memory": MemoryPlan}
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["stage"] = StageChoice.from_dict(data["stage"])
        for key, part in parts.items():
            names = {f.name for f in fields(part)}
            values[key] = part(**{k: v for k, v in data[key].items() if k in names})
        technique = values["technique"]
        values["technique"] = replace(technique, numerics_changes=tuple(technique.numerics_changes))
        for key in ("datasets", "rules_applied", "summary"):
            values[key] = tuple(values.get(key) or ())
        return cls(**values)

    def resumed(self, max_restarts: int) -> Plan:
        """The plan of this run continued from its checkpoint: the model is where the first
        launch put it (roles/model_stage only checks it is there), and the job may restart
        max_restarts times (the value checked now, not the first launch's)."""
        stage = {"kind": "shared", "name": self.model_name, "path": self.model["path"]}
        return replace(self, resume=True, max_restarts=int(max_restarts), model_stage=stage)


# Where a plan.json of version 1 (flat: deepspeed, effective_batch, decisions, ...) kept what
# this version's parts hold: part -> {field: its key, or ("decisions", its reason's key)}.
_VERSION_1 = {
    "batch": {
        "effective": "effective_batch", "tokens_per_step": "tokens_per_step",
        "tokens_per_optimizer_step": "tokens_per_optimizer_step", "packing": "packing",
        "checkpointing": "gradient_checkpointing", "torch_compile": "torch_compile",
        "why": ("decisions", "batch"), "checkpointing_why": ("decisions", "checkpointing"),
        "compile_why": ("decisions", "torch_compile"), "first_step": ("decisions", "first_step"),
    },
    "memory": {
        "gpu_gib": "gpu_memory_gib", "budget_gib": "memory_budget_gib",
        "estimate_gib": "memory_estimate_gib", "host_gib": "host_memory_gib",
        "host_budget_gib": "host_budget_gib", "host_estimate_gib": "host_estimate_gib",
        "nodes": "nodes",
    },
    "technique": {"numerics": "numerics", "why": ("decisions", "technique"),
                  "fp8": ("decisions", "fp8")},
}  # fmt: skip


def _from_version_1(old: Mapping[str, Any]) -> dict[str, Any]:
    """A plan.json written before plans had a version, in this version's shape (its `sharded`
    is its stage's)."""
    decisions = old.get("decisions") or {}

    def value(key: str | tuple[str, str]) -> object:
        return old.get(key) if isinstance(key, str) else decisions.get(key[1], "")

    parts = {part: {f: value(k) for f, k in keys.items() if value(k) is not None}
             for part, keys in _VERSION_1.items()}  # fmt: skip
    args = old.get("train_args") or {}
    parts["batch"]["micro"] = int(args.get("per_device_train_batch_size", 1))
    parts["batch"]["accumulation"] = int(args.get("gradient_accumulation_steps", 1))
    steps = str(decisions.get("estimated_steps", ""))
    parts["batch"]["steps"] = int(steps) if steps.isdigit() else None
    parts["technique"].update(old.get("technique") or {})
    why = decisions.get("deepspeed", "")
    return {**old, **parts, "stage": {"name": old["deepspeed"], "source": "asked", "why": why}}


@dataclass(frozen=True)
class RunReport:
    """How a finished run went: what train.yml prints and hands to ansible-runner (set_stats
    `llama_run`), read back by the API as it is (llama_runner's TrainSummary)."""

    run_id: str
    world_size: int | None = None
    # Every node's processes by their global ranks (torchrun's RANK): host -> ranks.
    ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    effective_batch_size: int | None = None
    runtime_s: float | None = None
    final_loss: float | None = None
    last_step: int | None = None
    output_dir: str | None = None
    checkpoints: tuple[str, ...] = ()
    controller_dir: Path | None = None
    loss_plot: Path | None = None  # None: no plot came back
    tokens_per_s: float | None = None  # measured: the trainer log's tokens over its time
    predicted_tokens_per_s: float | None = None  # the planner's (GPU plans only)
    # The plan's choices, so that the same plan can run elsewhere (llama_runner's scaling).
    nnodes: int | None = None
    deepspeed: Stage | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool | None = None
    torch_compile: bool | None = None
    # What did not fail the run (a failure in teardown after every rank finished), and the
    # nodes its last attempt ran without (-e min_nodes).
    warnings: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("controller_dir", "loss_plot"):  # paths given as text (JSON, the filters)
            value = getattr(self, name)
            object.__setattr__(self, name, Path(value) if value else None)

    @classmethod
    def of(cls, plan: Plan, **measured: Any) -> RunReport:  # noqa: ANN401 - the fields above
        """The report of a run of `plan`, with what the run measured and left (the other
        fields)."""
        return cls(
            run_id=plan.run_id,
            world_size=plan.world_size,
            effective_batch_size=plan.batch.effective,
            predicted_tokens_per_s=plan.performance.get("tokens_per_s"),
            nnodes=plan.nnodes,
            deepspeed=plan.stage.stage,
            per_device_train_batch_size=plan.batch.micro,
            gradient_accumulation_steps=plan.batch.accumulation,
            gradient_checkpointing=plan.batch.checkpointing,
            torch_compile=plan.batch.torch_compile,
            **measured,
        )

    def to_dict(self) -> dict[str, Any]:
        """Its JSON (the stage as its name)."""
        data = asdict(self)
        data["deepspeed"] = self.deepspeed.value if self.deepspeed else None
        data["controller_dir"] = str(self.controller_dir) if self.controller_dir else None
        data["loss_plot"] = str(self.loss_plot) if self.loss_plot else None
        data["ranks"] = {host: list(ranks) for host, ranks in self.ranks.items()}
        for key in ("checkpoints", "warnings", "left_out"):
            data[key] = list(getattr(self, key))
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunReport:
        """The report from its JSON (keys it does not know are left out)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["deepspeed"] = Stage(data["deepspeed"]) if data.get("deepspeed") else None
        values["ranks"] = {
            str(host): tuple(int(r) for r in ranks or ())
            for host, ranks in (data.get("ranks") or {}).items()
        }
        for key in ("checkpoints", "warnings", "left_out"):
            values[key] = tuple(str(c) for c in data.get(key) or ())
        return cls(**values)

    def lines(
        self,
        ranks: str,
        master: str,
        *,
        adapter: bool,
        failed: Sequence[str],
        allowed: int,
        without: str = "",
    ) -> list[str]:
        """What the play prints: `ranks` every node's ranks in words, `master` where the output
        is, `adapter` whether it is a LoRA adapter, `failed` the node that failed before each
        restart, `allowed` the restarts allowed and `without` how the run went on without the
        nodes it left out (min_nodes)."""
        return [
            f"Run {self.run_id} finished: world size {self.world_size}, effective batch "
            f"{self.effective_batch_size}",
            f"Ranks: {ranks or 'not named'}",
            f"Runtime {self.runtime_s} s, {self.last_step} steps, final loss {self.final_loss}",
            f"Tokens/s: {self.tokens_per_s or 'not'} measured, "
            f"{self.predicted_tokens_per_s or 'not'} predicted",
            f"{'Adapter' if adapter else 'Model'} and checkpoints on {master}: {self.output_dir}",
            "Checkpoints: " + (", ".join(c.rsplit("/", 1)[-1] for c in self.checkpoints) or "none"),
            f"Logs and loss plot: {self.controller_dir}/ (plot: {self.loss_plot or 'none'})",
            f"Restarts: {len(failed)} of {allowed} ({', '.join(failed)} failed)"
            if failed
            else "Restarts: none",
            f"Ran without: {', '.join(self.left_out) or 'none'}"
            + (f" ({without})" if self.left_out and without else ""),
            f"Warnings: {'; '.join(self.warnings) or 'none'}",
        ]
