"""summary.md, results.json and loss.png from what bench/gpu/harness.py left in results/.

python3 bench/gpu/harness.py report --out DIR   (rewrites them from DIR/results, e.g. here)
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import analyse

GOAL_ORDER = ["1.5b", "0.5b", "7b"]
STAGE_ORDER = ["none", "zero0", "zero2", "zero3", "zero3_offload", "fsdp"]
GOAL_HEADER = [
    "goal",
    "run",
    "settings",
    "tokens/s",
    "ratio",
    "target",
    "MFU (989)",
    "MFU (measured matmul)",
    "MFU with attention",
    "step s",
    "real tokens/step",
    "peak GiB (torch / nvidia-smi)",
    "first steps extra s",
    "start-up s",
    "met?",
]
SHARD_HEADER = [
    "-e deepspeed=",
    "rendered stage",
    "trained",
    "steps",
    "tokens/s",
    "vs DDP",
    "peak GiB (torch / nvidia-smi)",
    "final loss",
    "playbook s",
    "outside training s",
]


def _load(path: Path) -> dict[str, Any]:
    """A JSON file ({} if missing)."""
    return json.loads(path.read_text()) if path.exists() else {}


def _pct(value: float | None) -> str:
    """A fraction as a percentage ('' for none)."""
    return "" if value is None else f"{100 * value:.1f} %"


def _num(value: float | None, fmt: str = ",.0f") -> str:
    """A number ('' for none)."""
    return "" if value is None else format(value, fmt)


def _row(cells: list[Any]) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table."""
    return [_row(header), "|" + "---|" * len(header), *(_row(r) for r in rows)]


def _mem(run: dict[str, Any]) -> str:
    """Peak memory: torch's allocated (LLaMA-Factory's RECORD_VRAM) / nvidia-smi's largest."""
    smi = run.get("smi_peak_gib") or {}
    smi_max = max(smi.values()) if smi else None
    return f"{_num(run.get('peak_alloc_gib'), '.1f')} / {_num(smi_max, '.1f')}"


def _settings(run: dict[str, Any]) -> str:
    """The profile settings of a run, compactly."""
    r = run.get("rendered") or {}
    mb, acc = r.get("per_device_train_batch_size", "?"), r.get("gradient_accumulation_steps", "?")
    bits = [
        f"mb {mb} x acc {acc}",
        f"cutoff {r.get('cutoff_len', '?')}",
        "packed" if r.get("packing") else "unpacked",
        "no GC" if r.get("disable_gradient_checkpointing") else "GC",
    ]
    if r.get("torch_compile"):
        bits.append("compile")
    if r.get("enable_liger_kernel"):
        bits.append("Liger")
    if r.get("stage") not in (None, "none"):
        bits.append(str(r["stage"]))
    return ", ".join(bits)


def _goal_row(key: str, label: str, run: dict[str, Any], summary: dict[str, Any]) -> list[Any]:
    """One run of a goal as a table row."""
    if label == "train.yml":
        settings = _settings(run)
        ratio = f"{summary['ratio']}x" if "ratio" in summary else ""
        target = f"{summary.get('target_ratio', '?')}x"
        if summary.get("target_mfu"):
            target += f", MFU {_pct(summary['target_mfu'])}"
        met = [
            f"{k} {'yes' if summary[f'{k}_met'] else 'NO'}"
            for k in ("ratio", "mfu")
            if f"{k}_met" in summary
        ]
    else:
        settings = f"mb 1 x acc {run.get('accumulation', '?')}, cutoff 2048, unpacked, GC"
        ratio = target = ""
        met = []
    if not run.get("ok"):
        return [key, label, settings, "failed", *[""] * 11]
    return [
        key,
        label,
        settings,
        _num(run.get("tokens_per_s")),
        ratio,
        target,
        _pct(run.get("mfu")),
        _pct(run.get("mfu_vs_measured")),
        _pct(run.get("mfu_with_attention")),
        _num(run.get("step_s"), ".3f"),
        _num(run.get("tokens_per_step")),
        _mem(run),
        _num(run.get("first_steps_extra_s"), ".1f"),
        _num(run.get("startup_s"), ".1f"),
        ", ".join(met),
    ]


def _goal_detail(key: str, summary: dict[str, Any], prod: dict[str, Any]) -> str:
    """Tokens per step, loss comparison and FLOPs of one goal, as a sentence."""
    loss = summary.get("loss") or {}
    flops = prod.get("flops") or {}
    return (
        f"- **{key}** ({summary.get('model')}, {summary.get('finetuning')}): real tokens per "
        f"optimizer step train.yml / example = {summary.get('tokens_per_step_ratio', '?')} "
        f"(example accumulation {summary.get('example_accumulation')}, mean sample "
        f"{summary.get('mean_sample_tokens')} tokens; packed-row filler taken out: "
        f"{prod.get('filler_fraction', 'none')}); loss over steps {loss.get('range')}: mean "
        f"difference {loss.get('mean_diff')}, mean |difference| {loss.get('mean_abs_diff')}, max "
        f"{loss.get('max_abs_diff')}, step noise {loss.get('noise')}, within noise: "
        f"{loss.get('within_noise')}; FLOPs per token {flops.get('formula')} = "
        f"{_num(flops.get('flops'), '.3e')} + attention "
        f"{_num(flops.get('attention_per_token'), '.3e')}."
    )


def goals_section(results: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The goals table and details; also the plot panels."""
    rows, details, panels = [], [], []
    for key in GOAL_ORDER:
        base = results / f"goal-{key}"
        if not base.exists():
            continue
        summary = _load(base / "result.json")
        prod = _load(base / "train_yml" / "result.json")
        ex = _load(base / "example" / "result.json")
        rows += [
            _goal_row(key, label, run, summary)
            for label, run in (("train.yml", prod), ("example by hand", ex))
            if run
        ]
        details.append(_goal_detail(key, summary, prod))
        curves = {"train.yml": prod.get("losses", []), "example by hand": ex.get("losses", [])}
        panels.append({"title": f"{key} {summary.get('finetuning')}", "curves": curves})
    if not rows:
        return [], panels
    title = "## Goals: train.yml against LLaMA-Factory's example config, one GPU"
    return [title, "", *_table(GOAL_HEADER, rows), "", *details, ""], panels


def rendered_section(results: Path) -> list[str]:
    """What train.yml rendered for each run (train.yaml keys and plan.json's stage)."""
    paths = sorted(results.glob("*/train_yml/result.json")) + sorted(
        results.glob("shard-*/result.json")
    )
    rows = []
    for path in paths:
        run = _load(path)
        if run.get("rendered"):
            name = path.parent.parent.name if path.parent.name == "train_yml" else path.parent.name
            rows.append([name, f"`{json.dumps(run['rendered'], sort_keys=True)}`"])
    if not rows:
        return []
    return [
        "## What train.yml rendered",
        "",
        *_table(["run", "settings (train.yaml, plan.json)"], rows),
        "",
    ]


def shard_section(results: Path) -> tuple[list[str], dict[str, Any] | None]:
    """The sharding modes beside the plain DDP run of the same model."""
    runs = {s: _load(results / f"shard-{s}" / "result.json") for s in STAGE_ORDER}
    runs = {s: r for s, r in runs.items() if r}
    if not runs:
        return [], None
    ddp = runs.get("none", {}).get("tokens_per_s")
    rows = []
    for stage, run in runs.items():
        losses = run.get("losses") or []
        rows.append(
            [
                stage,
                (run.get("rendered") or {}).get("stage", ""),
                "yes" if run.get("ok") else "NO",
                run.get("last_step", ""),
                _num(run.get("tokens_per_s")),
                f"{run['tokens_per_s'] / ddp:.2f}" if ddp and run.get("tokens_per_s") else "",
                _mem(run),
                f"{losses[-1][1]:.4f}" if losses else "",
                _num(run.get("ansible_s"), ".1f"),
                _num(run.get("outside_training_s"), ".1f"),
            ]
        )
    lines = ["## Sharding modes through train.yml (0.5B full fine-tune, one GPU)", ""]
    lines += _table(SHARD_HEADER, rows)
    for stage, run in runs.items():
        if not run.get("ok"):
            lines += ["", f"`{stage}` failed: {run.get('cause', '')}", "", "```"]
            lines += [str(run.get("error", ""))[-3000:], "```"]
    curves = {s: r.get("losses", []) for s, r in runs.items()}
    return [*lines, ""], {"title": "sharding (0.5B)", "curves": curves}


def scale_section(results: Path) -> list[str]:
    """Scaling of the 1.5B product over logical nodes (2 GPUs or more)."""
    many = _load(results / "scale-1.5b" / "result.json")
    one = _load(results / "goal-1.5b" / "train_yml" / "result.json")
    if not many:
        return []
    nodes = many.get("nodes", 2)
    scaling = "?"
    if many.get("tokens_per_s") and one.get("tokens_per_s"):
        scaling = f"{many['tokens_per_s'] / (nodes * one['tokens_per_s']):.2f}"
    return [
        f"## Scaling: the 1.5B product on {nodes} logical nodes",
        "",
        f"tokens/s {_num(many.get('tokens_per_s'))} on {nodes} GPUs, "
        f"{_num(one.get('tokens_per_s'))} on one: scaling {scaling}; "
        f"MFU {_pct(many.get('mfu'))}; settings {_settings(many)}.",
        "",
    ]


def trace_section(results: Path) -> list[str]:
    """Profiler summaries of every goal's runs, marked where the goal is missed."""
    lines = ["## Where a step's time goes (torch.profiler, one optimizer step)", ""]
    found = False
    for key in GOAL_ORDER:
        summary = _load(results / f"goal-{key}" / "result.json")
        missed = summary.get("ratio_met") is False or summary.get("mfu_met") is False
        for run in ("train_yml", "example"):
            md = results / f"goal-{key}" / run / "trace_summary.md"
            if md.exists():
                found = True
                lines += [
                    f"### {key}, {run}{' (goal missed)' if missed else ''}",
                    "",
                    md.read_text(),
                    "",
                ]
    return lines if found else []


def header(results: Path, mode: str) -> list[str]:
    """Machine, software and the measured matmul rate."""
    setup = results / "setup"
    lines = [f"# Issue 17 benchmark ({mode} mode)", ""]
    if (setup / "gpus.csv").exists():
        gpus = (setup / "gpus.csv").read_text().strip().splitlines()[1:]
        lines += ["GPUs: " + " / ".join(gpus), ""]
    if (setup / "versions.txt").exists():
        found = [
            x for x in (setup / "versions.txt").read_text().splitlines() if x.startswith("python ")
        ]
        lines += ["Software: " + (found[0] if found else "?"), ""]
    matmul = _load(setup / "matmul.json").get("tflops_median")
    if matmul:
        lines += [
            f"bf16 matmul measured: {matmul:.0f} TFLOP/s (MFU against 989 and against this).",
            "",
        ]
    return lines


def footer(results: Path) -> list[str]:
    """Phase durations of every call and the phases that raised."""
    lines = []
    for path in sorted(results.glob("timings-*.json")):
        timings = _load(path)
        lines += [f"## Phase durations, call {path.stem.removeprefix('timings-')}", ""]
        lines += ["Seconds; -1 = skipped for time.", ""]
        lines += [*_table(list(timings), [list(timings.values())]), ""]
    for err in sorted(results.glob("*.error.txt")):
        phase = err.name.removesuffix(".error.txt")
        lines += [f"Phase {phase} raised: `{err.read_text().strip()}`", ""]
    return lines


def brief(results: Path) -> str:
    """The goals, sharding and scaling tables only (what the end of a call's output shows)."""
    goals, _ = goals_section(results)
    shard, _ = shard_section(results)
    return "\n".join(goals + shard + scale_section(results)) + "\n"


def write(results: Path, out: Path, mode: str) -> None:
    """Write summary.md, results.json and loss.png into out."""
    goals, panels = goals_section(results)
    shard, shard_panel = shard_section(results)
    lines = header(results, mode) + goals + rendered_section(results) + shard
    lines += scale_section(results) + trace_section(results) + footer(results)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    everything = {
        p.parent.relative_to(results).as_posix(): _load(p)
        for p in sorted(results.rglob("result.json"))
    }
    (out / "results.json").write_text(json.dumps(everything, indent=1, default=str) + "\n")
    if shard_panel:
        panels.append(shard_panel)
    with contextlib.suppress(ImportError):
        analyse.plot_losses(panels, out / "loss.png")
