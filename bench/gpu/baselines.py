#!/usr/bin/env python3
"""Issue 21's honest comparisons and targets, side by side in one device call.

    baselines.py run --mode gpu|cpu --playbook PATH --out DIR [--deadline-s S] PHASE...

Phases (each skipped, and says so, when its estimate would pass the deadline):

- ``setup``: as harness.py's (versions, GPUs, matmul rate, node facts, models, data).
- ``base-<goal>`` (``base-1.5b``, ``base-7b``, ``base-7bfull``): four ways to train the same model
  on the same data at the same tokens per optimizer step, on one GPU:
  (d) train.yml with no options (the product: what a user gets);
  (a) LLaMA-Factory's example config as shipped (micro-batch 1), accumulation matched to (d);
  (b) the same with the micro-batch raised to hold an optimizer step's samples (accumulation 1;
      halved, accumulation doubled, while it runs out of memory);
  (c) an expert's hand configs over LLaMA-Factory's documented options: packing, gradient
      checkpointing off, the micro-batch of a packed step, torch_compile; the best of them is (c).
  Liger kernels are left out of (c): BENCHMARKS.md section 1 measured them slower at these shapes.
- ``cd-<goal>``: only (c3), the expert's compiled config, and (d), train.yml with no options,
  both with a compile-sized window: does the planner reach the expert's best config?
- ``target-<goal>``: train.yml alone (d), for the issue's targets (a 7B full fine-tune).
- ``cap<N>-<goal>`` (``cap24-1.5b``): the same on an emulated GPU of N GiB.
- ``fp8-<goal>``: train.yml with torch.compile, bf16 against ``fp8: true`` (torchao), same data
  and seed: tokens/s and the loss difference (LLaMA-Factory's float8 wants compiled kernels).
- ``cards<N>-<goal>`` (``cards24-1.5bfull``, ``cards48-1.5bfull``, ``cards24-14blora``): issue 38:
  on an emulated GPU of N GiB, train.yml with no options against CARD_VARIANTS, the hand configs
  of a memory-bound expert (8-bit AdamW, compiled; Liger), same data, one after the other.

A GPU cap (``cap<N>-`` phases, or ``--gpu-cap-gib N`` for the whole call) emulates a smaller GPU:
every training process (train.yml's ranks and the hand runs) caps itself with
``torch.cuda.set_per_process_memory_fraction(N / total)`` from a sitecustomize.py on PYTHONPATH,
and train.yml plans for N GiB (the ``gpu_memory_gib`` knob). Only the memory is emulated:
bandwidth, compute and the host stay the H200 machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # this folder is not a package: imported from the path set above
from harness import Box, Ctx, Goal

GOALS = {
    **harness.GOALS,
    "7bfull": Goal("qwen2.5-7b", "7b", "full", 1.0, None),
    # Issue 38: a full fine-tune on a 24/48 GiB card; a 14B-class LoRA, which the planner trains
    # as QLoRA on 24 GiB.
    "1.5bfull": Goal("qwen2.5-1.5b", "1.5b", "full", 1.0, None),
    "14blora": Goal("qwen2.5-14b", "14b", "lora", 1.0, None),
    # Issue 46: an 8B LoRA on a 24 GiB card, against 32 % MFU.
    "8blora": Goal("qwen3-8b", "8b", "lora", 1.0, 0.32),
}
# Issue 38's hand configs for a card of a few tens of GiB, over LLaMA-Factory's documented
# options, by fine-tuning type: for a full fine-tune the (torchao's 8-bit AdamW, 2 rows
# accumulated twice, checkpointing, compiled), the same with bitsandbytes' 8-bit AdamW, and 4 rows
# with Liger's fused loss; for LoRA, QLoRA at 2 x 2 and 1 x 4 and bf16 LoRA with Liger.
# In the order they run (a call's deadline skips the last): issue 46 put first the best of
# issue 38's call (bitsandbytes' 8-bit AdamW 2 x 2, compiled) and the same with Liger compiled.
CARD_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "h_bnb8_2x2_compile": {"optim": "adamw_8bit", "per_device_train_batch_size": 2,
                               "gradient_accumulation_steps": 2, "torch_compile": True},
        "h_bnb8_liger_4x1_compile": {"optim": "adamw_8bit", "per_device_train_batch_size": 4,
                                     "gradient_accumulation_steps": 1, "enable_liger_kernel": True,
                                     "torch_compile": True},
        "h_bnb8_liger_4x1": {"optim": "adamw_8bit", "per_device_train_batch_size": 4,
                             "gradient_accumulation_steps": 1, "enable_liger_kernel": True},
        "h_torchao8_2x2_compile": {"optim": "adamw_torch_8bit", "per_device_train_batch_size": 2,
                                   "gradient_accumulation_steps": 2, "torch_compile": True},
    },
    "lora": {
        "h_liger_4x1_compile": {"enable_liger_kernel": True, "per_device_train_batch_size": 4,
                                "gradient_accumulation_steps": 1, "torch_compile": True},
        "h_qlora_2x2": {"quantization_bit": 4, "per_device_train_batch_size": 2,
                        "gradient_accumulation_steps": 2},
        "h_qlora_1x4": {"quantization_bit": 4, "per_device_train_batch_size": 1,
                        "gradient_accumulation_steps": 4},
        "h_liger_2x2": {"enable_liger_kernel": True, "per_device_train_batch_size": 2,
                        "gradient_accumulation_steps": 2},
    },
}  # fmt: skip
# Seconds a hand run takes, compiled or not (start-up, compiling, a window): a card variant
# starts only with as much left.
HAND_SECONDS = {True: 150.0, False: 70.0}
# Issue 21's targets through train.yml (tokens/s of the product).
TARGETS = {"7bfull": 5000.0}
# A compiled run needs its first steps for compilation before the timed window.
COMPILE_BOX = Box(warmup=10, min_steps=10, seconds=12, cap=300)
# FP8 compiled for about 4 minutes where it was measured (BENCHMARKS.md 7, third session; the
# plan's first step says so): issue 46's FP8 run, watched 210 s, logged no step.
FP8_BOX = Box(warmup=10, min_steps=10, seconds=12, cap=450)
# A target run may load a 7B model and compile it before its window.
TARGET_BOX = Box(warmup=8, min_steps=10, seconds=12, cap=420)

# Written into the GPU-cap folder that PYTHONPATH names: it runs at start-up in every Python
# process of a run; the cap applies in the ranks (torchrun sets LOCAL_RANK) and once per process
# tree (a spawned data worker inherits LLAMA_BENCH_GPU_CAP_DONE and is left alone).
SITECUSTOMIZE = """\
import os
_cap = os.environ.get("LLAMA_BENCH_GPU_CAP_GIB")
if _cap and "LOCAL_RANK" in os.environ and os.environ.get("LLAMA_BENCH_GPU_CAP_DONE") != "1":
    os.environ["LLAMA_BENCH_GPU_CAP_DONE"] = "1"
    import torch
    if torch.cuda.is_available():
        _total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(_cap) * 2**30 / _total), 0)
"""


def cap_gpu(ctx: Ctx, gib: float | None) -> None:
    """Every training process from now on caps its GPU memory at `gib` and train.yml plans for
    it; None lifts the cap."""
    if gib is None:
        ctx.extra_env.pop("PYTHONPATH", None)
        ctx.extra_env.pop("LLAMA_BENCH_GPU_CAP_GIB", None)
        ctx.gpu_memory_gib = None
        return
    folder = ctx.work / "gpucap"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    ctx.extra_env.update({"PYTHONPATH": str(folder), "LLAMA_BENCH_GPU_CAP_GIB": str(gib)})
    ctx.gpu_memory_gib = gib


def size_of(ctx: Ctx, goal: Goal) -> str:
    """The generated model of a goal (the dry run trains the tiny shape for every goal)."""
    return ctx.mode.sizes[goal.size]


def parse_phase(phase: str) -> tuple[str, str, float | None]:
    """(kind, goal, GPU cap in GiB) of a phase name; SystemExit naming the phases if unknown."""
    kind, _, key = phase.partition("-")
    cap = None
    if kind.startswith("cap") and kind[3:].replace(".", "", 1).isdigit():
        kind, cap = "target", float(kind[3:])
    elif kind.startswith("cards") and kind[5:].replace(".", "", 1).isdigit():
        kind, cap = "cards", float(kind[5:])
    if kind == "setup" and not key:
        return kind, "", None
    if kind not in ("base", "cd", "target", "fp8", "cards") or key not in GOALS:
        raise SystemExit(
            f"unknown phase {phase}: setup, base-<goal>, cd-<goal>, target-<goal>,"
            " cap<GiB>-<goal>, cards<GiB>-<goal>, fp8-<goal>;"
            f" goals: {' '.join(GOALS)}"
        )
    return kind, key, cap


def phase_sizes(ctx: Ctx, phase: str) -> set[str]:
    """The model shape a phase trains."""
    kind, key, _ = parse_phase(phase)
    return {size_of(ctx, GOALS[key])} if kind != "setup" else set()


def lengths_of(ctx: Ctx, goal: Goal, cutoff: int) -> list[int]:
    """Tokens of every sample as the template renders them."""
    return harness.sample_tokens(ctx, goal.size, cutoff)


def finish(
    ctx: Ctx, res: dict[str, Any], goal: Goal, dest: Path, *, lengths: list[int], config: str
) -> dict[str, Any]:
    """Real tokens (packed rows' filler out) and MFU of one run."""
    cutoff = int(res.get("rendered", {}).get("cutoff_len") or 2048)
    harness.real_tokens(res, dest, lengths, config)
    harness.add_mfu(ctx, res, goal, harness.context(res, cutoff, lengths), 1)
    return harness.save(dest, res)


def product(ctx: Ctx, dest: Path, goal: Goal) -> dict[str, Any]:
    """(d): train.yml with no options, detached, stopped after the window."""
    res = harness.product(ctx, dest, goal, box=ctx.mode.product, reserve=0)
    cutoff = int(res.get("rendered", {}).get("cutoff_len") or 2048)
    res = finish(ctx, res, goal, dest, lengths=lengths_of(ctx, goal, cutoff), config="train.yaml")
    harness.say(f"{dest.name}: {harness.short(res)}")
    return res


def hand(
    ctx: Ctx,
    dest: Path,
    goal: Goal,
    accumulation: int,
    *,
    settings: dict[str, Any],
    cutoff: int,
    box: Box | None = None,
) -> dict[str, Any]:
    """One hand-launched config: the example with `settings` over it."""
    res = harness.example(
        ctx, dest, goal, accumulation, box or ctx.mode.example, cutoff=cutoff, settings=settings
    )
    res = finish(ctx, res, goal, dest, lengths=lengths_of(ctx, goal, cutoff), config="example.yaml")
    harness.say(f"{dest.name}: {harness.short(res)}")
    return res


def out_of_memory(res: dict[str, Any]) -> bool:
    """Whether a failed run ran out of GPU memory."""
    text = f"{res.get('cause', '')} {res.get('error', '')}".lower()
    return not res.get("ok") and "out of memory" in text


def expert_variants(tokens: float, cutoff: int) -> dict[str, dict[str, Any]]:
    """(c): an expert's configs over LLaMA-Factory's documented options at `tokens` per step."""
    rows = max(1, round(tokens / cutoff))
    packed = {"packing": True, "per_device_train_batch_size": rows}
    return {
        "c1_packed": packed,
        "c2_packed_nockpt": {**packed, "disable_gradient_checkpointing": True},
        "c3_packed_nockpt_compile": {
            **packed,
            "disable_gradient_checkpointing": True,
            "torch_compile": True,
        },
    }


def base_phase(ctx: Ctx, key: str) -> dict[str, Any]:
    """(a)-(d) for one goal, one after the other on the same GPU."""
    goal = GOALS[key]
    dest = ctx.results / f"base-{key}"
    harness.say(f"base {key}: (d) train.yml, no options")
    runs: dict[str, dict[str, Any]] = {"d_train_yml": product(ctx, dest / "d_train_yml", goal)}
    prod = runs["d_train_yml"]
    cutoff = int(prod.get("rendered", {}).get("cutoff_len") or 2048)
    lengths = lengths_of(ctx, goal, cutoff)
    mean_len = sum(lengths) / len(lengths)
    tokens = float(prod.get("tokens_per_step") or 8192)
    samples = max(1, round(tokens / mean_len))
    harness.say(f"base {key}: (a) the example, micro-batch 1 x {samples} ({tokens:.0f} tokens)")
    runs["a_example"] = hand(ctx, dest / "a_example", goal, samples, settings={}, cutoff=cutoff)
    micro, accumulation = samples, 1
    while True:
        harness.say(f"base {key}: (b) the example, micro-batch {micro} x {accumulation}")
        res = hand(
            ctx,
            dest / "b_example_batch",
            goal,
            accumulation,
            settings={"per_device_train_batch_size": micro},
            cutoff=cutoff,
        )
        if not out_of_memory(res) or micro == 1:
            break
        micro, accumulation = max(1, micro // 2), accumulation * 2
    runs["b_example_batch"] = res
    for name, settings in expert_variants(tokens, cutoff).items():
        if ctx.left() < 90:
            harness.say(f"base {key}: skip {name}, {ctx.left():.0f} s left")
            continue
        box = COMPILE_BOX if settings.get("torch_compile") else None
        runs[name] = hand(ctx, dest / name, goal, 1, settings=settings, cutoff=cutoff, box=box)
    return harness.save(dest, summarise(key, goal, runs))


def product_in(ctx: Ctx, dest: Path, goal: Goal, box: Box) -> dict[str, Any]:
    """train.yml's run of `goal` with `box` as the product's mode for this run only."""
    saved, ctx.mode.product = ctx.mode.product, box
    try:
        return product(ctx, dest, goal)
    finally:
        ctx.mode.product = saved


def cd_phase(ctx: Ctx, key: str) -> dict[str, Any]:
    """(c3) and (d) alone, one after the other, each measured after its compilation."""
    goal = GOALS[key]
    dest = ctx.results / f"cd-{key}"
    runs: dict[str, dict[str, Any]] = {
        "d_train_yml": product_in(ctx, dest / "d_train_yml", goal, COMPILE_BOX)
    }
    prod = runs["d_train_yml"]
    cutoff = int(prod.get("rendered", {}).get("cutoff_len") or 2048)
    tokens = float(prod.get("tokens_per_step") or 8192)
    name = "c3_packed_nockpt_compile"
    settings = expert_variants(tokens, cutoff)[name]
    runs[name] = hand(ctx, dest / name, goal, 1, settings=settings, cutoff=cutoff, box=COMPILE_BOX)
    return harness.save(dest, summarise(key, goal, runs))


def summarise(key: str, goal: Goal, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ratios the issue asks for: (d)/(a), (d)/(b), (d)/(c) and each run's MFU."""
    speed = {name: r.get("tokens_per_s") for name, r in runs.items() if r.get("ok")}
    experts = {n: s for n, s in speed.items() if n.startswith("c")}
    best = max(experts, key=lambda n: experts[n]) if experts else None
    summary: dict[str, Any] = {
        "goal": key,
        "model": goal.model,
        "finetuning": goal.finetuning,
        "runs": {
            name: {
                "ok": r.get("ok"),
                "tokens_per_s": r.get("tokens_per_s"),
                "tokens_per_step": r.get("tokens_per_step"),
                "step_s": r.get("step_s"),
                "mfu": r.get("mfu"),
                "peak_alloc_gib": r.get("peak_alloc_gib"),
                "rendered": r.get("rendered"),
                "cause": r.get("cause"),
            }
            for name, r in runs.items()
        },
        "c_best": best,
    }
    d = speed.get("d_train_yml")
    for label, other in (("a", "a_example"), ("b", "b_example_batch"), ("c", best)):
        if d and other and speed.get(other):
            summary[f"d_over_{label}"] = round(d / speed[other], 3)
    return summary


def target_phase(ctx: Ctx, key: str) -> dict[str, Any]:
    """train.yml alone for one goal, against the issue's target where it names one."""
    goal = GOALS[key]
    cap = f"-cap{ctx.gpu_memory_gib:g}" if ctx.gpu_memory_gib else ""
    dest = ctx.results / f"target-{key}{cap}"
    res = product_in(ctx, dest, goal, TARGET_BOX)
    target = TARGETS.get(key)
    if target and res.get("tokens_per_s"):
        res["target_tokens_per_s"] = target
        res["target_met"] = res["tokens_per_s"] >= target
    return harness.save(dest, res)


def cards_phase(ctx: Ctx, key: str) -> dict[str, Any]:
    """Issue 38: under the call's GPU cap, train.yml with no options against the hand configs
    of CARD_VARIANTS, one after the other on the same GPU, each measured after compiling."""
    goal = GOALS[key]
    dest = ctx.results / f"cards{ctx.gpu_memory_gib:g}-{key}"
    runs: dict[str, dict[str, Any]] = {
        "d_train_yml": product_in(ctx, dest / "d_train_yml", goal, COMPILE_BOX)
    }
    prod = runs["d_train_yml"]
    cutoff = int(prod.get("rendered", {}).get("cutoff_len") or 2048)
    base = {"packing": True, "disable_gradient_checkpointing": False}
    for name, settings in CARD_VARIANTS[goal.finetuning].items():
        if ctx.left() < HAND_SECONDS[bool(settings.get("torch_compile"))]:
            harness.say(f"cards {key}: skip {name}, {ctx.left():.0f} s left")
            continue
        accumulation = int(settings.get("gradient_accumulation_steps", 1))
        runs[name] = hand(ctx, dest / name, goal, accumulation, settings={**base, **settings},
                          cutoff=cutoff, box=COMPILE_BOX)  # fmt: skip
    summary = summarise(key, goal, {n.replace("h_", "c_", 1): r for n, r in runs.items()})
    summary["cap_gib"] = ctx.gpu_memory_gib
    return harness.save(dest, summary)


FP8_RUN = {"num_train_epochs": 40}


# FP8 through the product: -e fp8=true (the planner renders bf16 off and sets
# ACCELERATE_MIXED_PRECISION=fp8 in the ranks' environment: planner/decisions.py choose_fp8).
# The third session of 2026-12-02 measured the same settings passed by hand (train_args fp8, bf16
# false and job_environment), before the planner rendered them.


def fp8_phase(ctx: Ctx, key: str) -> dict[str, Any]:
    """bf16 and FP8 through train.yml, both compiled, one after the other."""
    goal = GOALS[key]
    dest = ctx.results / f"fp8-{key}"
    runs = {}
    saved = ctx.extra_vars
    # cd-<goal>'s (d) of this call, when the planner compiled it, is the same bf16 run.
    done = ctx.results / f"cd-{key}" / "d_train_yml" / "result.json"
    if done.is_file():
        earlier = json.loads(done.read_text())
        if earlier.get("ok") and (earlier.get("rendered") or {}).get("torch_compile"):
            runs["bf16_compile"] = earlier
    for name, fp8_flag in (("bf16_compile", False), ("fp8_compile", True)):
        if name in runs:
            harness.say(f"fp8 {key}: {name} from cd-{key}'s (d)")
            continue
        # A run long enough that FP8 repays its longer compilation (the planner refuses FP8 on
        # a run it would end later: decisions.fp8_pays); the window stops it all the same.
        train_args = {**saved.get("train_args", {}), "torch_compile": True, **FP8_RUN}
        ctx.extra_vars = {**saved, "train_args": train_args, "fp8": fp8_flag}
        box, ctx.mode.product = ctx.mode.product, FP8_BOX if fp8_flag else COMPILE_BOX
        try:
            runs[name] = product(ctx, dest / name, goal)
        finally:
            ctx.mode.product, ctx.extra_vars = box, saved
    summary: dict[str, Any] = {"goal": key, "model": goal.model, "runs": {}}
    for name, r in runs.items():
        summary["runs"][name] = {
            k: r.get(k) for k in ("ok", "tokens_per_s", "step_s", "mfu", "peak_alloc_gib", "cause")
        }
    bf16, fp8 = runs["bf16_compile"], runs["fp8_compile"]
    if bf16.get("tokens_per_s") and fp8.get("tokens_per_s"):
        summary["fp8_over_bf16"] = round(fp8["tokens_per_s"] / bf16["tokens_per_s"], 3)
        summary["loss"] = harness.analyse.compare_losses(fp8["losses"], bf16["losses"], 6)
    return harness.save(dest, summary)


def run(args: argparse.Namespace) -> int:
    """The phases in order, within the deadline."""
    parsed = [parse_phase(p) for p in args.phases]
    ctx = Ctx(args)
    cap_gpu(ctx, args.gpu_cap_gib)
    # Every model the call trains is generated from the start, in the background.
    harness.start_models(ctx, set().union(*(phase_sizes(ctx, p) for p in args.phases)))
    estimates = {"setup": 90, "base": 420, "cd": 240, "target": 200, "fp8": 300, "cards": 420}
    for phase, (kind, key, cap) in zip(args.phases, parsed, strict=True):
        if kind != "setup" and ctx.left() < estimates[kind] / 2:
            harness.say(f"skip {phase}: {ctx.left():.0f} s left")
            continue
        start = time.monotonic()
        try:
            harness.ensure_models(ctx, phase_sizes(ctx, phase))
            if kind == "setup":
                harness.setup_phase(ctx, [])
            elif kind == "base":
                print(json.dumps(base_phase(ctx, key), indent=1), flush=True)
            elif kind == "cd":
                print(json.dumps(cd_phase(ctx, key), indent=1), flush=True)
            elif kind == "fp8":
                print(json.dumps(fp8_phase(ctx, key), indent=1), flush=True)
            elif kind == "cards":
                cap_gpu(ctx, cap)
                print(json.dumps(cards_phase(ctx, key), indent=1), flush=True)
                cap_gpu(ctx, args.gpu_cap_gib)
            else:
                if cap is not None:
                    cap_gpu(ctx, cap)
                print(json.dumps(target_phase(ctx, key), indent=1), flush=True)
                cap_gpu(ctx, args.gpu_cap_gib)
        except Exception as err:  # one phase's failure must not lose the others
            harness.say(f"{phase} failed: {err!r}")
            (ctx.results / f"{phase}.error.txt").write_text(repr(err) + "\n")
        harness.say(f"{phase}: {time.monotonic() - start:.0f} s")
        harness.pack(ctx)
    return 0


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run phases")
    r.add_argument("--mode", choices=sorted(harness.MODES), default="gpu")
    r.add_argument("--playbook", required=True, help="the ansible-playbook to run train.yml with")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--work", type=Path, default=Path("/tmp/profile-work"))
    r.add_argument("--base-dir", default="/opt/llama-cluster", help="cluster_base_dir of the nodes")
    r.add_argument("--env-bin", help="bin/ of the training environment (default: this Python's)")
    r.add_argument("--deadline-s", type=float, default=540)
    r.add_argument("--gpu-cap-gib", type=float, help="emulate a GPU of this many GiB")
    r.add_argument("--gpu-memory-gib", type=float, help="plan for this many GiB (no cap)")
    r.add_argument("--product-extra", help="JSON extra vars for every train.yml run")
    r.add_argument("--dry", action="store_true", help="plan and check each launch (dry.py)")
    r.add_argument("phases", nargs="+")
    args = parser.parse_args()
    args.nodes = 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
