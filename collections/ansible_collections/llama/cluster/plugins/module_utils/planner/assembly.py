"""The plan: the request, the model, the nodes, the decisions and the rules put together
(`plan`), with the lines shown before launch (`summary`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .checkpoints import sharded_checkpoints
from .cost import Link
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
    largest_micro,
)
from .disk import disk_estimate
from .errors import TRAINING_FILE, PlanError
from .links import run_link
from .memory import GIB, Memory, gib_text
from .model import find_model, resolve_model
from .nodes import check_nodes, emulated_nodes
from .rules import apply_rules, check_rules
from .schema import Settings, check_project_settings, check_request
from .search import (
    HYBRID,
    SEARCH_STAGES,
    Option,
    Search,
    Tries,
    assess,
    check_size,
    hybrid_applies,
    ranked,
)
from .summary import summary
from .techniques import (
    NUMERICS_EVIDENCE,
    PLAIN,
    Technique,
    available_packages,
    candidates,
    check_quantization,
)

# Stages that keep the weights in host memory: a LoRA run that fits only with one of them may be
# planned as QLoRA instead (its 4-bit weights fit the GPU).
PARAMETER_OFFLOAD = ("zero3_offload",)

# A new run's id: train-<UTC start, to the second>-<model>.
RUN_STAMP = "%Y%m%d-%H%M%S"


def new_run_id(stamp: str, model: str | None) -> str:
    """The id of a new run of `model` started at `stamp` (RUN_STAMP)."""
    return f"train-{stamp}-" + re.sub(r"[^A-Za-z0-9_-]+", "-", str(model or "model"))


def _smallest(
    nodes: Sequence[Mapping[str, Any]], key: str = "gpu_memory_gib"
) -> Mapping[str, Any] | None:
    known = [n for n in nodes if n.get(key) is not None]
    return min(known, key=lambda n: n[key]) if known else None


def _explicit(
    request: Mapping[str, Any], model: Mapping[str, Any], profile: Mapping[str, Any]
) -> dict[str, Any]:
    """The training arguments someone set: the profile rules < the catalogue < -e train_args."""
    explicit = {**profile, **(model.get("train_args") or {}), **request["train_args"]}
    explicit.pop("cutoff_len", None)  # model.cutoff_len holds it
    explicit.pop("deepspeed", None)
    return explicit


def _batch_request(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    explicit: Mapping[str, Any],
    settings: Settings,
) -> BatchRequest:
    """What the batch rule starts from, for these explicit arguments."""
    ckpt = explicit.get("disable_gradient_checkpointing")
    return BatchRequest(
        cutoff=int(model["cutoff_len"]),
        tokens_per_step=int(request["tokens_per_step"]),
        packing=bool({**settings.defaults, **explicit}.get("packing", False)),
        micro=explicit.get("per_device_train_batch_size"),
        accumulation=explicit.get("gradient_accumulation_steps"),
        checkpointing=None if ckpt is None else not ckpt,
        default_micro=int(settings.defaults.get("per_device_train_batch_size", 1)),
        default_accumulation=int(settings.defaults.get("gradient_accumulation_steps", 1)),
    )


def _tries(
    stages: Sequence[str],
    memory: Memory,
    explicit: Mapping[str, Any],
    **how: Any,  # noqa: ANN401 - techniques.candidates' options
) -> Tries:
    """The techniques each stage tries (planner/techniques.py), less those a setting of the
    user's excludes: an optimizer or Liger set in train_args is kept as set."""
    liger = explicit.get("enable_liger_kernel")

    def kept(t: Technique) -> bool:
        return explicit.get("optim", t.optim) == t.optim and liger in (None, t.liger)

    return {
        stage: tuple(t for t in candidates(memory.finetuning, stage, **how) if kept(t))
        for stage in stages
    }


def _searched(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    memory: Memory,
    *,
    facts: Mapping[str, Any],
    settings: Settings,
    link: Link | None,
    available: frozenset[str],
) -> Search | None:
    """The candidates of every stage the planner may choose (or the one asked for) and their
    techniques, ranked by the cost model; where a LoRA run's bf16 weights fit the GPU with no
    stage (only offloaded to the host), QLoRA's candidates too (unless numerics is exact);
    None where the search does not apply (CPUs, a model of unknown shape)."""
    shape = memory.measured_shape()
    if memory.budget is None or shape is None:
        return None
    asked = request.get("deepspeed") or "auto"
    stages = SEARCH_STAGES[memory.finetuning] if asked == "auto" else (asked,)
    asks = {}
    for stage in stages:
        profile, _ = apply_rules(settings.rules, {**facts, "deepspeed": stage})
        asks[stage] = _batch_request(request, model, _explicit(request, model, profile), settings)
    explicit = _explicit(request, model, {})
    merged = {**settings.defaults, **explicit}
    rank = int(merged.get("lora_rank") or 8)
    how = {
        "numerics": request["numerics"],
        "quantization": int(request.get("quantization_bit") or 0),
        "available": available,
    }
    tries = _tries(stages, memory, explicit, **how)
    options, skipped = ranked(memory, asks, shape, link, rank, tries=tries)
    on_gpu = [o for o in options if o.stage not in PARAMETER_OFFLOAD]
    if on_gpu or how["quantization"]:
        return Search(asks, shape, rank, options, skipped, tries)
    # The bf16 weights fit the GPU with no stage: QLoRA's 4-bit ones compete with the offload.
    extra = _tries(stages, memory, explicit, **how, fallback=True)
    quantized, _ = ranked(memory, asks, shape, link, rank, tries=extra)
    if not quantized:
        return Search(asks, shape, rank, options, skipped, tries)
    both = sorted([*options, *quantized], key=lambda o: o.cost.total / o.cost.tokens)
    merged = {stage: tries[stage] + extra[stage] for stage in stages}
    return Search(asks, shape, rank, both, skipped, merged, fallback=bool(both[0].technique.quant))


def _stage_and_profile(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    memory: Memory,
    *,
    facts: dict[str, Any],
    settings: Settings,
    search: Search | None,
) -> tuple[str, str, dict[str, Any], list[str]]:
    """The stage and why; the profile rules' settings (after the stage they may test or set)."""
    asked = request.get("deepspeed") or "auto"
    if asked == "auto" and search is not None and search.options:
        stage = search.options[0].stage
        why = f"the fastest predicted of {len(search.options)} candidates that fit" + (
            "; " + ", ".join(search.skipped) + " would not fit" if search.skipped else ""
        )
    elif search is not None and search.options:
        stage = asked
        why = (
            f"deepspeed={asked} given; the fastest predicted of its {len(search.options)} "
            "candidates that fit"
        )
    elif asked == "auto":
        stage, why = choose_stage(
            memory, model["cutoff_len"], facts["accelerator"], nnodes=facts["nnodes"]
        )
        why = f"chosen by the rule in {TRAINING_FILE}: {why}"
    else:
        stage, why = asked, f"deepspeed={asked} given"
        if not memory.host_fits(stage):
            raise PlanError(
                f"deepspeed={asked} needs {gib_text(memory.host_need(stage))} of host memory on "
                f"each node ({memory.nproc} processes), the budget is "
                f"{gib_text(memory.host_budget)}: the kernel would kill the run. "
                "Leave deepspeed to the planner (-e deepspeed=auto), or add nodes."
            )
        if search is not None and asked != "auto":
            _refuse_unfitting(search, memory, asked, request["numerics"])
    facts["deepspeed"] = stage
    profile, applied = apply_rules(settings.rules, facts)
    ruled = profile.pop("deepspeed", None)
    if ruled and asked == "auto":
        if ruled not in settings.stages:
            raise PlanError(
                f"A profile rule in {TRAINING_FILE} sets deepspeed={ruled}; use one of: "
                f"{', '.join(settings.stages)}."
            )
        stage, why = str(ruled), f"set by a profile rule in {TRAINING_FILE}"
    return stage, why, profile, applied


def _refuse_unfitting(search: Search, memory: Memory, stage: str, numerics: str) -> None:
    """A stage asked for that fits with none of its techniques: what each would need, and the
    largest micro-batch that would fit where the one set does not."""
    ask = search.asks[stage]
    rows = int(ask.micro or 1)
    tried = (search.tries or {}).get(stage) or (PLAIN,)
    needs = []
    for technique in tried:
        variant = replace(memory, technique=technique)
        need = variant.need(stage, rows * ask.cutoff, checkpointing=True)
        needs.append(f"{technique.label() or 'plain'}: {gib_text(need)}")
    largest = max(
        largest_micro(
            lambda m, t=technique: replace(memory, technique=t).fits(stage, m * ask.cutoff, True),
            rows,
        )
        for technique in tried
    )
    what = "one checkpointed row" if rows == 1 else f"a micro-batch of {rows} checkpointed rows"
    raise PlanError(
        f"The run does not fit the GPUs with deepspeed={stage}: {what} of "
        f"{ask.cutoff} tokens needs, per GPU, " + "; ".join(needs) + f" (the budget is "
        f"{gib_text(memory.budget)}). "
        + (
            f"The largest micro-batch that fits is {largest}: "
            f'-e \'{{"train_args": {{"per_device_train_batch_size": {largest}}}}}\'. Or use '
            if largest
            else "Use "
        )
        + "deepspeed=auto, a smaller cutoff_len, more GPUs"
        + (", or -e numerics=measured (8-bit AdamW)" if numerics == "exact" else "")
        + ". Nothing was changed on any node."
    )


def _cpu_memory_refusal(memory: Memory, node: Mapping[str, Any] | None) -> str:
    """Why a CPU run does not fit the node with the least memory, and the ways out."""
    where = (
        f"{node['host']} ({node.get('host_memory_source', 'as given')})"
        if node
        else "the smallest node"
    )
    fits = int((memory.host_budget or 0) // (memory.host_need("none") / memory.nproc))
    ways = [
        f"train {fits} process{'es' if fits > 1 else ''} per node (-e nproc_per_node={fits} fits)"
        if fits
        else "train fewer processes per node (not even one fits now)"
    ]
    if memory.finetuning == "full" and replace(memory, finetuning="lora").host_fits("none"):
        ways.append("LoRA (-e finetuning_type=lora)")
    return (
        f"The run does not fit the nodes' memory: its {memory.nproc} training processes per node "
        f"need about {gib_text(memory.host_need('none'))} (the weights, what the optimizer "
        f"updates, and each process's own), and {where} has {gib_text(memory.host_budget)} to "
        f"give. Free memory there, {', '.join(ways)}, or a smaller model. Nothing was changed "
        "on any node."
    )


def _technique(search: Search | None, stage: str) -> Technique:
    """The technique of the fastest candidate of the chosen stage (plain where none)."""
    if search is None:
        return PLAIN
    return next((o.technique for o in search.options if o.stage == stage), PLAIN)


def _technique_line(
    search: Search | None, technique: Technique, numerics: str, available: frozenset[str]
) -> str:
    """What the plan prints about the technique and the run's numerics."""
    if search is None:
        return "none (the search does not apply: no techniques planned)"
    changes = technique.numerics_changes()
    if technique.plain:
        text = "none: the plain run is the fastest predicted that fits"
    elif search.fallback:
        text = (
            f"{technique.label()}: chosen by the planner because the bf16 weights fit the GPU "
            f"with no stage but {', '.join(PARAMETER_OFFLOAD)}, which the cost model predicts "
            "slower"
        )
    else:
        text = f"{technique.label()}: the fastest predicted candidate that fits"
    if changes:
        evidence = NUMERICS_EVIDENCE["qlora" if technique.quant else technique.optim]
        text += (
            f". Numerics: changes {', '.join(changes)} ({evidence}); -e numerics=exact forbids "
            "every numerics change"
        )
    elif numerics == "exact":
        text += ". Numerics: exact (no numerics change allowed, -e numerics=exact)"
    missing = sorted({"bitsandbytes", "liger-kernel"} - set(available))
    if missing:
        text += (
            f". Not considered: what needs {', '.join(missing)}, which not every node has "
            "(provision.yml installs them)"
        )
    return text


def _training_args(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    memory: Memory,
    *,
    stage: str,
    explicit: Mapping[str, Any],
    settings: Settings,
    cost: Callable[[Batch], float] | None = None,
) -> tuple[dict[str, Any], dict[str, str], Batch, int | None]:
    """The training arguments: defaults < computed (batch, checkpointing, compile) < explicit;
    the decisions, the batch and the estimated optimizer steps (None: unknown)."""
    merged = {**settings.defaults, **explicit}
    decisions = {}
    computed: dict[str, Any] = {}
    if memory.budget is None:  # CPU: LLaMA-Factory's defaults and the settings
        batch = Batch(1, 1, True, "as set: a CPU run has no GPU memory to plan for")
        decisions["checkpointing"] = "LLaMA-Factory's default on CPUs"
    else:
        ckpt = explicit.get("disable_gradient_checkpointing")
        batch = choose_batch(
            memory, stage, _batch_request(request, model, explicit, settings), cost
        )
        computed.update(memory.technique.train_args())
        computed["per_device_train_batch_size"] = batch.micro
        computed["gradient_accumulation_steps"] = batch.accumulation
        if not batch.checkpointing:
            computed["disable_gradient_checkpointing"] = True
            # Without checkpointing DDP need not search for unused parameters (rule 7).
            computed["ddp_find_unused_parameters"] = False
        decisions["checkpointing"] = (
            "as set"
            if ckpt is not None
            else "model shape unknown: no config.json"
            if memory.shape is None
            else "the cost model predicts recomputing with this micro-batch faster than the "
            "micro-batches that fit without it"
            if batch.checkpointing
            and cost is not None
            and memory.fits(stage, int(model["cutoff_len"]), checkpointing=False)
            else "the activations would not fit without recomputing them"
            if batch.checkpointing
            else "the micro-batch's activations fit without recomputation"
        )
    decisions["batch"] = batch.reason
    steps = estimate_steps(
        {**merged, **computed, **explicit},
        records=request.get("dataset_records"),
        world=memory.world,
        cutoff=int(model["cutoff_len"]),
        record_tokens=int(settings.compile["record_tokens"]),
    )
    accelerator = "cpu" if memory.budget is None else "gpu"
    use, why = choose_compile(
        accelerator,
        stage,
        steps,
        settings.compile,
        step_seconds=cost(batch) if cost is not None else None,
        finetuning=str(model.get("finetuning_type") or "full"),
    )
    if use and (memory.technique.liger or memory.technique.quant):
        use, why = False, "not measured with Liger kernels or QLoRA"
    if use:
        computed["torch_compile"] = True
    decisions["torch_compile"] = "as set" if "torch_compile" in explicit else why
    decisions["estimated_steps"] = str(steps)
    args = {**settings.defaults, **computed, **explicit}
    check_size(args, steps, cost(batch) if cost is not None else None)
    return args, decisions, batch, steps


def plan(
    request: Mapping[str, Any],
    *,
    nodes: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
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
        checked,
        model=resolve_model(checked, entry),
        nodes=nodes,
        ranks=ranks,
        datasets=datasets,
        settings=settings,
    )


def assemble(
    request: Mapping[str, Any],
    *,
    model: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The run of a request that check_request has passed, for the model that resolve_model
    gave (see plan): the model goes into the plan as it is, with its path on every node."""
    data = Settings(**settings)
    accelerator, nproc, world = check_nodes(nodes)
    check_rules(data.rules)
    check_project_settings(data, model)
    smallest = _smallest(nodes)
    gib = smallest["gpu_memory_gib"] if smallest else None
    smallest_host = _smallest(nodes, "host_memory_gib")
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
    check_hybrid(request, memory, len(nodes))
    train_args = request["train_args"]
    facts = {
        "accelerator": accelerator,
        "finetuning_type": model["finetuning_type"],
        "model": request.get("model"),
        "stage": train_args.get("stage")
        or (model.get("train_args") or {}).get("stage")
        or data.defaults.get("stage"),
        "params_b": float(model["params_b"]),
        "world_size": world,
        "nnodes": len(nodes),
        "gpu_memory_gib": gib,
        "cutoff_len": model["cutoff_len"],
    }
    link, link_note = run_link(nodes) if accelerator != "cpu" else (None, "CPU cluster")
    available = available_packages(nodes)
    if request.get("quantization_bit"):
        check_quantization(request, model, nodes, accelerator, available)
    search = _searched(
        request, model, memory, facts=facts, settings=data, link=link, available=available
    )
    stage, stage_why, profile, applied = _stage_and_profile(
        request, model, memory, facts=facts, settings=data, search=search
    )
    explicit = {**profile, **(model.get("train_args") or {}), **train_args}
    explicit.pop("cutoff_len", None)  # model.cutoff_len holds it
    if memory.on_cpu and not memory.host_fits(stage):
        raise PlanError(_cpu_memory_refusal(memory, smallest_host))
    technique = _technique(search, stage)
    memory = replace(memory, technique=technique)
    cost = None
    if search is not None:
        cost = search.cost_function(memory, stage, int(model["cutoff_len"]), link)
    args, decisions, batch, steps = _training_args(
        request, model, memory, stage=stage, explicit=explicit, settings=data, cost=cost
    )
    performance, performance_lines = assess(
        search,
        memory,
        Option.of(
            search, memory, stage=stage, batch=batch, cutoff=int(model["cutoff_len"]), link=link
        )
        if search is not None
        else None,
        link=link,
        link_note=link_note,
        nnodes=len(nodes),
        nproc=nproc,
        allow_slow=bool(request.get("allow_slow_scaling")),
        model_name=request.get("model"),
        records=_records(request, args, datasets),
    )
    emulated = emulated_nodes(nodes, data.planning_profiles) if accelerator == "cpu" else None
    if emulated is not None:
        performance, performance_lines = emulated_performance(
            request, model, emulated, ranks=ranks, datasets=datasets, settings=settings
        )
    decisions["deepspeed"] = stage_why
    decisions["technique"] = _technique_line(search, technique, request["numerics"], available)
    environment: dict[str, str] = {}
    # -e fp8=true, or fp8 in train_args (which alone would train in bf16: choose_fp8 says why).
    if request.get("fp8") or args.get("fp8") is True:
        if request["numerics"] == "exact":
            raise PlanError(
                "FP8 changes the run's numerics, and numerics=exact forbids every such change. "
                "Leave fp8 off, or set -e numerics=measured."
            )
        fp8_args, environment, decisions["fp8"] = choose_fp8(nodes, accelerator, stage)
        args = {**args, **fp8_args}
    environment.update(stage_environment(stage))
    micro = int(args.get("per_device_train_batch_size", 1))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    if accelerator == "cpu":
        check_cpu_batch(
            _cpu_memory(memory, nodes, data),
            micro,
            int(model["cutoff_len"]),
            checkpointing=not args.get("disable_gradient_checkpointing", False),
        )
    check_dataset_batch(
        micro=micro,
        accumulation=accumulation,
        world=world,
        records=_records(request, args, datasets),
        packing=bool(args.get("packing", False)),
    )
    tokens = micro * accumulation * int(model["cutoff_len"])
    result = {
        "run_id": request.get("resume_id")
        or new_run_id(request.get("timestamp", "now"), request.get("model")),
        "resume": bool(request.get("resume_id")),
        "model_name": request.get("model"),
        # model.path is what train.yaml loads (model_name_or_path): its path on every node.
        "model": dict(model),
        "datasets": list(datasets),
        "deepspeed": stage,
        # The memory-saving technique (planner/techniques.py) and the numerics policy.
        "technique": {
            "optim": technique.optim,
            "liger": technique.liger,
            "quantization_bit": technique.quant,
            "label": technique.label() or "none",
            "numerics_changes": technique.numerics_changes(),
        },
        "numerics": request["numerics"],
        # Each node's checkpoint holds only its own ranks' state: what a resume can copy.
        "sharded": sharded_checkpoints(stage),
        "accelerator": accelerator,
        "nnodes": len(nodes),
        "nproc_per_node": nproc,
        "world_size": world,
        "effective_batch": micro * accumulation * world,
        "tokens_per_step": tokens,
        "tokens_per_optimizer_step": tokens * world,
        "packing": bool(args.get("packing", False)),
        "gradient_checkpointing": not args.get("disable_gradient_checkpointing", False),
        "torch_compile": bool(args.get("torch_compile", False)),
        "gpu_memory_gib": gib,
        "memory_budget_gib": round(memory.budget / GIB, 1) if memory.budget else None,
        "memory_estimate_gib": round(batch.need / GIB, 1) if batch.need else None,
        "host_memory_gib": host_gib,
        "host_budget_gib": round(memory.host_budget / GIB, 1) if memory.host_budget else None,
        "host_estimate_gib": round(memory.host_need(stage) / GIB, 1),
        "nodes": {
            n["host"]: {
                key: n.get(key)
                for key in (
                    "gpu_memory_gib",
                    "memory_source",
                    "host_memory_gib",
                    "host_memory_source",
                )
            }
            for n in nodes
        },
        "performance": performance,
        # Set in every rank's environment before it starts (roles/job: job_environment).
        "environment": environment,
        "max_restarts": int(request.get("max_restarts") or 0),
        "train_args": args,
        "ranks": dict(ranks),
        "rules_applied": applied,
        "decisions": decisions,
        "disk": disk_estimate(
            model=model,
            stage=stage,
            args=args,
            nproc=nproc,
            world=world,
            shared_storage=data.shared_storage,
            steps=steps,
            limit_source=(
                "as set"
                if "save_total_limit" in explicit
                else f"the project's default in training_defaults, {TRAINING_FILE}"
            ),
        ),
    }
    result["summary"] = summary(result, smallest, smallest_host, performance_lines)
    return result


def _cpu_memory(memory: Memory, nodes: Sequence[Mapping[str, Any]], data: Settings) -> Memory:
    """The memory model of a CPU run: the budget of each process is its share of the smallest
    node's usable RAM (None where no node's memory is known)."""
    smallest = _smallest(nodes, "host_memory_gib")
    if smallest is None:
        return memory
    usable = smallest["host_memory_gib"] * GIB * float(data.memory["host_usable_fraction"])
    return replace(memory, budget=usable / max(1, memory.nproc))


# The lines of a plan that say its prediction and its go/no-go.
PREDICTION_LINES = ("Predicted", "Runner-up", "Link between nodes", "Scaling")


def emulated_performance(
    request: Mapping[str, Any],
    model: Mapping[str, Any],
    emulated: tuple[list[dict[str, Any]], str],
    *,
    ranks: Mapping[str, int],
    datasets: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
) -> tuple[dict[str, Any], list[str]]:
    """A CPU cluster's prediction and go/no-go, planned as the GPU nodes of its planning profile
    (nodes.emulated_nodes): the emulated plan's performance and its lines, each saying so. Its
    refusal (the go/no-go, or what does not fit such GPUs) is raised the same way."""
    nodes, what = emulated
    said = f"Emulated ({what})"
    name = what.split("=", 1)[1].split(":", 1)[0]
    try:
        planned = assemble(request, model=model, nodes=nodes, ranks=ranks, datasets=datasets,
                           settings={**settings, "planning_profiles": {}})  # fmt: skip
    except PlanError as refused:
        raise PlanError(f"{said}: {refused}") from None
    lines = [f"{said}: {line}" for line in planned["summary"] if line.startswith(PREDICTION_LINES)]
    return {**planned["performance"], "emulated": name}, lines


def check_hybrid(request: Mapping[str, Any], memory: Memory, nnodes: int) -> None:
    """A hybrid stage asked for (-e deepspeed=zero3_hpz or hsdp) where it has nothing to split
    between inside a node and across nodes: refused, naming what it needs and what to ask
    instead."""
    asked = request.get("deepspeed") or "auto"
    if asked in HYBRID and not hybrid_applies(memory):
        instead = "fsdp" if asked == "hsdp" else "zero3"
        raise PlanError(
            f"deepspeed={asked} shards inside a node and replicates across nodes: it needs "
            f"several nodes of several processes each, and this cluster is {nnodes} node(s) x "
            f"{memory.nproc} process(es). Ask for deepspeed={instead} (the same sharding over "
            "every rank), or leave deepspeed to the planner. Nothing was changed on any node."
        )


def stage_environment(stage: str) -> dict[str, str]:
    """What a stage needs in every rank's environment. hsdp: accelerate 1.11 takes FSDP's
    sharding strategy from FSDP_SHARDING_STRATEGY (default FULL_SHARD) and ignores the
    hybrid_shard that transformers 5.6 passes it from train.yaml (measured on the lab: without
    it every rank shards over the whole world)."""
    return {"FSDP_SHARDING_STRATEGY": "HYBRID_SHARD"} if stage == "hsdp" else {}


def _records(
    request: Mapping[str, Any], args: Mapping[str, Any], datasets: Sequence[Mapping[str, Any]]
) -> int | None:
    """The records the run trains on (the datasets' valid records, at most max_samples from each
    as LLaMA-Factory reads it), or None where they are not known."""
    records = request.get("dataset_records")
    if records is None:
        return None
    if args.get("max_samples"):
        records = min(int(records), int(args["max_samples"]) * max(1, len(datasets)))
    return int(records)
