#!/usr/bin/env python3
"""Issue 46's first device call, here: memory_grid.py --grid compile's points into the data the
tests replay, and the figures BENCHMARKS.md section 12 shows.

    python3 bench/gpu/compile_grid.py collect RESULTS.jsonl --gpu "NVIDIA H100 80GB HBM3" \\
        [--command "..."]
    python3 bench/gpu/compile_grid.py report

`collect` writes tests/data/compile_grid.json (each timed point: its configuration, step time,
tokens/s, time to its first step, the GPU it ran on) and tests/data/checkpoint_sizes.json (issue
44: one checkpoint's files by kind, for a full fine-tune with 8-bit AdamW, a LoRA and a QLoRA).
`report` prints, for each technique timed compiled and uncompiled in the call, the share of a
step compiling saved (planner/techniques.py COMPILE_SAVING), the cost model's prediction of every
timed point against its measurement, each point's MFU and its first step against the plan's
first_step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "collections"))
import yaml  # noqa: E402
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    cost as cm,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    decisions,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    measured_memory as mm,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (  # noqa: E402
    model_params,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.techniques import (  # noqa: E402
    Technique,
)
from memory_grid import SHAPES  # noqa: E402 - this folder is not a package

DATA = ROOT / "tests" / "data" / "compile_grid.json"
SIZES = ROOT / "tests" / "data" / "checkpoint_sizes.json"
COMMAND = "GRID=compile OPTIM=0 DEADLINE=525 bash bench/gpu/cards.sh"
KEEP = [
    "name", "shape", "finetuning", "stage", "checkpointing", "micro_batch", "cutoff", "cap_gib",
    "optim", "quant", "liger", "compile", "fp8", "steps", "alone", "tokens", "status",
    "steps_done", "step_s", "tokens_per_s", "train_begin_s", "first_step_at_s",
    "peak_allocated_gib", "gpu_total_gib",
]  # fmt: skip


def collect(results: Path, gpu: str, command: str, data: Path = DATA, sizes: Path = SIZES) -> None:
    """The call's records into the two data files."""
    records: dict[str, dict[str, Any]] = {}
    for line in results.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            records[rec["name"]] = rec
    timed = [{k: r.get(k) for k in KEEP} for r in records.values() if not r.get("save")]
    shapes = {p["shape"] for p in timed}
    data.write_text(
        json.dumps(
            {
                "about": (
                    "Issue 46's first device call: LLaMA-Factory 0.9.5 through memory_grid.py's "
                    "run_exp under an emulated 24 GiB cap (80: FP8), each point alone on the GPU, "
                    "compiled (torch_compile) beside its uncompiled twin. step_s: the median step "
                    "after the first two; first_step_at_s: from the training process's start to "
                    "its first optimizer step (start-up, load, compiling); train_begin_s: to "
                    "training's start."
                ),
                "gpu": gpu,
                "command": command,
                "shapes": {k: {**SHAPES[k], "params": model_params(SHAPES[k])} for k in shapes},
                "points": timed,
            },
            indent=1,
        )
        + "\n"
    )
    saved = [r for r in records.values() if r.get("save")]
    sizes.write_text(
        json.dumps(
            {
                "about": (
                    "Issue 44: one checkpoint of LLaMA-Factory 0.9.5 (transformers 5.6) on disk, "
                    "by kind of file (bytes): weights (model / adapter_model), optimizer, "
                    "scheduler, rng, other (trainer state, configs, tokenizer). save_only_model "
                    "false, 2 steps, packed rows of 2048 tokens, fp32 trainable weights."
                ),
                "gpu": gpu,
                "command": command,
                "shapes": {
                    k: {**SHAPES[k], "params": model_params(SHAPES[k])}
                    for k in {r["shape"] for r in saved}
                },
                "checkpoints": [
                    {
                        "name": r["name"],
                        "shape": r["shape"],
                        "finetuning": r["finetuning"],
                        "optim": r.get("optim"),
                        "quant": r.get("quant"),
                        "lora_rank": 8 if r["finetuning"] == "lora" else None,
                        "status": r["status"],
                        **{k: v for k, v in (r.get("checkpoint") or {}).items()},
                    }
                    for r in saved
                ],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{len(timed)} timed points -> {data}; {len(saved)} checkpoints -> {sizes}")


def load(path: Path = DATA) -> dict[str, Any]:
    return json.loads(path.read_text())


def technique(p: dict[str, Any], compiled: bool | None = None) -> Technique:
    """The planner's technique of a point (compiled as measured, unless given)."""
    return Technique(
        optim=p.get("optim") or "adamw_torch",
        liger=bool(p.get("liger")),
        quant=int(p.get("quant") or 0),
        compiled=bool(p.get("compile")) if compiled is None else compiled,
    )


def predicted(data: dict[str, Any], p: dict[str, Any], compiled: bool | None = None) -> float:
    """The cost model's step time of a point (one GPU, accumulation 1)."""
    spec = data["shapes"][p["shape"]]
    shape = mm.Shape.from_config(spec, spec["params"])
    setup = cm.Setup(
        finetuning=p["finetuning"],
        stage=p["stage"],
        checkpointing=p["checkpointing"],
        micro_tokens=p["tokens"],
        technique=technique(p, compiled),
    )
    return cm.step_cost(shape, setup, world=1, link=None).total


def twins(data: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(uncompiled, compiled) pairs of one configuration, both timed in the call."""
    ok = [p for p in data["points"] if p["status"] == "ok" and p["step_s"] and not p.get("fp8")]

    def key(p: dict[str, Any]) -> tuple:
        fields = ("shape", "finetuning", "checkpointing", "micro_batch")
        return (*(p[k] for k in fields), technique(p, False))

    plain = {key(p): p for p in ok if not p.get("compile")}
    return [(plain[key(p)], p) for p in ok if p.get("compile") and key(p) in plain]


def mfu(data: dict[str, Any], p: dict[str, Any]) -> float:
    """The harness's MFU: 6N (full) or 4N (LoRA) FLOPs a token against 989 TFLOP/s."""
    spec = data["shapes"][p["shape"]]
    shape = mm.Shape.from_config(spec, spec["params"])
    per = 6.0 if p["finetuning"] == "full" else 4.0
    return per * cm.flop_params(shape) * p["tokens_per_s"] / cm.PEAK_FLOPS


def report(data: dict[str, Any]) -> None:
    """The tables of BENCHMARKS.md section 12."""
    print(f"GPU: {data['gpu']}\n\n| configuration | uncompiled s | compiled s | saving |")
    print("|---|---:|---:|---:|")
    for plain, fast in twins(data):
        saving = 1 - fast["step_s"] / plain["step_s"]
        print(f"| {plain['name']} | {plain['step_s']:.3f} | {fast['step_s']:.3f} | {saving:.1%} |")
    training = yaml.safe_load((ROOT / "group_vars/all/training.yml").read_text())
    print("\n| point | measured s | predicted s | error | tokens/s | MFU | first step s | plan's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in data["points"]:
        if p["status"] != "ok" or not p["step_s"]:
            print(f"| {p['name']} | {p['status']} | | | | | {p.get('first_step_at_s')} | |")
            continue
        guess = predicted(data, p)
        first, _ = decisions.first_step(
            data["shapes"][p["shape"]]["params"] / 1e9,
            compiled=bool(p.get("compile")),
            fp8=bool(p.get("fp8")),
            finetuning=p["finetuning"],
            settings=training["training_compile"],
        )
        print(
            f"| {p['name']} | {p['step_s']:.3f} | {guess:.3f} | {guess / p['step_s'] - 1:+.0%} "
            f"| {p['tokens_per_s']:,.0f} | {mfu(data, p):.1%} | {p.get('first_step_at_s')} "
            f"| {first:.0f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    col = sub.add_parser("collect")
    col.add_argument("results", type=Path)
    col.add_argument("--gpu", required=True, help="the GPU's name, as nvidia-smi gives it")
    col.add_argument("--command", default=COMMAND, help="the device call's command")
    col.add_argument("--data", type=Path, default=DATA)
    col.add_argument("--sizes", type=Path, default=SIZES)
    rep = sub.add_parser("report")
    rep.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    if args.cmd == "collect":
        collect(args.results, args.gpu, args.command, args.data, args.sizes)
    else:
        report(load(args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
