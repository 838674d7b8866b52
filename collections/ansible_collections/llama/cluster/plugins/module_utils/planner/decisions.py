"""The decisions the memory model and the run length make: the DeepSpeed stage, the micro-batch
and accumulation, torch.compile and FP8 (`choose_stage`, `choose_batch`, `choose_compile`,
`choose_fp8`); and the batches refused with the largest that fits (`largest_micro`,
`check_cpu_batch`, `check_dataset_batch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .errors import PlanError
from .memory import Memory, gib_text
from .techniques import PLAIN, Technique

STAGE_ORDER = {
    # Never ZeRO-3 while a smaller stage fits: it gathers every layer's weights over the network
    # on every step (BENCHMARKS.md rule 8). ZeRO-2 shards nothing a LoRA run holds a lot of.
    "full": ("none", "zero2", "zero3", "zero3_offload"),
    "lora": ("none", "zero3", "zero3_offload"),
    "freeze": ("none", "zero3", "zero3_offload"),
}


def fitting_stage(memory: Memory, cutoff: int) -> str | None:
    """The first stage of STAGE_ORDER that fits both budgets with one checkpointed row of
    cutoff_len tokens (the smallest micro-batch any plan can use), or None."""
    for stage in STAGE_ORDER[memory.finetuning]:
        if memory.fits(stage, cutoff, checkpointing=True) and memory.host_fits(stage):
            return stage
    return None


def choose_stage(memory: Memory, cutoff: int, accelerator: str, nnodes: int = 1) -> tuple[str, str]:
    """The DeepSpeed stage for `deepspeed=auto`, and why; refuses, with the ways out, when no
    stage fits the GPU memory and the host memory of the smallest node."""
    if accelerator == "cpu" or memory.budget is None:
        return "none", "CPU cluster: plain DDP over gloo"
    skipped = []
    for stage in STAGE_ORDER[memory.finetuning]:
        need = memory.need(stage, cutoff, checkpointing=True)
        if need > memory.budget:
            skipped.append(f"{stage} ({gib_text(need)} of GPU memory)")
            continue
        if not memory.host_fits(stage):
            skipped.append(f"{stage} ({gib_text(memory.host_need(stage))} of host memory)")
            continue
        why = (
            f"{gib_text(need)} needed at the smallest micro-batch, budget {gib_text(memory.budget)}"
        )
        return stage, why + ("; " + ", ".join(skipped) + " would not fit" if skipped else "")
    raise PlanError(
        f"The model does not fit even with ZeRO-3 and CPU offload: one row of "
        f"cutoff_len={cutoff} tokens per GPU needs "
        + ", ".join(skipped)
        + f"; the budgets are {gib_text(memory.budget)} of GPU memory per GPU and "
        + f"{gib_text(memory.host_budget)} of host memory per node ({memory.nproc} processes). "
        + ways_out(memory, cutoff, nnodes)
    )


def ways_out(memory: Memory, cutoff: int, nnodes: int) -> str:
    """The smallest changes that would fit, as the user asks for them."""
    ways = []
    shorter = cutoff // 2
    while shorter >= 256:
        if fitting_stage(memory, shorter):
            ways.append(f"Lower cutoff_len (-e cutoff_len={shorter})")
            break
        shorter //= 2
    if memory.finetuning == "full" and fitting_stage(replace(memory, finetuning="lora"), cutoff):
        ways.append("LoRA (-e finetuning_type=lora)")
    for more in (2, 3, 4, 8):
        bigger = replace(memory, world=memory.world * more)
        if fitting_stage(bigger, cutoff):
            ways.append(f"{nnodes * more} nodes like the smallest one")
            break
    if not ways:
        return "Nothing small fits it: a larger GPU or more host memory."
    return "Ways out: " + "; or ".join(ways) + "."


@dataclass(frozen=True)
class BatchRequest:
    """What the batch rule starts from; None where nobody set the value."""

    cutoff: int
    tokens_per_step: int
    packing: bool
    micro: int | None = None
    accumulation: int | None = None
    checkpointing: bool | None = None
    default_micro: int = 1
    default_accumulation: int = 1


@dataclass(frozen=True)
class Batch:
    """Micro-batch, accumulation and checkpointing, why, and the memory they need."""

    micro: int
    accumulation: int
    checkpointing: bool
    reason: str
    need: float | None = None


def choose_batch(
    memory: Memory,
    stage: str,
    ask: BatchRequest,
    cost: Callable[[Batch], float] | None = None,
) -> Batch:
    """Micro-batch and accumulation from the tokens per step, and checkpointing from memory.

    With packing a micro-batch is rows of cutoff_len tokens: rows = tokens_per_step / cutoff_len
    per GPU per optimizer step (BENCHMARKS.md rule 2), split into the largest micro-batch that
    fits without gradient checkpointing (rule 3), else the largest that fits with it; with a
    cost model (`cost`: a batch's predicted step time), the fitting split it predicts fastest.
    Values set by the user, a rule or the catalogue are kept. Without packing the micro-batch
    and accumulation come from the settings, and checkpointing still follows memory.
    """
    fitting = batch_options(memory, stage, ask)
    if cost is None or len(fitting) < 2:
        return fitting[0]
    # Per token: a user's accumulation with a smaller micro-batch is fewer tokens per step.
    best = min(fitting, key=lambda b: cost(b) / (b.micro * b.accumulation))  # first of equals
    base = best.reason.split("; ")[0]
    how = "with" if best.checkpointing else "without"
    return replace(
        best,
        reason=f"{base}; {best.micro} per micro-batch {how} gradient checkpointing, the fastest "
        f"predicted of {len(fitting)} splits that fit",
    )


def batch_options(memory: Memory, stage: str, ask: BatchRequest) -> list[Batch]:
    """Every split of the tokens per step that fits (choose_batch's order: no checkpointing
    first, larger micro-batches first); refuses, naming the figures, when none does."""
    options = [ask.checkpointing] if ask.checkpointing is not None else [False, True]
    rows = max(1, _round(ask.tokens_per_step / ask.cutoff))
    if not ask.packing or (ask.micro and ask.accumulation):
        micro = ask.micro or ask.default_micro
        accumulation = ask.accumulation or ask.default_accumulation
        why = "as set" if ask.micro or ask.accumulation else "training_defaults: no packing"
        candidates = [(micro, accumulation)]
    else:
        why = f"{rows} packed rows of {ask.cutoff} tokens per process per step"
        if ask.micro:
            micros = [ask.micro]
        elif ask.accumulation:
            micros = list(range(max(1, _round(rows / ask.accumulation)), 0, -1))
        else:  # divisors of rows, largest first: the tokens per step stay exactly as asked
            micros = [m for m in range(rows, 0, -1) if rows % m == 0]
        candidates = [(m, ask.accumulation or max(1, _round(rows / m))) for m in micros]
    if memory.shape is None:  # activations unknown: the smallest micro-batch, recomputed
        micro, accumulation = candidates[-1]
        why += "; model shape unknown (no config.json): smallest micro-batch"
        return [Batch(micro, accumulation, options[-1], why, memory.state(stage))]
    fitting: list[Batch] = []
    for checkpointing in options:
        first = True
        for micro, accumulation in candidates:
            if memory.fits(stage, micro * ask.cutoff, checkpointing):
                need = memory.need(stage, micro * ask.cutoff, checkpointing)
                text = why
                if len(candidates) > 1:
                    text += (
                        f"; {micro} per micro-batch"
                        + (", the most that fit " if first else " ")
                        + ("with" if checkpointing else "without")
                        + " gradient checkpointing"
                    )
                first = False
                fitting.append(Batch(micro, accumulation, checkpointing, text, need))
    if fitting:
        return fitting
    micro = candidates[-1][0]
    checkpointing = options[-1]
    raise PlanError(
        f"The run does not fit the GPUs: deepspeed={stage} with a micro-batch of {micro} x "
        f"{ask.cutoff} tokens needs about "
        f"{gib_text(memory.need(stage, micro * ask.cutoff, checkpointing))} per GPU "
        f"{'even with' if checkpointing else 'without'} gradient checkpointing, and the budget is "
        f"{gib_text(memory.budget)}. "
        + _largest_text(memory, stage, micro, ask.cutoff, checkpointing)
        + " Or use deepspeed=auto, a smaller cutoff_len, or more GPUs."
    )


def largest_micro(fits: Callable[[int], bool], below: int) -> int:
    """The largest micro-batch under `below` that `fits` (0 when not even 1 does); `fits` grows
    false with the micro-batch, so a binary search finds it."""
    low, high = 0, below - 1  # fits(low) holds (0 stands for none); the answer is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _largest_text(memory: Memory, stage: str, micro: int, cutoff: int, ckpt: bool) -> str:
    """The sentence naming the largest micro-batch that fits where `micro` does not."""
    largest = largest_micro(lambda m: memory.fits(stage, m * cutoff, ckpt), micro)
    if largest:
        return (
            f"The largest micro-batch that fits is {largest}: "
            f'-e \'{{"train_args": {{"per_device_train_batch_size": {largest}}}}}\'.'
        )
    return f"Not even a micro-batch of 1 row of {cutoff} tokens fits."


def check_cpu_batch(memory: Memory, micro: int, cutoff: int, checkpointing: bool) -> None:
    """PlanError, naming the largest micro-batch that fits, where a CPU run's micro-batch does
    not fit the host memory each process may use (`memory.budget`: the smallest node's usable
    RAM divided among its processes; the activations as the memory model counts them on a GPU,
    a lower bound for a CPU's fp32). Nothing to check without a budget or a model shape."""
    if memory.budget is None or memory.shape is None:
        return
    if memory.fits("none", micro * cutoff, checkpointing):
        return
    need = memory.need("none", micro * cutoff, checkpointing)
    raise PlanError(
        f"The run does not fit the nodes' memory: a micro-batch of {micro} x {cutoff} tokens "
        f"needs about {gib_text(need)} per process, and each of the {memory.nproc} process(es) "
        f"of the smallest node may use {gib_text(memory.budget)}. "
        + _largest_text(memory, "none", micro, cutoff, checkpointing)
        + " Or a smaller cutoff_len."
    )


def check_dataset_batch(
    *, micro: int, accumulation: int, world: int, records: int | None, packing: bool
) -> None:
    """PlanError, naming the largest batch that fits, where one optimizer step asks for more
    records than the dataset holds (each of the `world` processes takes `micro` rows per
    micro-step, `accumulation` micro-steps per step; with packing a row holds at least one
    record, so rows beyond the records are always too many). Nothing to check where the
    records are not known."""
    if records is None or micro * accumulation * world <= records:
        return
    what = "rows (packed)" if packing else "records"
    asked = (
        f"The effective batch is {micro * accumulation * world} {what} per optimizer step "
        f"(per_device_train_batch_size {micro} x gradient_accumulation_steps {accumulation} x "
        f"{world} processes), more than the dataset's {records} records"
    )
    if records < world:
        raise PlanError(
            f"{asked}: fewer records than processes, so some would train on nothing. Use a "
            "larger dataset (-e dataset=..., -e dataset_file=...) or fewer nodes."
        )
    fit_micro = records // (accumulation * world)
    fit_micro, fit_accumulation = (fit_micro, accumulation) if fit_micro else (1, records // world)
    raise PlanError(
        f"{asked}. The largest that fits is per_device_train_batch_size={fit_micro} with "
        f"gradient_accumulation_steps={fit_accumulation} (effective batch "
        f'{fit_micro * fit_accumulation * world}): -e \'{{"train_args": '
        f'{{"per_device_train_batch_size": {fit_micro}, "gradient_accumulation_steps": '
        f"{fit_accumulation}}}}}'. Or a larger dataset."
    )


def _round(value: float) -> int:
    """Round half up (2.5 -> 3), unlike round()."""
    return math.floor(value + 0.5)


def step_rows(ask: BatchRequest) -> int:
    """Rows (packed) or samples of one process per optimizer step, however batch_options splits
    them into micro-batch x accumulation."""
    if (ask.micro and ask.accumulation) or not ask.packing:
        return (ask.micro or ask.default_micro) * (ask.accumulation or ask.default_accumulation)
    return max(1, _round(ask.tokens_per_step / ask.cutoff))


def estimate_steps(
    args: Mapping[str, Any], *, records: int | None, world: int, cutoff: int, record_tokens: int
) -> int | None:
    """Optimizer steps of the run: max_steps, else epochs x records / records per step.

    With packing a row of cutoff_len holds about cutoff_len / record_tokens records.
    """
    max_steps = int(args.get("max_steps") or -1)
    if max_steps > 0:
        return max_steps
    if records is None:
        return None
    if args.get("max_samples"):
        records = min(records, int(args["max_samples"]))
    per_row = max(1.0, cutoff / record_tokens) if args.get("packing") else 1.0
    micro = int(args.get("per_device_train_batch_size", 1))
    per_step = micro * int(args.get("gradient_accumulation_steps", 1)) * world * per_row
    return int(float(args.get("num_train_epochs", 1)) * math.ceil(records / per_step))


def _compile_blocked(accelerator: str, stage: str, steps: int | None) -> str:
    """Why torch.compile cannot be weighed at all ('' when it can)."""
    if accelerator == "cpu":
        return "never on CPUs"
    if stage != "none":
        return "measured with plain DDP only, not with DeepSpeed or FSDP"
    if steps is None:
        return "run length unknown: no max_steps and no dataset record count"
    return ""


def choose_compile(
    accelerator: str,
    stage: str,
    steps: int | None,
    settings: Mapping[str, Any],
    *,
    step_seconds: float | None = None,
    finetuning: str = "full",
    technique: Technique = PLAIN,
) -> tuple[bool, str]:
    """torch.compile when the run is long enough to repay its compilation; never on CPUs.

    With a predicted step time of `technique` uncompiled (the cost model's), compiling pays when
    the time it saves over the run, `steps` x `step_seconds` x the share of a step it saved that
    technique (techniques.COMPILE_SAVING), is at least its measured one-off cost; near that point
    either choice costs little. A technique it was not measured with is not compiled. Without a
    step time (no model shape), the run must have `min_optimizer_steps`.
    """
    blocked = _compile_blocked(accelerator, stage, steps)
    if blocked or steps is None:
        return False, blocked
    if step_seconds is None:
        minimum = int(settings["min_optimizer_steps"])
        if steps < minimum:
            return False, f"about {steps} optimizer steps, fewer than the {minimum} that repay it"
        return True, f"about {steps} optimizer steps (model shape unknown: at least {minimum})"
    saving = technique.compile_saving(finetuning)
    if saving is None:
        failed = technique.compile_failure(finetuning)
        return False, failed or f"not measured with {technique.uncompiled.label()}"
    costs = settings["compile_seconds"]
    cost = float(costs.get("lora" if finetuning == "lora" else "full", 0))
    saved = steps * step_seconds * saving
    verdict = (
        f"about {steps} optimizer steps of ~{step_seconds:.2f} s save ~{saved:.0f} s "
        f"({saving:.0%} of each) against ~{cost:.0f} s of compiling"
    )
    return saved >= cost, verdict


# FP8 matmuls (torchao's float8) need Ada (8.9: RTX 4090, L40S) or newer (Hopper 9.0, Blackwell).
FP8_MIN_CAPABILITY = 8.9
# LLaMA-Factory 0.9.5's `fp8: true` alone trains in bf16 under transformers 5.6 (BENCHMARKS.md 7,
# third session): TrainingArguments fixes mixed_precision from bf16 before LLaMA-Factory sets
# ACCELERATE_MIXED_PRECISION. The variable in the ranks' environment and bf16 off make it real.
# FP8 was measured compiled only (torchao's float8 casts are fused by torch.compile).
FP8_TRAIN_ARGS = {"fp8": True, "fp8_backend": "torchao", "bf16": False, "torch_compile": True}
FP8_ENVIRONMENT = {"ACCELERATE_MIXED_PRECISION": "fp8"}
# What FP8 gave, by the shape it was measured at (parameters in billions): its tokens/s over
# bf16's, both compiled, on one H200 (BENCHMARKS.md 7, third session). Elsewhere not measured.
FP8_MEASURED = {1.54: 1.06}
FP8_SHAPES = "; ".join(f"{b:g}B full fine-tune {x:g}x bf16" for b, x in FP8_MEASURED.items())


def first_step(
    params_b: float, *, compiled: bool, fp8: bool, finetuning: str, settings: Mapping[str, Any]
) -> tuple[float, str]:
    """Seconds from a rank's launch to its first optimizer step (start-up and the model's load,
    then compiling), and the plan's words for it (training_compile's measured figures)."""
    start = float(settings["startup_seconds"]) + float(settings["load_seconds_per_b"]) * params_b
    kind = "fp8" if fp8 else "lora" if finetuning == "lora" else "full"
    compiling = float(settings["compile_seconds"][kind]) if compiled or fp8 else 0.0
    text = (
        f"about {start + compiling:.0f} s after the ranks start (start-up and loading the model "
        f"~{start:.0f} s" + (f", compiling ~{compiling:.0f} s" if compiling else "") + ")"
    )
    return start + compiling, text


def fp8_pays(
    params_b: float,
    *,
    steps: int | None,
    step_seconds: float | None,
    settings: Mapping[str, Any],
) -> tuple[bool, str]:
    """Whether FP8 ends the run sooner than bf16 compiled: its measured gain at this shape over
    the run's steps against its longer compilation; True, with why, where not measured."""
    measured = next((x for b, x in FP8_MEASURED.items() if abs(b - params_b) <= 0.25 * b), None)
    if measured is None:
        return True, f"not measured at {params_b:g}B (measured: {FP8_SHAPES})"
    extra = float(settings["compile_seconds"]["fp8"]) - float(settings["compile_seconds"]["full"])
    if steps is None or step_seconds is None:
        return True, f"{measured:g}x bf16 measured at this shape; the run's length is unknown"
    saved = steps * step_seconds * (1 - 1 / measured)
    why = (
        f"about {steps} optimizer steps of ~{step_seconds:.2f} s save ~{saved:.0f} s at the "
        f"{measured:g}x measured at this shape, against ~{extra:.0f} s more compiling than bf16"
    )
    return saved >= extra, why


def choose_fp8(
    nodes: Sequence[Mapping[str, Any]],
    accelerator: str,
    stage: str,
    pays: tuple[bool, str] = (True, "run length unknown"),
) -> tuple[dict[str, Any], dict[str, str], str]:
    """The training arguments and environment of an FP8 run, and the plan's line about it;
    PlanError where FP8 cannot run, naming the nodes and the way out, or where it would end
    the run later than bf16 (`pays`: fp8_pays)."""
    off = "Leave fp8 off (bf16)"
    if not pays[0]:
        raise PlanError(
            f"FP8 would end this run later than bf16: {pays[1]}. {off}, or train longer "
            "(max_steps, num_train_epochs)."
        )
    if accelerator == "cpu":
        raise PlanError(f"FP8 needs NVIDIA GPUs; this cluster trains on CPUs. {off}.")
    unknown = [n["host"] for n in nodes if n.get("compute_capability") is None]
    if unknown:
        raise PlanError(
            f"FP8 needs GPUs of compute capability {FP8_MIN_CAPABILITY} or newer, and the facts of "
            f"{', '.join(unknown)} do not say theirs (recorded since this release): run "
            f"provision.yml --tags host_facts, then train again. Or: {off}."
        )
    old = [
        f"{n['host']} ({n['compute_capability']:g})"
        for n in nodes
        if float(n["compute_capability"]) < FP8_MIN_CAPABILITY
    ]
    if old:
        raise PlanError(
            f"FP8 needs GPUs of compute capability {FP8_MIN_CAPABILITY} or newer (Ada: RTX 4090, "
            f"L40S; Hopper: H100, H200); {', '.join(old)} cannot run FP8 matmuls. {off}."
        )
    if stage != "none":
        raise PlanError(
            f"FP8 was measured with plain DDP only, and this plan needs deepspeed={stage}. "
            f"{off}, or give the run more GPU memory (more nodes, LoRA) so that no sharding is "
            "needed."
        )
    missing = [n["host"] for n in nodes if not n.get("torchao")]
    if missing:
        raise PlanError(
            f"FP8 trains through torchao, which is not installed on {', '.join(missing)}: add "
            "torchao to llamafactory_extras in the inventory and run provision.yml. Or: "
            f"{off}."
        )
    line = (
        "FP8: on (torchao float8 linear layers, bf16 autocast, compiled; what it gives, measured "
        f"on one H200: {FP8_SHAPES}, 16 % less GPU memory, about 4 minutes of compiling, loss "
        f"within 0.6 of bf16's over 70 steps; this run: {pays[1]})"
    )
    return dict(FP8_TRAIN_ARGS), dict(FP8_ENVIRONMENT), line
