#!/usr/bin/env python3
"""Fit cost.py's compute coefficients on half of the grid's step times; report the other half.

    python3 bench/gpu/fit_cost.py [--data tests/data/memory_grid.json] [--table]

Needs numpy (the venv with torch has it); the model module itself is standard library only.

The split is fit_memory.py's: the points that trained, in grid order, alternately to the fit and
to the held-out half (tests/unit/planner/test_cost_model.py checks the held-out half). The model is
linear in
its terms (cost.features): a least-squares fit of the relative error of step_s, with every
coefficient kept >= 0 (a term that would come out negative is dropped and the rest refitted).

Most grid points ran beside others on the one GPU ("alone": false; memory_grid.py packed them
while their memory caps summed within the card), so their step times include an unknown share
of contention: the errors are reported for the points that ran alone and for the shared ones
separately, and tests/data/step_times.json (section 3's train.yml runs, each alone) is a second,
clean check that the fit never sees.

Prints COEFFICIENTS to paste into cost.py and the errors; with --table the rows of BENCHMARKS.md
section 6.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "collections"))
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    cost,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    measured_memory as mm,
)

# Measured, not fitted: the fused AdamW pass of the 1.5B full fine-tune took 26 ms of its step
# (torch.profiler, BENCHMARKS.md section 3.1), 1.7e-11 s per fp32 parameter. The grid cannot
# separate it from the FLOPs (its tokens per step vary little against N).
FIXED = {"optimizer": 0.026 / 1.5437e9}


def load(path: Path) -> tuple[dict[str, mm.Shape], list[dict[str, Any]]]:
    """The grid's shapes and points."""
    data = json.loads(path.read_text())
    shapes = {k: mm.Shape.from_config(v, v["params"]) for k, v in data["shapes"].items()}
    return shapes, data["points"]


def halves(points: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(fit, held-out): the trained points with a step time, alternately, in grid order (the
    memory model's split, so that a point is held out of both fits)."""
    trained = [p for p in points if p["status"] == "ok"]
    fit, test = trained[0::2], trained[1::2]
    return [p for p in fit if p.get("step_s")], [p for p in test if p.get("step_s")]


def terms(shapes: dict[str, mm.Shape], p: dict[str, Any]) -> dict[str, float]:
    setup = cost.Setup(
        p["finetuning"], p["stage"], p["checkpointing"], p["micro_batch"] * p["cutoff"]
    )
    return cost.features(shapes[p["shape"]], setup)


def fit(shapes: dict[str, mm.Shape], points: list[dict[str, Any]]) -> dict[str, float]:
    """Non-negative least squares of the relative error of step_s, FIXED kept as measured."""
    rows = [terms(shapes, p) for p in points]
    names = sorted({n for r in rows for n in r} - set(FIXED))
    known = np.array([cost.dot(r, FIXED) for r in rows])
    y = np.array([p["step_s"] for p in points]) - known
    a = np.array([[r.get(n, 0.0) for n in names] for r in rows]) / y[:, None]
    scale = a.max(axis=0)
    active = list(range(len(names)))
    while True:
        solved, *_ = np.linalg.lstsq(a[:, active] / scale[active], np.ones(len(y)), rcond=None)
        solved = solved / scale[active]
        if (solved >= 0).all():
            break
        active = [i for i, x in zip(active, solved, strict=True) if x >= 0]
    coef = {**FIXED, **dict.fromkeys(names, 0.0)}
    coef.update({names[i]: float(x) for i, x in zip(active, solved, strict=True)})
    return coef


def errors(
    shapes: dict[str, mm.Shape], points: list[dict[str, Any]], coef: dict[str, float]
) -> list[tuple[dict[str, Any], float, float]]:
    """(point, predicted s, relative error) of each point."""
    out = []
    for p in points:
        pred = cost.dot(terms(shapes, p), coef)
        out.append((p, pred, pred / p["step_s"] - 1))
    return out


def report(label: str, errs: list[tuple[dict[str, Any], float, float]]) -> None:
    if not errs:
        return
    mean = sum(abs(e) for _, _, e in errs) / len(errs)
    worst = max(abs(e) for _, _, e in errs)
    print(f"{label}: {len(errs)} points, mean |error| {mean:.1%}, max |error| {worst:.1%}")
    for p, pred, err in errs:
        print(f"  {p['name']:45s} {pred:7.3f} {p['step_s']:7.3f} {err:+.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "tests/data/memory_grid.json")
    parser.add_argument("--clean", type=Path, default=ROOT / "tests/data/step_times.json")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    shapes, points = load(args.data)
    fit_half, test_half = halves(points)
    coef = fit(shapes, fit_half)
    print("COEFFICIENTS: dict[str, float] = {")
    for name in sorted(coef):
        print(f'    "{name}": {coef[name]:.6g},')
    print("}")
    for kind in ("full", "lora"):
        print(
            f"# flop/{kind}: MFU {1 / (coef[f'flop/{kind}'] * cost.PEAK_FLOPS):.1%} of 989 TFLOP/s"
        )
    clean = json.loads(args.clean.read_text())["points"]
    for label, half in (("fit", fit_half), ("held-out", test_half)):
        report(f"{label}, alone", errors(shapes, [p for p in half if p["alone"]], coef))
        report(f"{label}, shared", errors(shapes, [p for p in half if not p["alone"]], coef))
    report("step_times.json (clean, never fitted)", errors(shapes, clean, coef))
    if args.table:
        table(shapes, points, clean, coef, {p["name"] for p in test_half})
    return 0


def table(
    shapes: dict[str, mm.Shape],
    points: list[dict[str, Any]],
    clean: list[dict[str, Any]],
    coef: dict[str, float],
    test: set[str],
) -> None:
    """The rows of BENCHMARKS.md section 6."""
    print("| point | half | ran | measured s | predicted s | error |")
    print("|---|---|---|---:|---:|---:|")
    rows = [p for p in points if p["status"] == "ok" and p.get("step_s")]
    for p, pred, err in errors(shapes, rows, coef):
        half = "held-out" if p["name"] in test else "fit"
        ran = "alone" if p["alone"] else "shared"
        print(f"| {p['name']} | {half} | {ran} | {p['step_s']:.3f} | {pred:.3f} | {err:+.1%} |")
    for p, pred, err in errors(shapes, clean, coef):
        print(
            f"| {p['name']} | clean check | alone | {p['step_s']:.3f} | {pred:.3f} | {err:+.1%} |"
        )


if __name__ == "__main__":
    sys.exit(main())
