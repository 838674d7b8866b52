"""The search: every candidate (DeepSpeed stage, memory-saving technique, checkpointing,
micro-batch and accumulation within the user's tokens per step) that fits the memory model's GPU
and host budgets, ranked by the cost model's predicted step time (`ranked`); the predicted
scaling over 1..N nodes (`scaling`); and the go/no-go that refuses a run whose nodes would scale
backwards or below MIN_EFFICIENCY of linear (`go_no_go`).

The techniques each stage tries (`tries`: stage -> techniques, planner/techniques.py) are the
measured ones the numerics policy allows; a stage without techniques tries the plain run.

The tokens per optimizer step are the user's: every candidate splits the same rows per process
into micro-batch x accumulation, and candidates are ranked by seconds per token.

The hybrid stages (Stage.hybrid: ZeRO++ hpZ and FSDP's hybrid shard, HSDP) shard inside a node
and replicate across nodes: candidates of a full fine-tune only where every node runs several
ranks and there are several nodes (decisions.hybrid_applies); elsewhere they are ZeRO-3 or FSDP
by another name. bench/links.py measured both against DDP, ZeRO-2 and ZeRO-3 on the CPU lab,
2 nodes x 2 ranks over 100 Mbit/s and 1 Gbit/s (BENCHMARKS.md section 11). Not a candidate:
FSDP (never chosen, only run when asked: its cost is planned as ZeRO-3's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .cost import Link, Setup, StepCost, mfu, step_cost
from .decisions import Batch, BatchRequest, batch_options, hybrid_applies
from .disk import saves_of
from .errors import PlanError
from .links import CHECK
from .measured_memory import Shape
from .memory import Memory, gib_text
from .plan import Stage, search_order
from .techniques import PLAIN, Technique

MIN_EFFICIENCY = 0.6  # of linear scaling, below which train.yml refuses (issue 22)
# Bounds beyond any real run (issue 48): refused before launch as a typo (num_train_epochs 1e12).
MAX_RUN_S = 365 * 86400.0  # a year of training
MAX_STEPS = 10**9  # over 115 days even at 10 ms a step
MAX_SAVES = 10**6  # checkpoints written: over 11 days of saving even at a second each
FLOOR_STEP_S = 0.01  # the step time assumed where none is predicted (CPU clusters, no shape)


Tries = Mapping[Stage, tuple[Technique, ...]]


@dataclass(frozen=True)
class Option:
    """One candidate that fits, with its predicted step."""

    stage: Stage
    batch: Batch
    cost: StepCost
    setup: Setup

    @property
    def technique(self) -> Technique:
        return self.setup.technique

    @property
    def variant(self) -> tuple[Stage, Technique]:
        """What the runner-up must differ in: the stage or the technique."""
        return self.stage, self.technique

    @classmethod
    def of(
        cls,
        search: Search,
        memory: Memory,
        *,
        stage: Stage,
        batch: Batch,
        cutoff: int,
        link: Link | None,
    ) -> Option:
        """The plan chosen, as a candidate with its predicted step."""
        how = setup(memory, stage, batch, cutoff, search.rank)
        return cls(stage, batch, step_cost(search.shape, how, world=memory.world, link=link), how)

    def label(self) -> str:
        """deepspeed=none, 8-bit AdamW, micro-batch 2 x accumulation 2, checkpointing on."""
        technique = self.technique.label()
        return (
            f"deepspeed={self.stage}, "
            + (f"{technique}, " if technique else "")
            + f"micro-batch {self.batch.micro} x accumulation {self.batch.accumulation}, "
            + "checkpointing "
            + ("on" if self.batch.checkpointing else "off")
        )

    def timing(self) -> str:
        """0.52 s per step (compute 0.40 s, communication 0.12 s)."""
        comm = self.cost.communication
        return (
            f"{self.cost.total:.3g} s per optimizer step (compute {self.cost.compute:.3g} s, "
            + ("communication not counted" if comm is None else f"communication {comm:.3g} s")
            + ")"
        )


@dataclass(frozen=True)
class Search:
    """What the search tried: each stage's batch request, the model's shape, the LoRA rank, the
    candidates that fit (fastest first), the stages that did not fit, the techniques each stage
    tried, and whether they were the fallback (QLoRA where no bf16 candidate fit)."""

    asks: Mapping[Stage, BatchRequest]
    shape: Shape
    rank: int
    options: list[Option]
    skipped: list[str]
    tries: Tries | None = None
    fallback: bool = False

    def cost_function(
        self, memory: Memory, stage: Stage, cutoff: int, link: Link | None
    ) -> Callable[[Batch], float]:
        """A batch's predicted step time under `stage` and the memory's technique (choose_batch
        ranks by it)."""

        def seconds(batch: Batch) -> float:
            how = setup(memory, stage, batch, cutoff, self.rank)
            return step_cost(self.shape, how, world=memory.world, link=link).total

        return seconds


def setup(memory: Memory, stage: Stage, batch: Batch, cutoff: int, lora_rank: int) -> Setup:
    """What the cost model reads of a candidate (its technique is the memory's)."""
    return Setup(
        finetuning="full" if memory.finetuning == "full" else "lora",
        stage=stage,
        checkpointing=batch.checkpointing,
        micro_tokens=batch.micro * cutoff,
        accumulation=batch.accumulation,
        lora_rank=lora_rank,
        technique=memory.technique,
        local_ranks=memory.nproc,
    )


def ranked(
    memory: Memory,
    asks: Mapping[Stage, BatchRequest],
    shape: Shape,
    link: Link | None,
    lora_rank: int,
    *,
    tries: Tries | None = None,
) -> tuple[list[Option], list[str]]:
    """Every candidate of the stages in `asks` (stage -> its batch request) and their techniques
    (`tries`: a stage it does not name tries nothing; None: every stage the plain run) that fits
    both budgets, fastest first (the order of `asks` and `tries` among equals), and why each
    stage left out did not fit."""
    options, skipped = [], []
    for stage, ask in asks.items():
        if stage.hybrid and not hybrid_applies(memory):
            continue  # one node, or one rank per node: ZeRO-3 or FSDP by another name
        fitted = False
        recomputes: dict[str, bool] = {}  # optimizer -> its run without Liger must recompute
        for technique in (PLAIN,) if tries is None else tries.get(stage, ()):
            variant = replace(memory, technique=technique)
            if not variant.host_fits(stage):
                continue
            try:
                batches = batch_options(variant, stage, ask)
            except PlanError:
                recomputes.setdefault(technique.optim, True)
                continue
            if not technique.liger:
                recomputes[technique.optim] = all(b.checkpointing for b in batches)
            elif not recomputes.get(technique.optim, True):
                continue  # Liger was measured where memory is short, not where it is plenty
            batches = [b for b in batches if technique.allows(b.checkpointing)]
            fitted = fitted or bool(batches)
            for batch in batches:
                how = setup(variant, stage, batch, ask.cutoff, lora_rank)
                cost = step_cost(shape, how, world=memory.world, link=link)
                options.append(Option(stage, batch, cost, how))
        if not fitted:
            if not memory.host_fits(stage):
                skipped.append(f"{stage} ({gib_text(memory.host_need(stage))} of host memory)")
            else:
                need = memory.need(stage, ask.cutoff, checkpointing=True)
                skipped.append(f"{stage} ({gib_text(need)} of GPU memory)")
    options.sort(key=lambda o: o.cost.total / o.cost.tokens)
    return options, skipped


def runner_up(options: list[Option]) -> Option | None:
    """The best candidate of another stage or technique than the winner's, else the second
    best."""
    others = [o for o in options[1:] if o.variant != options[0].variant]
    return others[0] if others else (options[1] if len(options) > 1 else None)


def why_lost(winner: Option, other: Option) -> str:
    """The runner-up's figures against the winner's."""
    slower = other.cost.total / winner.cost.total - 1
    parts = []
    if abs(other.cost.compute - winner.cost.compute) >= 0.01 * winner.cost.total:
        parts.append(f"compute {other.cost.compute:.3g} s against {winner.cost.compute:.3g} s")
    wc, oc = winner.cost.communication, other.cost.communication
    if wc is not None and oc is not None and abs(oc - wc) >= 0.01 * winner.cost.total:
        parts.append(
            f"communication {oc:.3g} s against {wc:.3g} s ({other.cost.traffic.what}: "
            f"{other.cost.traffic.wire_bytes / 1e9:.3g} GB per step)"
        )
    return f"{slower:.0%} slower per step" + (": " + "; ".join(parts) if parts else "")


@dataclass(frozen=True)
class Scale:
    """The best candidate on `nodes` nodes like the smallest one, and its predicted figures."""

    nodes: int
    option: Option | None
    tokens_per_s: float | None
    efficiency: float | None = None  # of linear scaling


def scaling(
    memory: Memory,
    asks: Mapping[Stage, BatchRequest],
    shape: Shape,
    link: Link | None,
    lora_rank: int,
    *,
    nnodes: int,
    nproc: int,
    tries: Tries | None = None,
) -> list[Scale]:
    """The best plan's predicted tokens/s on 1..nnodes nodes, and its share of linear scaling
    from the fewest nodes it fits on (there: compute over compute plus communication)."""
    scales = []
    for k in range(1, nnodes + 1):
        world = k * nproc
        options, _ = ranked(
            replace(memory, world=world),
            asks,
            shape,
            link if k > 1 else None,
            lora_rank,
            tries=tries,
        )
        best = options[0] if options else None
        tps = best.cost.tokens_per_second(world) if best else None
        scales.append(Scale(k, best, tps))
    fits = [s for s in scales if s.tokens_per_s]
    if not fits:
        return scales
    base = fits[0]
    out = []
    for s in scales:
        if s.option is None or s.tokens_per_s is None or base.tokens_per_s is None:
            out.append(s)
        elif s.nodes == base.nodes:
            out.append(replace(s, efficiency=s.option.cost.compute / s.option.cost.total))
        else:
            linear = base.tokens_per_s * s.nodes / base.nodes
            out.append(replace(s, efficiency=s.tokens_per_s / linear))
    return out


def scaling_line(scales: list[Scale]) -> str:
    """1 node 30,000 tokens/s; 2 nodes 55,000 (92 % of linear); ..."""
    parts = []
    for s in scales:
        noun = "node" if s.nodes == 1 else "nodes"
        if s.tokens_per_s is None:
            parts.append(f"{s.nodes} {noun}: does not fit")
            continue
        eff = f" ({s.efficiency:.0%} of linear)" if s.efficiency is not None else ""
        parts.append(f"{s.nodes} {noun} {s.tokens_per_s:,.0f} tokens/s{eff}")
    return "; ".join(parts)


def check_size(args: Mapping[str, Any], steps: int | None, step_s: float | None) -> None:
    """PlanError where the run of training arguments `args` is beyond any real run (MAX_RUN_S,
    MAX_STEPS, MAX_SAVES), with its predicted time: a typo's size (num_train_epochs 1e12) would
    otherwise be launched."""

    def span(seconds: float) -> str:  # 126,839 years, 40 days, 5.2 hours
        for unit, size in (("years", 365 * 86400.0), ("days", 86400.0), ("hours", 3600.0)):
            if seconds >= size:
                return f"{seconds / size:,.{0 if seconds >= 10 * size else 1}f} {unit}"
        return f"{seconds:,.0f} s"

    saves = saves_of(args, steps)
    seconds = (steps or 0) * (step_s or FLOOR_STEP_S)
    if (steps or 0) <= MAX_STEPS and seconds <= MAX_RUN_S and (saves or 0) <= MAX_SAVES:
        return
    time = (
        f"predicted to take {span(seconds)} at {step_s:.3g} s a step"
        if step_s
        else f"at least {span(seconds)} even at {FLOOR_STEP_S:g} s a step (none is predicted)"
    )
    found = [f"{steps:,} optimizer steps, {time}" if steps else ""]
    found.append(f"{saves:,} checkpoints written" if saves else "")
    raise PlanError(
        f"Refused before launch: {'; '.join(f for f in found if f)}: beyond any real run (the "
        f"bounds: a year, {MAX_STEPS:,} steps, {MAX_SAVES:,} checkpoints written). Check "
        "num_train_epochs, max_steps and save_steps (train_args), or max_samples."
    )


def go_no_go(scales: list[Scale]) -> str | None:
    """Why the run's node count would not pay (slower than fewer nodes, or below
    MIN_EFFICIENCY of linear), or None when it does."""
    last = scales[-1]
    if last.nodes < 2 or last.tokens_per_s is None or last.option is None:
        return None
    faster = [s for s in scales[:-1] if s.tokens_per_s and s.tokens_per_s > last.tokens_per_s]
    if faster:
        best = max(faster, key=lambda s: s.tokens_per_s or 0.0)
        return (
            f"{last.nodes} nodes would train slower than {best.nodes}: "
            f"{last.tokens_per_s:,.0f} against {best.tokens_per_s:,.0f} tokens/s predicted"
        )
    if last.efficiency is not None and last.efficiency < MIN_EFFICIENCY:
        return (
            f"{last.nodes} nodes would reach {last.efficiency:.0%} of linear scaling "
            f"({last.tokens_per_s:,.0f} tokens/s predicted), below {MIN_EFFICIENCY:.0%}"
        )
    return None


def needed_gbps(
    option: Option, shape: Shape, link: Link, world: int, seconds: float
) -> float | None:
    """The link (Gbit/s) on which `option`'s step would take at most `seconds`, or None when
    its compute and the fixed costs (latency, the per-step overhead) alone take longer."""
    budget = seconds - fixed_step_s(option, shape, link, world)
    if budget <= 0:
        return None
    return option.cost.traffic.wire_bytes / budget * 8 / 1e9


def fixed_step_s(option: Option, shape: Shape, link: Link, world: int) -> float:
    """`option`'s step on a link of any bandwidth: its compute, and the communication that no
    bandwidth shortens (the link's latency, the per-step overhead)."""
    fast = replace(link, bandwidth=1e18)
    floor = step_cost(shape, option.setup, world=world, link=fast).communication or 0.0
    return option.cost.compute + floor


def option_mfu(option: Option, shape: Shape, finetuning: str) -> float:
    """The option's predicted MFU (989 TFLOP/s)."""
    return mfu(option.cost, shape, finetuning)


@dataclass(frozen=True)
class Cluster:
    """What the go/no-go weighs a plan on: the link between the nodes (None: not measured, with
    `link_note` saying why), the nodes and their ranks, whether a slow plan may train anyway,
    the model's name (for the command that trains on fewer nodes) and the dataset's records
    (a way out never offers a larger batch than it holds)."""

    link: Link | None
    link_note: str
    nnodes: int
    nproc: int
    allow_slow: bool = False
    model_name: str | None = None
    records: int | None = None


def assess(
    search: Search | None, memory: Memory, chosen: Option | None, cluster: Cluster
) -> tuple[dict[str, Any], list[str]]:
    """The plan's predicted performance and the lines that show it; raises PlanError (the
    go/no-go) when the nodes would not pay, unless the cluster allows a slow plan."""
    if search is None or chosen is None:
        why = "CPU cluster" if memory.budget is None else "the model's shape is unknown"
        return {"predicted": False}, [
            f"Predicted speed: not predicted ({why}: the cost model was measured on GPUs, "
            "for models with a config.json)"
        ]
    result, lines = _prediction(search, memory, chosen, cluster)
    link = cluster.link
    if cluster.nnodes < 2:
        return result, lines
    if link is None:
        lines.append(
            f"Link between nodes: not measured ({cluster.link_note}). Communication is not "
            f"counted and the go/no-go is not decided: run {CHECK} first, or set -e link_gbps=N"
        )
        return result, lines
    lines.append(f"Link between nodes: {link.bandwidth * 8 / 1e9:g} Gbit/s ({link.source})")
    scales = _scales(search, memory, chosen, cluster)
    result["scaling"] = [
        {"nodes": s.nodes, "tokens_per_s": round(s.tokens_per_s) if s.tokens_per_s else None,
         "efficiency": round(s.efficiency, 3) if s.efficiency is not None else None}
        for s in scales
    ]  # fmt: skip
    lines.append("Scaling (predicted, per added node): " + scaling_line(scales))
    refusal = go_no_go(scales)
    if refusal is None:
        return result, lines
    if cluster.allow_slow:
        lines.append(f"Scaling: {refusal}; training anyway (-e allow_slow_scaling=true)")
        return result, lines
    raise PlanError(
        f"Refused before launch: {refusal} (link {link.bandwidth * 8 / 1e9:g} Gbit/s, "
        f"{link.source}; plan {chosen.label()}: {chosen.timing()}). Ways out: "
        + "; or ".join(_ways_out(search, memory, chosen, scales, cluster))
        + ". Or train anyway with -e allow_slow_scaling=true. Nothing was changed on any node."
    )


def _prediction(
    search: Search, memory: Memory, chosen: Option, cluster: Cluster
) -> tuple[dict[str, Any], list[str]]:
    """The chosen plan's predicted step, the runner-up and why it lost."""
    world = memory.world
    lines = [
        f"Predicted (planner/cost.py, fitted on one H200): {chosen.label()}: {chosen.timing()}, "
        f"{chosen.cost.tokens_per_second(world):,.0f} tokens/s, MFU "
        f"{option_mfu(chosen, search.shape, memory.finetuning):.0%}"
    ]
    others = [
        o
        for o in search.options
        if (o.variant, o.batch.micro, o.batch.checkpointing)
        != (chosen.variant, chosen.batch.micro, chosen.batch.checkpointing)
    ]
    other = runner_up([chosen, *others]) if others else None
    lines.append(
        f"Runner-up: {other.label()}: {why_lost(chosen, other)}"
        if other is not None
        else "Runner-up: none (no other candidate fits)"
    )
    link = cluster.link
    return {
        "predicted": True,
        "step_s": round(chosen.cost.total, 4),
        "tokens_per_s": round(chosen.cost.tokens_per_second(world)),
        "runner_up": other.label() if other else None,
        "link_gbps": round(link.bandwidth * 8 / 1e9, 3) if link else None,
        "link_source": link.source if link else cluster.link_note,
        "scaling": [],
    }, lines


def _scales(search: Search, memory: Memory, chosen: Option, cluster: Cluster) -> list[Scale]:
    """The best plan's scaling over 1..nnodes nodes, the last being the chosen plan."""
    scales = scaling(
        memory,
        search.asks,
        search.shape,
        cluster.link,
        search.rank,
        nnodes=cluster.nnodes,
        nproc=cluster.nproc,
        tries=search.tries,
    )
    world = memory.world
    scales[-1] = replace(
        scales[-1],
        option=chosen,
        tokens_per_s=chosen.cost.tokens_per_second(world),
        efficiency=_efficiency(scales, chosen, world),
    )
    return scales


def _efficiency(scales: list[Scale], chosen: Option, world: int) -> float:
    """The chosen plan's share of linear scaling against the fewest nodes any plan fits."""
    fits = [s for s in scales[:-1] if s.tokens_per_s]
    if not fits or fits[0].tokens_per_s is None:
        return chosen.cost.compute / chosen.cost.total
    base = fits[0]
    linear = base.tokens_per_s * scales[-1].nodes / base.nodes
    return chosen.cost.tokens_per_second(world) / linear


def _ways_out(
    search: Search, memory: Memory, chosen: Option, scales: list[Scale], cluster: Cluster
) -> list[str]:
    """What would pay, with its predicted figures: fewer nodes, LoRA, more accumulation, a
    faster link."""
    ways = []
    fewer = [s for s in scales[:-1] if s.tokens_per_s]
    if fewer:
        best = max(fewer, key=lambda s: s.tokens_per_s or 0.0)
        ways.append(f"fewer nodes: {best.nodes} "
                    f"({fewer_nodes_command(cluster.model_name, best.nodes)}) at "
                    f"{best.tokens_per_s:,.0f} tokens/s")  # fmt: skip
    if memory.finetuning == "full" and Stage.NONE in search.asks:
        lora = replace(memory, finetuning="lora", technique=PLAIN)
        asks = {s: search.asks[Stage.NONE] for s in search_order("lora")}
        verdict = _verdict(lora, asks, search, cluster, tries=dict.fromkeys(asks, (PLAIN,)))
        if verdict:
            ways.append(f"LoRA (-e finetuning_type=lora): {verdict}")
    more = _more_accumulation(search, memory, cluster)
    if more:
        ways.append(more)
    link = _faster_link(search, memory, chosen, scales, cluster)
    return [*ways, link] if link else ways or ["none predicted to pay on this link"]


def _more_accumulation(search: Search, memory: Memory, cluster: Cluster) -> str:
    """A larger batch that would pay ('' if none does): never more rows per optimizer step than
    the dataset's records (the plan would refuse that batch)."""
    ask = next(iter(search.asks.values()))
    fixed = bool(ask.micro and ask.accumulation) or not ask.packing
    for times in (2, 4, 8, 16, 32, 64, 128):
        rows = (
            (ask.micro or 1) * (ask.accumulation or 1) * times
            if fixed
            else math.ceil(ask.tokens_per_step * times / max(1, ask.cutoff))
        ) * memory.world
        if cluster.records is not None and rows > cluster.records:
            break  # larger batches than the dataset holds: check_dataset_batch refuses them
        if fixed:  # the split is set: more micro-batches of the same size
            more = {s: replace(a, accumulation=(a.accumulation or 1) * times) for s, a in
                    search.asks.items()}  # fmt: skip
            how = (
                f'-e \'{{"train_args": {{"gradient_accumulation_steps": '
                f"{(ask.accumulation or 1) * times}}}}}'"
            )
        else:
            more = {s: replace(a, tokens_per_step=a.tokens_per_step * times) for s, a in
                    search.asks.items()}  # fmt: skip
            how = f"-e tokens_per_step={ask.tokens_per_step * times}"
        verdict = _verdict(memory, more, search, cluster, need_pass=True)
        if verdict:
            return (
                f"more accumulation: {how} ({times} x the tokens per optimizer step, a larger "
                f"batch: {verdict})"
            )
    return ""


def _faster_link(
    search: Search, memory: Memory, chosen: Option, scales: list[Scale], cluster: Cluster
) -> str:
    """The link on which these nodes pay: MIN_EFFICIENCY of linear, and faster than fewer."""
    fewest = next((s for s in scales if s.tokens_per_s), None)
    if fewest is None or not fewest.tokens_per_s or cluster.link is None:
        return ""
    nnodes = cluster.nnodes
    rates = [MIN_EFFICIENCY * fewest.tokens_per_s * nnodes / fewest.nodes]
    rates += [s.tokens_per_s for s in scales[:-1] if s.tokens_per_s]
    seconds = (
        chosen.cost.compute / MIN_EFFICIENCY
        if fewest.nodes == nnodes  # only this many nodes fit: against its own compute
        else chosen.cost.tokens * memory.world / max(rates)
    )
    gbps = needed_gbps(chosen, search.shape, cluster.link, memory.world, seconds)
    fixed = fixed_step_s(chosen, search.shape, cluster.link, memory.world)
    return (
        f"a faster link: at least {gbps:,.3g} Gbit/s for this plan"
        if gbps is not None
        else f"no faster link: at any bandwidth this plan's step takes {fixed:.3g} s (compute "
        f"{chosen.cost.compute:.3g} s, the rest the link's latency and the per-step "
        f"overhead), more than the {seconds:.3g} s at which {nnodes} nodes would pay"
    )


def fewer_nodes_command(model_name: str | None, nodes: int) -> str:
    """The command that trains the same request on the first `nodes` nodes in node rank order
    (train.yml refuses --limit: its plan is for every node of the inventory)."""
    model = f" --model {model_name}" if model_name else ""
    return (
        f"python train_runner.py train{model} --nodes {nodes}, the same -e options; or an "
        "inventory of those nodes alone"
    )


def _verdict(
    memory: Memory,
    asks: Mapping[Stage, BatchRequest],
    search: Search,
    cluster: Cluster,
    *,
    need_pass: bool = False,
    tries: Tries | None = None,
) -> str:
    """'87 % of linear, 12,000 tokens/s' for that variant on the cluster's nodes ('' if nothing
    fits, or if need_pass and it would still be refused); `tries`: the search's unless given."""
    scales = scaling(
        memory,
        asks,
        search.shape,
        cluster.link,
        search.rank,
        nnodes=cluster.nnodes,
        nproc=cluster.nproc,
        tries=search.tries if tries is None else tries,
    )
    last = scales[-1]
    if last.tokens_per_s is None or (need_pass and go_no_go(scales)):
        return ""
    eff = f"{last.efficiency:.0%} of linear, " if last.efficiency is not None else ""
    return f"{eff}{last.tokens_per_s:,.0f} tokens/s predicted"
