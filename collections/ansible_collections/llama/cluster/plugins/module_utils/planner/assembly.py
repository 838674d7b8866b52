"""The plan put together: `assemble` is a pipeline over one context (`Assembly`): the stage
(decisions.choose_stage, over the search's candidates), the memory-saving technique, the batch
and the training arguments, then the plan (plan.Plan) with its prediction, disk estimate and
the lines shown before launch. `plan` does the same from a request as the user gave it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .cost import step_cost
from .decisions import (
    Batch,
    BatchRequest,
    check_cpu_batch,
    check_dataset_batch,
    choose_batch,
    choose_compile,
    choose_fp8,
    choose_stage,
    estimate_steps,
    first_step,
    fp8_pays,
    hybrid_applies,
    step_rows,
)
from .disk import disk_estimate
from .errors import TRAINING_FILE, PlanError
from .links import run_link
from .memory import GIB, Memory, gib_text
from .model import find_model, resolve_model
from .nodes import check_nodes, emulated_nodes
from .plan import (
    BatchPlan,
    MemoryPlan,
    Plan,
    Request,
    Stage,
    StageChoice,
    TechniquePlan,
    search_order,
    stage_of,
)
from .rules import apply_rules, check_rules
from .schema import Settings, check_project_settings, check_request
from .search import Cluster, Option, Search, Tries, assess, check_size, ranked
from .summary import summary
from .techniques import (
    NUMERICS_EVIDENCE,
    PLAIN,
    Technique,
    available_packages,
    candidates,
    check_quantization,
)

# A new run's id: train-<UTC start, to the second>-<model>.
RUN_STAMP = "%Y%m%d-%H%M%S"


def new_run_id(stamp: str, model: str | None) -> str:
    """The id of a new run of `model` started at `stamp` (RUN_STAMP)."""
    return f"train-{stamp}-" + re.sub(r"[^A-Za-z0-9_-]+", "-", str(model or "model"))


@dataclass(frozen=True)
class Assembly:
    """What a plan is assembled from, and each step's result as the pipeline goes."""

    request: Request
    model: Mapping[str, Any]
    nodes: Sequence[Mapping[str, Any]]
    ranks: Mapping[str, int]
    datasets: Sequence[Mapping[str, Any]]
    settings: Settings
    accelerator: str
    nproc: int
    world: int
    memory: Memory
    facts: Mapping[str, Any]  # what the profile rules test, the stage left out
    cluster: Cluster
    available: frozenset[str]
    smallest: tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]  # by GPU, by host memory
    search: Search | None = None
    choice: StageChoice | None = None
    applied: tuple[str, ...] = ()
    explicit: Mapping[str, Any] = field(default_factory=dict)  # rules < catalogue < train_args
    cost: Callable[[Batch], float] | None = None
    uncompiled: Callable[[Batch], float] | None = None  # the cost with the technique uncompiled
    args: Mapping[str, Any] = field(default_factory=dict)
    batch: Batch | None = None
    why: Mapping[str, str] = field(default_factory=dict)  # BatchPlan's reasons, in words
    steps: int | None = None
    fp8: str = ""  # the plan's line about FP8, "" without it
    environment: Mapping[str, str] = field(default_factory=dict)  # what FP8 needs

    @property
    def stage(self) -> Stage:
        assert self.choice is not None
        return self.choice.stage

    @property
    def cutoff(self) -> int:
        return int(self.model["cutoff_len"])


def plan(
    request: Mapping[str, Any],
    *,
    nodes: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> Plan:
    """The run of a request as the user gave it: checked, its model found in the catalogue and
    resolved, then assembled (llama.cluster.run_plan does the same steps with the model staged
    in between).

    `settings`: catalogue, defaults, rules, memory, compile and stages (see Settings).
    """
    entry, problems = find_model(
        settings["catalogue"], request.get("model"), request.get("model_path")
    )
    checked = check_request(request, settings["stages"], problems)
    return assemble(
        Request.of(checked),
        model=resolve_model(checked, entry),
        nodes=nodes,
        ranks=ranks,
        datasets=datasets,
        settings=settings,
    )


def assemble(
    request: Request,
    *,
    model: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any] | Settings,
) -> Plan:
    """The run of a request that check_request has passed, for the model that resolve_model
    gave (see plan): the model goes into the plan as it is, with its path on every node."""
    data = settings if isinstance(settings, Settings) else Settings(**settings)
    context = _begin(request, model=model, nodes=nodes, ranks=ranks, datasets=datasets, data=data)
    context = _stage(context)
    context = _technique(context)
    context = _batch(context)
    return _plan(context)


def _smallest(
    nodes: Sequence[Mapping[str, Any]], key: str = "gpu_memory_gib"
) -> Mapping[str, Any] | None:
    known = [n for n in nodes if n.get(key) is not None]
    return min(known, key=lambda n: n[key]) if known else None


def _begin(
    request: Request,
    *,
    model: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    data: Settings,
) -> Assembly:
    """The context: the nodes, rules and settings checked, the memory model of the smallest
    node, what the rules test, the link, and the optional packages every node has."""
    accelerator, nproc, world = check_nodes(nodes)
    check_rules(data.rules)
    check_project_settings(data, model)
    smallest, smallest_host = _smallest(nodes), _smallest(nodes, "host_memory_gib")
    gib = smallest["gpu_memory_gib"] if smallest else None
    host_gib = smallest_host["host_memory_gib"] if smallest_host else None
    memory = Memory(
        params=float(model["params_b"]) * 1e9,
        finetuning=model["finetuning_type"],
        shape=model["shape"],
        world=world,
        coefficients=data.memory,
        budget=Memory.usable(gib) if gib else None,
        host_budget=(
            host_gib * GIB * float(data.memory["host_usable_fraction"]) if host_gib else None
        ),
        nproc=nproc,
        on_cpu=accelerator == "cpu",
    )
    _check_hybrid(request.stage, memory, len(nodes))
    facts = {
        "accelerator": accelerator,
        "finetuning_type": model["finetuning_type"],
        "model": request.model,
        "stage": request.train_args.get("stage")
        or (model.get("train_args") or {}).get("stage")
        or data.defaults.get("stage"),
        "params_b": float(model["params_b"]),
        "world_size": world,
        "nnodes": len(nodes),
        "gpu_memory_gib": gib,
        "cutoff_len": model["cutoff_len"],
    }
    link, note = run_link(nodes) if accelerator != "cpu" else (None, "CPU cluster")
    available = available_packages(nodes)
    if request.quantization_bit:
        check_quantization(request, model, nodes, accelerator, available)
    cluster = Cluster(
        link=link,
        link_note=note,
        nnodes=len(nodes),
        nproc=nproc,
        allow_slow=request.allow_slow_scaling,
        model_name=request.model,
    )
    return Assembly(request, model, nodes, ranks, datasets, data, accelerator, nproc, world,
                    memory, facts, cluster, available, (smallest, smallest_host))  # fmt: skip


def _check_hybrid(asked: Stage | None, memory: Memory, nnodes: int) -> None:
    """A hybrid stage asked for where it has nothing to split between inside a node and across
    nodes: refused, naming what it needs and what to ask instead."""
    if asked is not None and asked.hybrid and not hybrid_applies(memory):
        raise PlanError(
            f"deepspeed={asked} shards inside a node and replicates across nodes: it needs "
            f"several nodes of several processes each, and this cluster is {nnodes} node(s) x "
            f"{memory.nproc} process(es). Ask for deepspeed={asked.flat} (the same sharding over "
            "every rank), or leave deepspeed to the planner. Nothing was changed on any node."
        )


# ---- the stage ------------------------------------------------------------------------------
def _asked(context: Assembly) -> StageChoice | None:
    """The stage asked for: -e deepspeed, else a profile rule's (read before the stage is
    known, so such a rule cannot test deepspeed); None: the planner chooses."""
    request = context.request
    if request.stage is not None:
        return StageChoice(request.stage, "asked", f"deepspeed={request.stage} given")
    ruled, _ = apply_rules(context.settings.rules, context.facts)
    if "deepspeed" not in ruled:
        return None
    try:
        stage = stage_of(ruled["deepspeed"])
    except ValueError:
        stage = None
    if stage is None:
        raise PlanError(
            f"A profile rule in {TRAINING_FILE} sets deepspeed={ruled['deepspeed']}; use one "
            f"of: {', '.join(s.value for s in Stage)}."
        )
    return StageChoice(stage, "rule", f"deepspeed={stage} set by a profile rule in {TRAINING_FILE}")


def _stage(context: Assembly) -> Assembly:
    """The stage (one mechanism: decisions.choose_stage over the search's candidates), and the
    profile rules' settings for it."""
    asked = _asked(context)
    search = _searched(context, asked.stage if asked else None)
    memory = context.memory
    choice = choose_stage(
        memory,
        search,
        asked,
        cutoff=context.cutoff,
        accelerator=context.accelerator,
        nnodes=len(context.nodes),
        numerics=context.request.numerics,
    )
    profile, applied = apply_rules(
        context.settings.rules, {**context.facts, "deepspeed": choice.stage}
    )
    profile.pop("deepspeed", None)
    if memory.on_cpu and not memory.host_fits(choice.stage):
        raise PlanError(_cpu_memory_refusal(memory, context.smallest[1]))
    return replace(
        context,
        search=search,
        choice=choice,
        applied=tuple(applied),
        explicit=_explicit(context, profile),
    )


def _explicit(context: Assembly, profile: Mapping[str, Any]) -> dict[str, Any]:
    """The training arguments someone set: the profile rules < the catalogue < -e train_args."""
    model_args = context.model.get("train_args") or {}
    explicit = {**profile, **model_args, **context.request.train_args}
    explicit.pop("cutoff_len", None)  # model.cutoff_len holds it
    explicit.pop("deepspeed", None)
    return explicit


def _batch_request(context: Assembly, explicit: Mapping[str, Any]) -> BatchRequest:
    """What the batch rule starts from, for these explicit arguments."""
    defaults = context.settings.defaults
    ckpt = explicit.get("disable_gradient_checkpointing")
    return BatchRequest(
        cutoff=context.cutoff,
        tokens_per_step=context.request.tokens_per_step,
        packing=bool({**defaults, **explicit}.get("packing", False)),
        micro=explicit.get("per_device_train_batch_size"),
        accumulation=explicit.get("gradient_accumulation_steps"),
        checkpointing=None if ckpt is None else not ckpt,
        default_micro=int(defaults.get("per_device_train_batch_size", 1)),
        default_accumulation=int(defaults.get("gradient_accumulation_steps", 1)),
    )


def _tries(context: Assembly, stages: Sequence[Stage], *, fallback: bool = False) -> Tries:
    """The techniques each stage tries (planner/techniques.py), less those a setting of the
    user's excludes: an optimizer or Liger set in train_args is kept as set."""
    explicit = _explicit(context, {})
    liger = explicit.get("enable_liger_kernel")

    def kept(t: Technique) -> bool:
        return explicit.get("optim", t.optim) == t.optim and liger in (None, t.liger)

    how = {
        "numerics": context.request.numerics,
        "quantization": context.request.quantization_bit,
        "available": context.available,
        "fallback": fallback,
        # torch.compile's twins, unless train_args sets torch_compile (then kept as set)
        "compiling": "torch_compile" not in explicit,
    }
    finetuning = context.memory.finetuning
    return {
        stage: tuple(t for t in candidates(finetuning, stage, **how) if kept(t)) for stage in stages
    }


def _searched(context: Assembly, asked: Stage | None) -> Search | None:
    """The candidates of every stage of the search order (or the one asked for) and their
    techniques, ranked by the cost model; where a LoRA run's bf16 weights fit the GPU with no
    stage (only offloaded to the host), QLoRA's candidates too (unless numerics is exact);
    None where the search does not apply (CPUs, a model of unknown shape)."""
    memory = context.memory
    shape = memory.measured_shape()
    if memory.budget is None or shape is None:
        return None
    stages = search_order(memory.finetuning) if asked is None else (asked,)
    asks = {}
    for stage in stages:
        profile, _ = apply_rules(context.settings.rules, {**context.facts, "deepspeed": stage})
        asks[stage] = _batch_request(context, _explicit(context, profile))
    merged = {**context.settings.defaults, **_explicit(context, {})}
    rank = int(merged.get("lora_rank") or 8)
    link = context.cluster.link
    tries = _tries(context, stages)
    options, skipped = ranked(memory, asks, shape, link, rank, tries=tries)
    options = _repaid(context, options, asks.get(Stage.NONE) or next(iter(asks.values())))
    # Scaling and the ways out re-rank these techniques on other nodes: only the compiled twins
    # whose compilation this run repays.
    kept = {o.technique for o in options}
    tries = {s: tuple(t for t in ts if not t.compiled or t in kept) for s, ts in tries.items()}
    if any(not o.stage.offload_params for o in options) or context.request.quantization_bit:
        return Search(asks, shape, rank, options, skipped, tries)
    # The bf16 weights fit the GPU with no stage: QLoRA's 4-bit ones compete with the offload.
    extra = _tries(context, stages, fallback=True)
    quantized, _ = ranked(memory, asks, shape, link, rank, tries=extra)
    if not quantized:
        return Search(asks, shape, rank, options, skipped, tries)
    both = sorted([*options, *quantized], key=lambda o: o.cost.total / o.cost.tokens)
    merged_tries = {stage: tries[stage] + extra[stage] for stage in stages}
    fallback = bool(both[0].technique.quant)
    return Search(asks, shape, rank, both, skipped, merged_tries, fallback=fallback)


def _repaid(context: Assembly, options: list[Option], ask: BatchRequest) -> list[Option]:
    """The candidates uncompiled, or compiled where the run repays the compilation
    (choose_compile, from the step time of the uncompiled twin)."""
    merged = {**context.settings.defaults, **_explicit(context, {})}
    rows = {"per_device_train_batch_size": step_rows(ask), "gradient_accumulation_steps": 1}
    steps = estimate_steps(
        {**merged, **rows, "packing": ask.packing},
        records=context.request.dataset_records,
        world=context.world,
        cutoff=ask.cutoff,
        record_tokens=int(context.settings.compile["record_tokens"]),
    )
    memory, link = context.memory, context.cluster.link
    shape = memory.measured_shape()

    def repays(option: Option) -> bool:
        if not option.technique.compiled:
            return True
        twin = replace(option.setup, technique=option.technique.uncompiled)
        use, _ = choose_compile(
            "gpu",
            option.stage,
            steps,
            context.settings.compile,
            step_seconds=step_cost(shape, twin, world=memory.world, link=link).total,
            finetuning=memory.finetuning,
            technique=option.technique,
        )
        return use

    return [o for o in options if repays(o)]


def _cpu_memory_refusal(memory: Memory, node: Mapping[str, Any] | None) -> str:
    """Why a CPU run does not fit the node with the least memory, and the ways out."""
    where = (
        f"{node['host']} ({node.get('host_memory_source', 'as given')})"
        if node
        else "the smallest node"
    )
    fits = int((memory.host_budget or 0) // (memory.host_need(Stage.NONE) / memory.nproc))
    ways = [
        f"train {fits} process{'es' if fits > 1 else ''} per node (-e nproc_per_node={fits} fits)"
        if fits
        else "train fewer processes per node (not even one fits now)"
    ]
    if memory.finetuning == "full" and replace(memory, finetuning="lora").host_fits(Stage.NONE):
        ways.append("LoRA (-e finetuning_type=lora)")
    return (
        f"The run does not fit the nodes' memory: its {memory.nproc} training processes per node "
        f"need about {gib_text(memory.host_need(Stage.NONE))} (the weights, what the optimizer "
        f"updates, and each process's own), and {where} has {gib_text(memory.host_budget)} to "
        f"give. Free memory there, {', '.join(ways)}, or a smaller model. Nothing was changed "
        "on any node."
    )


# ---- the technique --------------------------------------------------------------------------
def _technique(context: Assembly) -> Assembly:
    """The technique of the fastest candidate of the chosen stage (plain where none), the memory
    model with it, and the cost of a batch under both; FP8 where asked."""
    search, stage = context.search, context.stage
    technique = PLAIN
    if search is not None:
        technique = next((o.technique for o in search.options if o.stage is stage), PLAIN)
    memory = replace(context.memory, technique=technique)
    if search is None:
        return replace(context, memory=memory)
    twin = replace(memory, technique=technique.uncompiled)
    link = context.cluster.link
    cost = search.cost_function(memory, stage, context.cutoff, link)
    uncompiled = search.cost_function(twin, stage, context.cutoff, link)
    return replace(context, memory=memory, cost=cost, uncompiled=uncompiled)


def _technique_line(context: Assembly) -> str:
    """What the plan prints about the technique and the run's numerics."""
    search, technique = context.search, context.memory.technique
    if search is None:
        return "none (the search does not apply: no techniques planned)"
    changes = technique.numerics_changes()
    if technique.plain:
        text = "none: the plain run is the fastest predicted that fits"
    elif search.fallback:
        text = (
            f"{technique.label()}: chosen by the planner because the bf16 weights fit the GPU "
            f"with no stage but {Stage.ZERO3_OFFLOAD}, which the cost model predicts slower"
        )
    else:
        text = f"{technique.label()}: the fastest predicted candidate that fits"
    if changes:
        evidence = NUMERICS_EVIDENCE["qlora" if technique.quant else technique.optim]
        text += (
            f". Numerics: changes {', '.join(changes)} ({evidence}); -e numerics=exact forbids "
            "every numerics change"
        )
    elif context.request.numerics == "exact":
        text += ". Numerics: exact (no numerics change allowed, -e numerics=exact)"
    missing = sorted({"bitsandbytes", "liger-kernel"} - set(context.available))
    if missing:
        text += (
            f". Not considered: what needs {', '.join(missing)}, which not every node has "
            "(provision.yml installs them)"
        )
    return text


# ---- the batch and the training arguments ---------------------------------------------------
def _batch(context: Assembly) -> Assembly:
    """The training arguments: defaults < computed (batch, checkpointing, compile) < explicit;
    FP8 where asked; the batch checked against the memory and the dataset."""
    context = _computed(context)
    args, fp8, environment = _fp8(context)
    request, memory = context.request, context.memory
    micro = int(args.get("per_device_train_batch_size", 1))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    if context.accelerator == "cpu":
        check_cpu_batch(
            _cpu_memory(memory, context.smallest[1], context.settings),
            micro,
            context.cutoff,
            checkpointing=not args.get("disable_gradient_checkpointing", False),
        )
    check_dataset_batch(
        micro=micro,
        accumulation=accumulation,
        world=context.world,
        records=_records(request, args, context.datasets),
        packing=bool(args.get("packing", False)),
    )
    why = {**context.why, "first_step": _first_step(context, args)}
    return replace(context, args=args, fp8=fp8, environment=environment, why=why)


def _fp8(context: Assembly) -> tuple[Mapping[str, Any], str, dict[str, str]]:
    """-e fp8=true, or fp8 in train_args (which alone would train in bf16: choose_fp8 says
    why): the arguments, the plan's line and the ranks' environment of an FP8 run."""
    args, request = context.args, context.request
    if not (request.fp8 or args.get("fp8") is True):
        return args, "", {}
    if request.numerics == "exact":
        raise PlanError(
            "FP8 changes the run's numerics, and numerics=exact forbids every such change. "
            "Leave fp8 off, or set -e numerics=measured."
        )
    batch, cost = context.batch, context.cost
    pays = fp8_pays(
        float(context.model["params_b"]),
        steps=context.steps,
        step_seconds=cost(batch) if cost is not None and batch is not None else None,
        settings=context.settings.compile,
    )
    fp8_args, environment, line = choose_fp8(
        context.nodes, context.accelerator, context.stage, pays
    )
    return {**args, **fp8_args}, line, environment


def _first_step(context: Assembly, args: Mapping[str, Any]) -> str:
    """How long the run takes to its first optimizer step (start-up, load, compiling)."""
    if context.accelerator == "cpu":
        return "not predicted (a CPU cluster: measured on GPUs)"
    _, said = first_step(
        float(context.model["params_b"]),
        compiled=bool(args.get("torch_compile")),
        fp8=bool(args.get("fp8")),
        finetuning=str(context.model["finetuning_type"]),
        settings=context.settings.compile,
    )
    return said


def _computed(context: Assembly) -> Assembly:
    """The batch, checkpointing and torch.compile, each with why, and the estimated steps."""
    memory, stage, explicit = context.memory, context.stage, context.explicit
    defaults = context.settings.defaults
    computed: dict[str, Any] = {}
    if memory.budget is None:  # CPU: LLaMA-Factory's defaults and the settings
        batch = Batch(1, 1, True, "as set: a CPU run has no GPU memory to plan for")
        checkpointing = "LLaMA-Factory's default on CPUs"
    else:
        batch = choose_batch(memory, stage, _batch_request(context, explicit), context.cost)
        computed.update(memory.technique.train_args())
        computed["per_device_train_batch_size"] = batch.micro
        computed["gradient_accumulation_steps"] = batch.accumulation
        if not batch.checkpointing:
            computed["disable_gradient_checkpointing"] = True
            # Without checkpointing DDP need not search for unused parameters (rule 7).
            computed["ddp_find_unused_parameters"] = False
        checkpointing = _checkpointing_why(context, batch)
    steps = estimate_steps(
        {**defaults, **explicit, **computed, **explicit},
        records=context.request.dataset_records,
        world=context.world,
        cutoff=context.cutoff,
        record_tokens=int(context.settings.compile["record_tokens"]),
    )
    # With a search, compiling is the technique's (a candidate of its own); without one (a CPU,
    # a model of unknown shape), the rule of choose_compile alone.
    uncompiled = context.uncompiled
    use, why = choose_compile(
        "cpu" if memory.budget is None else "gpu",
        stage,
        steps,
        context.settings.compile,
        step_seconds=uncompiled(batch) if uncompiled is not None else None,
        finetuning=str(context.model.get("finetuning_type") or "full"),
        technique=memory.technique,
    )
    if use and uncompiled is None:
        computed["torch_compile"] = True
    whys = {
        "why": batch.reason,
        "checkpointing_why": checkpointing,
        "compile_why": "as set" if "torch_compile" in explicit else why,
    }
    args = {**defaults, **computed, **explicit}
    check_size(args, steps, context.cost(batch) if context.cost is not None else None)
    return replace(context, args=args, batch=batch, why=whys, steps=steps)


def _checkpointing_why(context: Assembly, batch: Batch) -> str:
    """Why gradient checkpointing is on or off."""
    memory = context.memory
    if context.explicit.get("disable_gradient_checkpointing") is not None:
        return "as set"
    if memory.shape is None:
        return "model shape unknown: no config.json"
    if (
        batch.checkpointing
        and context.cost is not None
        and memory.fits(context.stage, context.cutoff, checkpointing=False)
    ):
        return (
            "the cost model predicts recomputing with this micro-batch faster than the "
            "micro-batches that fit without it"
        )
    if batch.checkpointing:
        return "the activations would not fit without recomputing them"
    return "the micro-batch's activations fit without recomputation"


def _cpu_memory(memory: Memory, smallest: Mapping[str, Any] | None, data: Settings) -> Memory:
    """The memory model of a CPU run: the budget of each process is its share of the smallest
    node's usable RAM (None where no node's memory is known)."""
    if smallest is None:
        return memory
    usable = smallest["host_memory_gib"] * GIB * float(data.memory["host_usable_fraction"])
    return replace(memory, budget=usable / max(1, memory.nproc))


def _records(
    request: Request, args: Mapping[str, Any], datasets: Sequence[Mapping[str, Any]]
) -> int | None:
    """The records the run trains on (the datasets' valid records, at most max_samples from each
    as LLaMA-Factory reads it), or None where they are not known."""
    records = request.dataset_records
    if records is None:
        return None
    if args.get("max_samples"):
        records = min(int(records), int(args["max_samples"]) * max(1, len(datasets)))
    return int(records)


# ---- the plan -------------------------------------------------------------------------------
def _plan(context: Assembly) -> Plan:
    """The plan: the prediction and the go/no-go, the disk estimate, and the lines shown."""
    args, stage, world = context.args, context.stage, context.world
    assert context.choice is not None
    performance, lines = _performance(context)
    micro = int(args.get("per_device_train_batch_size", 1))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    tokens = micro * accumulation * context.cutoff
    limit = "as set" if "save_total_limit" in context.explicit else (
        f"the project's default in training_defaults, {TRAINING_FILE}")  # fmt: skip
    planned = Plan(
        run_id=new_run_id(context.request.timestamp, context.request.model),
        model_name=context.request.model,
        model=dict(context.model),
        datasets=tuple(context.datasets),
        stage=context.choice,
        technique=_technique_plan(context),
        batch=BatchPlan(
            micro,
            accumulation,
            micro * accumulation * world,
            tokens,
            tokens * world,
            packing=bool(args.get("packing", False)),
            checkpointing=not args.get("disable_gradient_checkpointing", False),
            torch_compile=bool(args.get("torch_compile", False)),
            steps=context.steps,
            **context.why,
        ),
        memory=_memory_plan(context),
        accelerator=context.accelerator,
        nnodes=len(context.nodes),
        nproc_per_node=context.nproc,
        world_size=context.world,
        ranks=dict(context.ranks),
        train_args=args,
        # Set in every rank's environment before it starts (roles/job: job_environment).
        environment={**context.environment, **stage.environment},
        disk=disk_estimate(
            model=context.model,
            stage=stage,
            args=args,
            nproc=context.nproc,
            world=context.world,
            shared_storage=context.settings.shared_storage,
            steps=context.steps,
            limit_source=limit,
        ),
        performance=performance,
        rules_applied=context.applied,
        max_restarts=context.request.max_restarts,
    )
    return replace(planned, summary=tuple(summary(planned, *context.smallest, lines)))


def _technique_plan(context: Assembly) -> TechniquePlan:
    """The technique part of the plan."""
    technique = context.memory.technique
    return TechniquePlan(
        optim=technique.optim,
        liger=technique.liger,
        quantization_bit=technique.quant,
        label=technique.label() or "none",
        numerics=context.request.numerics,
        numerics_changes=tuple(technique.numerics_changes()),
        why=_technique_line(context),
        fp8=context.fp8,
    )


def _memory_plan(context: Assembly) -> MemoryPlan:
    """The memory part of the plan."""
    memory, batch = context.memory, context.batch
    smallest, smallest_host = context.smallest
    keys = ("gpu_memory_gib", "memory_source", "host_memory_gib", "host_memory_source")
    return MemoryPlan(
        gpu_gib=smallest["gpu_memory_gib"] if smallest else None,
        budget_gib=round(memory.budget / GIB, 1) if memory.budget else None,
        estimate_gib=round(batch.need / GIB, 1) if batch and batch.need else None,
        host_gib=smallest_host["host_memory_gib"] if smallest_host else None,
        host_budget_gib=round(memory.host_budget / GIB, 1) if memory.host_budget else None,
        host_estimate_gib=round(memory.host_need(context.stage) / GIB, 1),
        nodes={n["host"]: {key: n.get(key) for key in keys} for n in context.nodes},
    )


def _performance(context: Assembly) -> tuple[dict[str, Any], list[str]]:
    """The prediction and the go/no-go (search.assess), or a CPU cluster's as the GPUs of its
    planning profile."""
    search, memory = context.search, context.memory
    chosen = None
    if search is not None and context.batch is not None:
        chosen = Option.of(
            search,
            memory,
            stage=context.stage,
            batch=context.batch,
            cutoff=context.cutoff,
            link=context.cluster.link,
        )
    cluster = replace(
        context.cluster, records=_records(context.request, context.args, context.datasets)
    )
    performance, lines = assess(search, memory, chosen, cluster)
    if context.accelerator == "cpu":
        emulated = emulated_nodes(context.nodes, context.settings.planning_profiles)
        if emulated is not None:
            return emulated_performance(context, emulated)
    return performance, lines


# The lines of a plan that say its prediction and its go/no-go.
PREDICTION_LINES = ("Predicted", "Runner-up", "Link between nodes", "Scaling")


def emulated_performance(
    context: Assembly, emulated: tuple[list[dict[str, Any]], str]
) -> tuple[dict[str, Any], list[str]]:
    """A CPU cluster's prediction and go/no-go, planned as the GPU nodes of its planning profile
    (nodes.emulated_nodes): the emulated plan's performance and its lines, each saying so. Its
    refusal (the go/no-go, or what does not fit such GPUs) is raised the same way."""
    nodes, what = emulated
    said = f"Emulated ({what})"
    name = what.split("=", 1)[1].split(":", 1)[0]
    try:
        planned = assemble(
            context.request,
            model=context.model,
            nodes=nodes,
            ranks=context.ranks,
            datasets=context.datasets,
            settings=replace(context.settings, planning_profiles={}),
        )
    except PlanError as refused:
        raise PlanError(f"{said}: {refused}") from None
    lines = [f"{said}: {line}" for line in planned.summary if line.startswith(PREDICTION_LINES)]
    return {**planned.performance, "emulated": name}, lines
