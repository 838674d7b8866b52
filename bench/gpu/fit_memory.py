#!/usr/bin/env python3
"""Fit measured_memory.py's coefficients on half of the memory grid; report the other half.

    python3 bench/gpu/fit_memory.py [--data tests/data/memory_grid.json] [--table]

Needs numpy (the venv with torch has it); the model module itself is standard library only.

The split: the points that trained (status ok) in grid order, alternately to the fit and to the
held-out half (`held_out`, also what tests/unit/planner/test_memory_model.py checks). The GPU model
is the
larger of two linear terms (measured_memory.features); which one is a point's peak is not known
before the fit, so the fit alternates: least squares of the relative error with every point
assigned to a moment, then every point reassigned to the moment its fit predicts larger, until
nothing moves. A step coefficient that no fitted point's peak determines keeps its bytes per
parameter from PRIOR (the states' sizes: they are not a measurement and the printout says so).
The host model is a least-squares line per kind (load only, full offload, LoRA offload) over
the fit half's peak RSS. allocator_headroom and context_gib are the largest ratio of peak
reserved to peak allocated and of NVML's figure to peak reserved over the fit half.

Prints COEFFICIENTS to paste into measured_memory.py, the errors on both halves, and with
--table the rows of BENCHMARKS.md section 5.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "collections"))
from ansible_collections.llama.cluster.plugins.module_utils.planner import (  # noqa: E402
    measured_memory as mm,
)

# Bytes per parameter at the optimizer step where no fitted point's peak is that moment: fp32
# weights, gradients and AdamW states (16; ZeRO adds a bf16 copy of the weights and gradients).
PRIOR = {
    "step/full/none": 16.0,
    "step/full/zero2": 20.0,
    "step/full/zero3": 18.0,
    "step/lora/none": 2.0,
    "step/lora/zero3": 2.0,
}
# Known, not fitted: a checkpointed layer keeps its input hidden state, fp32 or bf16.
FIXED = {"checkpointed_layer_hidden_fp32": 4.0, "checkpointed_layer_hidden_bf16": 2.0}
PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16, datasheet


def load(path: Path) -> tuple[dict[str, mm.Shape], list[dict[str, Any]]]:
    """The grid's shapes and points."""
    data = json.loads(path.read_text())
    shapes = {k: mm.Shape.from_config(v, v["params"]) for k, v in data["shapes"].items()}
    return shapes, data["points"]


def held_out(
    points: list[dict[str, Any]], status: str = "ok"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(fit, held-out): the points of a status (ok, oom), alternately, in grid order."""
    chosen = [p for p in points if p["status"] == status]
    return chosen[0::2], chosen[1::2]


def terms(shapes: dict[str, mm.Shape], p: dict[str, Any]) -> tuple[dict, dict]:
    return mm.features(
        shapes[p["shape"]], p["finetuning"], p["stage"], p["checkpointing"], p["tokens"]
    )


def fit_gpu(shapes: dict[str, mm.Shape], fit: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares of the relative error, alternating the moment each point peaks at."""
    coef: dict[str, float] = {**PRIOR, "margin": 1.0}
    moment = ["backward"] * len(fit)
    for _ in range(50):
        rows = [terms(shapes, p)[0 if m == "step" else 1] for p, m in zip(fit, moment, strict=True)]
        names = sorted({n for r in rows for n in r} - set(FIXED))
        a = np.array([[r.get(n, 0.0) for n in names] for r in rows])
        known = np.array([mm.dot(r, FIXED) for r in rows])
        y = np.array([p["peak_allocated_gib"] * mm.GIB for p in fit]) - known
        solved, *_ = np.linalg.lstsq(a / y[:, None], np.ones(len(y)), rcond=None)
        coef = {
            **PRIOR,
            **FIXED,
            "margin": 1.0,
            **dict(zip(names, (float(x) for x in solved), strict=True)),
        }
        new = []
        for p in fit:
            step, backward = terms(shapes, p)
            new.append("step" if mm.dot(step, coef) > mm.dot(backward, coef) else "backward")
        if new == moment:
            break
        moment = new
    fitted_steps = {
        f"step/{p['finetuning']}/{p['stage']}"
        for p, m in zip(fit, moment, strict=True)
        if m == "step"
    }
    for name in PRIOR:
        print(f"# {name}: {'fitted' if name in fitted_steps else 'prior (no fitted peak)'}")
    return coef


def fit_host(shapes: dict[str, mm.Shape], fit: list[dict[str, Any]]) -> dict[str, float]:
    """base_gib and the bytes per parameter of each kind, one least-squares fit."""
    names = ["host.base_gib", "host.load", "host.offload_full", "host.offload_lora"]
    rows, y = [], []
    for p in fit:
        kind = "host.load"
        if p["stage"] == "zero3_offload":
            kind = f"host.offload_{p['finetuning']}"
        row = dict.fromkeys(names, 0.0)
        row["host.base_gib"] = float(mm.GIB)
        row[kind] = shapes[p["shape"]].params
        rows.append([row[n] for n in names])
        y.append(p["host_peak_rss_gib"] * mm.GIB)
    a, b = np.array(rows), np.array(y)
    solved, *_ = np.linalg.lstsq(a / b[:, None], np.ones(len(b)), rcond=None)
    return dict(zip(names, (float(x) for x in solved), strict=True))


def headroom(shapes: dict[str, mm.Shape], ooms: list[dict[str, Any]], coef: dict) -> float:
    """The smallest factor on the predicted peak (2 decimals, at least 1) under which every
    fitted out-of-memory point is predicted not to fit its cap: what the allocator reserved
    beyond what it allocated when those points failed."""
    need = 1.0
    for p in ooms:
        gpu = min(p["cap_gib"], p["gpu_total_gib"]) - coef["context_gib"]
        pred = mm.gpu_bytes(
            shapes[p["shape"]],
            p["finetuning"],
            p["stage"],
            p["checkpointing"],
            p["tokens"],
            coefficients=coef,
        )
        need = max(need, gpu * mm.GIB / pred)
    return math.floor(need * 100 + 1) / 100


def errors(
    shapes: dict[str, mm.Shape], points: list[dict[str, Any]], coef: dict[str, float]
) -> list[tuple[str, float, float, float]]:
    """(name, predicted GiB, measured GiB, relative error) of each point."""
    out = []
    for p in points:
        shape = shapes[p["shape"]]
        pred = mm.gpu_bytes(
            shape, p["finetuning"], p["stage"], p["checkpointing"], p["tokens"], coefficients=coef
        )
        meas = p["peak_allocated_gib"]
        out.append((p["name"], pred / mm.GIB, meas, pred / mm.GIB / meas - 1))
    return out


def mfu(shape: mm.Shape, p: dict[str, Any]) -> float | None:
    """Model FLOPs utilisation against 989 TFLOP/s: 6 N per token (LoRA: 4 N, frozen weights
    get no weight gradients), N without a separate input embedding (a lookup)."""
    if not p.get("tokens_per_s"):
        return None
    n = shape.params - (0 if shape.tied else shape.vocab * shape.hidden)
    per_token = (6 if p["finetuning"] == "full" else 4) * n
    return per_token * p["tokens_per_s"] / (PEAK_TFLOPS * 1e12)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "tests/data/memory_grid.json")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    shapes, points = load(args.data)
    fit, test = held_out(points)
    coef = fit_gpu(shapes, fit)
    coef.update(fit_host(shapes, fit))
    # The one safety factor: no fitted point under-predicted by more than 1 %.
    coef["margin"] = 1.0
    worst = min(e[3] for e in errors(shapes, fit, coef))
    coef["margin"] = max(1.0, (1 - 0.01) / (1 + worst))
    coef["context_gib"] = round(max(p["nvml_peak_gib"] - p["peak_reserved_gib"] for p in fit), 2)
    coef["allocator_headroom"] = headroom(shapes, held_out(points, "oom")[0], coef)
    print("COEFFICIENTS: dict[str, float] = {")
    for name in sorted(coef):
        print(f'    "{name}": {coef[name]:.6g},')
    print("}")
    for label, half in (("fit", fit), ("held-out", test)):
        errs = errors(shapes, half, coef)
        worst = max(abs(e[3]) for e in errs)
        under = min(e[3] for e in errs)
        mean = sum(abs(e[3]) for e in errs) / len(errs)
        print(
            f"{label}: {len(errs)} points, mean |error| {mean:.1%}, max |error| {worst:.1%}, "
            f"worst under {under:.1%}"
        )
        for name, pred, meas, err in errs:
            print(f"  {name:45s} {pred:7.2f} {meas:7.2f} {err:+.1%}")
    if args.table:
        table(shapes, points, coef, {p["name"] for p in test})
    return 0


def table(
    shapes: dict[str, mm.Shape], points: list[dict[str, Any]], coef: dict, test: set[str]
) -> None:
    """The rows of BENCHMARKS.md section 5."""
    print(
        "| point | half | status | old model GiB | new model GiB | measured GiB | reserved "
        "GiB | host GiB | tokens/s | MFU |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for p in points:
        shape = shapes[p["shape"]]
        new = (
            mm.gpu_bytes(
                shape,
                p["finetuning"],
                p["stage"],
                p["checkpointing"],
                p["tokens"],
                coefficients=coef,
            )
            / mm.GIB
        )
        half = "held-out" if p["name"] in test else ("fit" if p["status"] == "ok" else "-")
        ok = p["status"] == "ok"
        tps = f"{p['tokens_per_s']:,.0f}" if ok and p["tokens_per_s"] else "-"
        if ok and not p["alone"]:
            tps += " (shared)"
        util = mfu(shape, p) if ok and p["alone"] else None
        fit_word = (
            "fits"
            if mm.fits(new * mm.GIB, min(p["cap_gib"], p["gpu_total_gib"]), coef)
            else "does not fit"
        )
        print(
            f"| {p['name']} | {half} | {p['status']} | {p['old_predicted_gib']:.1f} | "
            f"{new:.1f} ({fit_word}) | {p['peak_allocated_gib']:.1f} | "
            f"{p['peak_reserved_gib']:.1f} | {p['host_peak_rss_gib']:.1f} | {tps} | "
            f"{f'{util:.1%}' if util is not None else '-'} |"
        )


if __name__ == "__main__":
    sys.exit(main())
