#!/usr/bin/env python3
"""Issue 38's measurements, here: the cards grid's points into tests/data/cards_grid.json, the
numerics comparison, and the fit of the memory and cost models' new terms.

    python3 bench/gpu/cards.py collect RESULTS.jsonl... --optim OPTIM.json... [--to FILE]
    python3 bench/gpu/cards.py numerics [--data tests/data/cards_grid.json]
    python3 bench/gpu/cards.py fit [--data tests/data/cards_grid.json]
    python3 bench/gpu/cards.py fit-cost [--data ...] [--grid tests/data/memory_grid.json]

`collect` keeps each point's configuration and measurements (the last record of a name wins), the
per-step losses of the numerics runs, and the optimizer step timings (optim_bench.py).
`numerics` compares every 300-step run with fp32 AdamW's of the same seed: the mean and largest
difference of the loss at each step, and of the mean loss over the last 50 steps, beside the
same fp32 run repeated (the run-to-run noise) and fp32 with another seed (the data order's).
`fit` fits each technique's memory coefficient on its points of the first device call with the
issue-21 coefficients held, so that no fitted point is under-predicted, and prints the
coefficients and each point's error, fitted or held out (the later calls' points);
tests/unit/planner/test_memory_model.py checks the held-out ones. `fit-cost` solves the cost
model's new
terms on the points that ran alone (the first of each technique;
tests/unit/planner/test_cost_model.py checks
the others).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "collections"))
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    cost as cm,
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

DATA = ROOT / "tests" / "data" / "cards_grid.json"
KEEP = [
    "name", "shape", "finetuning", "stage", "checkpointing", "micro_batch", "cutoff", "cap_gib",
    "optim", "quant", "liger", "steps", "seed", "alone", "tokens", "status", "steps_done",
    "step_s", "tokens_per_s", "peak_allocated_gib", "peak_reserved_gib", "nvml_peak_gib",
    "load_peak_allocated_gib", "host_peak_rss_gib", "gpu_total_gib",
]  # fmt: skip
NUMERICS_STEPS = 300
WINDOW = 50  # the last steps whose mean loss is compared


def collect(results: list[Path], optim: list[Path], to: Path) -> None:
    """Merge the device calls' records into the data file the tests replay; `call` numbers the
    results files in the order given (the fit uses the first call's points, the tests check the
    model on the later calls')."""
    records: dict[str, dict[str, Any]] = {}
    for call, path in enumerate(results, start=1):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                records[rec["name"]] = {**rec, "call": call}
    points = []
    for rec in records.values():
        kept = {k: rec.get(k) for k in ["call", *KEEP]}
        if rec.get("steps", 0) >= NUMERICS_STEPS and rec.get("losses"):
            kept["losses"] = [round(loss, 5) for _, loss in sorted(rec["losses"])]
        points.append(kept)
    timings = [r for path in optim for r in json.loads(path.read_text())["results"]]
    payload = {
        "about": (
            "Issue 38's cards grid: LLaMA-Factory 0.9.5 on one H200 under emulated 24-80 GiB caps "
            "(bench/gpu/memory_grid.py --grid cards, BENCHMARKS.md section 10), with 8-bit AdamW "
            "(optim), QLoRA (quant), Liger kernels (liger) and ZeRO-2 with the optimizer offloaded "
            "(zero2_offload). Fields as in memory_grid.json; step_s is clean only where alone is "
            "true; call: the device call (the models' new terms are fitted on call 1). losses: the "
            "loss of every step of the 300-step numerics runs. optimizer: the optimizer step alone "
            "over the 1.5B shape's weights (bench/gpu/optim_bench.py)."
        ),
        "shapes": {
            k: {**v, "params": model_params(v)}
            for k, v in SHAPES.items()
            if k in {p["shape"] for p in points}
        },
        "points": points,
        "optimizer": timings,
    }
    to.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"{len(points)} points, {len(timings)} optimizer timings -> {to}")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def shapes_of(data: dict[str, Any]) -> dict[str, mm.Shape]:
    return {k: mm.Shape.from_config(v, v["params"]) for k, v in data["shapes"].items()}


def technique(p: dict[str, Any]) -> Technique:
    return Technique(optim=p.get("optim") or "adamw_torch", liger=bool(p.get("liger")),
                     quant=int(p.get("quant") or 0))  # fmt: skip


def compare(losses: list[float], base: list[float]) -> dict[str, float]:
    """Per-step and last-window differences of one loss curve from another."""
    diffs = [a - b for a, b in zip(losses, base, strict=True)]
    window = statistics.mean(losses[-WINDOW:]) - statistics.mean(base[-WINDOW:])
    return {
        "steps": len(diffs),
        "mean_diff": round(statistics.mean(diffs), 4),
        "mean_abs_diff": round(statistics.mean(abs(d) for d in diffs), 4),
        "max_abs_diff": round(max(abs(d) for d in diffs), 4),
        f"last{WINDOW}_mean_diff": round(window, 4),
    }


def numerics(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every numerics run against fp32 AdamW of seed 42 (the first such run)."""
    runs = [p for p in data["points"] if p.get("losses")]
    base = next(p for p in runs if p["optim"] == "adamw_torch" and p["seed"] == 42)
    table = {}
    for p in runs:
        if p is base:
            continue
        if p["optim"] == "adamw_torch":
            what = "fp32 AdamW repeated" if p["seed"] == base["seed"] else f"seed {p['seed']}"
        else:
            what = p["optim"]
        table[p["name"]] = {"against_fp32": what, **compare(p["losses"], base["losses"])}
    return table


def predict(shapes: dict[str, mm.Shape], p: dict[str, Any], coef: dict[str, float]) -> float:
    """GiB the memory model predicts for a point."""
    return mm.gpu_bytes(
        shapes[p["shape"]], p["finetuning"], p["stage"], p["checkpointing"], p["tokens"],
        technique=technique(p), coefficients=coef,
    ) / mm.GIB  # fmt: skip


# Each new memory coefficient and the points that determine it (the others held).
NEW_TERMS = {
    "adamw_8bit/backward": lambda p: p["optim"] == "adamw_8bit" and not p["liger"],
    "adamw_8bit/step": lambda p: p["optim"] == "adamw_8bit" and not p["liger"],
    "vocab_liger": lambda p: p["liger"],
    "qlora_linear": lambda p: bool(p["quant"]),
    "backward/full/zero2_offload": lambda p: p["stage"] == "zero2_offload",
}


# The optimizers the memory model knows (torchao's 8-bit AdamW was measured, and is not one).
MODELLED_OPTIM = ("adamw_torch", "adamw_8bit")


def trained(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The points that trained with a modelled optimizer, one per configuration (a rerun of a
    configuration, alone or with another seed, is left out)."""
    seen, out = set(), []
    for p in data["points"]:
        if p["status"] != "ok" or p["optim"] not in MODELLED_OPTIM:
            continue
        key = (p["shape"], p["finetuning"], p["stage"], p["checkpointing"], p["tokens"],
               p["optim"], p["quant"], p["liger"])  # fmt: skip
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def halves(points: list[dict[str, Any]], term: str) -> tuple[list, list]:
    """(fit, held-out) of a term: its points of the first device call, and of the later ones."""
    mine = [p for p in points if NEW_TERMS[term](p)]
    return [p for p in mine if p["call"] == 1], [p for p in mine if p["call"] > 1]


def solve(shapes: dict[str, mm.Shape], p: dict[str, Any], coef: dict, term: str) -> float | None:
    """The value of `term` at which the point is predicted exactly; None where the term does not
    decide its peak (the prediction is the larger of two moments, each linear in a term)."""

    def gap(value: float) -> float:
        return predict(shapes, p, {**coef, term: value}) - p["peak_allocated_gib"]

    lo, hi = 0.0, 64.0
    if gap(lo) * gap(hi) > 0:
        return None
    rising = gap(hi) > gap(lo)
    for _ in range(60):
        mid = (lo + hi) / 2
        if (gap(mid) > 0) == rising:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def fit(data: dict[str, Any]) -> dict[str, float]:
    """Each new coefficient from the first call's points of its term, with every other
    coefficient held: the value at which none of them is under-predicted (twice over, so that
    coefficients that share points settle)."""
    shapes = shapes_of(data)
    coef = dict(mm.COEFFICIENTS)
    points = trained(data)
    for _ in range(2):
        for term in NEW_TERMS:
            fitted, _ = halves(points, term)
            needed = [v for p in fitted if (v := solve(shapes, p, coef, term)) is not None]
            if needed:
                saving = term.startswith("adamw_8bit")  # a larger saving predicts less
                coef[term] = round(min(needed) if saving else max(needed), 4)
        coef["step/full/zero2_offload"] = coef["backward/full/zero2_offload"]
    return coef


def report(data: dict[str, Any], coef: dict[str, float]) -> None:
    shapes = shapes_of(data)
    points = trained(data)
    print("fitted:", json.dumps({k: coef[k] for k in [*NEW_TERMS, "step/full/zero2_offload"]}))
    for term in NEW_TERMS:
        fitted, held = halves(points, term)
        for half, ps in (("fit", fitted), ("held-out", held)):
            for p in ps:
                pred = predict(shapes, p, coef)
                err = pred / p["peak_allocated_gib"] - 1
                print(f"  {term:28s} {half:8s} {p['name']:62s} {p['peak_allocated_gib']:7.2f} "
                      f"GiB, predicted {pred:6.2f} ({err:+.1%})")  # fmt: skip
    for p in data["points"]:
        if p["status"] == "oom":
            need = predict(shapes, p, coef) * mm.GIB
            print(f"  oom {p['name']}: predicted to fit {min(p['cap_gib'], 139.8)} GiB: "
                  f"{mm.fits(need, min(p['cap_gib'], 139.8), coef)}")  # fmt: skip


# --------------------------------------------------------------------------------------------
# The cost model's new terms, from the points that ran alone on the GPU.
# --------------------------------------------------------------------------------------------


# Measured alone, not fitted (bench/gpu/optim_bench.py on the 1.5B shape's weights): DeepSpeed's
# CPU Adam is ZeRO-Offload's host step. The 8-bit step alone (fp32 AdamW's `optimizer` plus what
# bitsandbytes' step took longer there) is the first guess of optimizer_8bit, which the 8-bit
# points then fit: in a training step it costs more than alone.
def measured_terms(data: dict[str, Any]) -> dict[str, float]:
    timing = {r["optimizer"]: r for r in data["optimizer"] if "s_per_param" in r}
    extra = timing["adamw_8bit"]["s_per_param"] - timing["adamw_torch"]["s_per_param"]
    return {
        "optimizer_8bit": cm.COEFFICIENTS["optimizer"] + extra,
        "offload2_step": timing["deepspeed_cpu_adam"]["s_per_param"],
    }


# Each fitted term: the points it is fitted on, and the points held out to check it. flop/lora is
# refitted on the issue-21 grid's LoRA points that ran alone (the earlier fit's shared points made
# it 15-20 % slow on them).
COST_TERMS = {
    "flop/lora": "lora-plain",
    "optimizer_8bit": "8bit",
    "qlora": "qlora",
    "liger/full": "liger-full",
    "liger/lora": "liger-lora",
    "offload2_micro": "zero2_offload",
}


def cost_group(p: dict[str, Any]) -> str:
    """Which new term a timed point is evidence of."""
    if p.get("quant"):
        return "qlora"
    if p.get("liger"):
        return f"liger-{p['finetuning']}"
    if p["stage"] == "zero2_offload":
        return "zero2_offload"
    if p.get("optim") == "adamw_8bit":
        return "8bit"
    return f"{p['finetuning']}-plain" if p["stage"] == "none" else "other"


def timed(data: dict[str, Any], old: dict[str, Any]) -> list[dict[str, Any]]:
    """The points that ran alone with a step time: the issue-21 grid's LoRA ones without
    DeepSpeed and the cards grid's, in order (a group's first point fits, the rest are held
    out)."""
    points = [
        {**p, "optim": "adamw_torch", "quant": 0, "liger": False, "source": "memory_grid"}
        for p in old["points"]
        if p.get("alone") and p["status"] == "ok" and p.get("step_s")
        and p["finetuning"] == "lora" and p["stage"] == "none"
    ]  # fmt: skip
    points += [
        {**p, "source": "cards_grid"}
        for p in data["points"]
        if p.get("alone") and p["status"] == "ok" and p.get("step_s")
        and p["optim"] in MODELLED_OPTIM
    ]  # fmt: skip
    return points


def step_terms(shapes: dict[str, mm.Shape], p: dict[str, Any]) -> dict[str, float]:
    setup = cm.Setup(
        p["finetuning"], p["stage"], p["checkpointing"], p["tokens"], technique=technique(p)
    )
    return cm.features(shapes[p["shape"]], setup)


def fit_cost(data: dict[str, Any], old: dict[str, Any]) -> dict[str, float]:
    """Each new or refitted term solved on its group's first point (in COST_TERMS' order, the
    others held); qlora kept >= 0 (dequantizing costs time), liger free (its kernels can be
    faster than what they replace)."""
    shapes = {**shapes_of(old), **shapes_of(data)}
    coef = {**cm.COEFFICIENTS, **measured_terms(data)}
    points = timed(data, old)
    for term, group in COST_TERMS.items():
        mine = [p for p in points if cost_group(p) == group]
        if not mine:
            continue
        if term == "flop/lora":  # several clean points: least squares of the relative error
            rows = [step_terms(shapes, p) for p in mine]
            rest = [cm.dot({k: v for k, v in r.items() if k != term}, coef) for r in rows]
            xs = [r[term] / p["step_s"] for r, p in zip(rows, mine, strict=True)]
            ys = [1 - b / p["step_s"] for b, p in zip(rest, mine, strict=True)]
            coef[term] = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
            continue
        p = mine[0]
        terms = step_terms(shapes, p)
        rest = cm.dot({k: v for k, v in terms.items() if k != term}, coef)
        value = (p["step_s"] - rest) / terms[term]
        coef[term] = max(0.0, value) if term == "qlora" else value
    return {k: float(f"{v:.6g}") for k, v in coef.items()}


def cost_report(data: dict[str, Any], old: dict[str, Any], coef: dict[str, float]) -> None:
    shapes = {**shapes_of(old), **shapes_of(data)}
    names = dict.fromkeys([*COST_TERMS, *measured_terms(data)])
    print("cost terms:", json.dumps({k: coef[k] for k in names}))
    print("the 8-bit step alone:", f"{measured_terms(data)['optimizer_8bit']:.6g}")
    points = timed(data, old)
    seen: set[str] = set()
    for p in points:
        group = cost_group(p)
        fitted = group in COST_TERMS.values() and group not in seen and group != "lora-plain"
        seen.add(group)
        half = "fit" if fitted or group == "lora-plain" else "held-out"
        pred = cm.dot(step_terms(shapes, p), coef)
        err = pred / p["step_s"] - 1
        print(f"  {group:14s} {half:8s} {p['name']:58s} {p['step_s']:6.3f} s, predicted "
              f"{pred:6.3f} ({err:+.1%})")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    col = sub.add_parser("collect")
    col.add_argument("results", type=Path, nargs="+")
    col.add_argument("--optim", type=Path, nargs="*", default=[])
    col.add_argument("--to", type=Path, default=DATA)
    for name in ("numerics", "fit", "fit-cost"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--data", type=Path, default=DATA)
        cmd.add_argument("--grid", type=Path, default=ROOT / "tests" / "data" / "memory_grid.json")
    args = parser.parse_args()
    if args.cmd == "collect":
        collect(args.results, args.optim, args.to)
    elif args.cmd == "numerics":
        print(json.dumps(numerics(load(args.data)), indent=1))
    elif args.cmd == "fit":
        data = load(args.data)
        report(data, fit(data))
    else:
        data, old = load(args.data), load(args.grid)
        cost_report(data, old, fit_cost(data, old))
    return 0


if __name__ == "__main__":
    sys.exit(main())
