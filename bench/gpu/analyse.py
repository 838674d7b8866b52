"""Figures of the issue-17 benchmark from what the runs leave behind (bench/gpu/harness.py).

Everything here reads files and computes; nothing starts a process. Definitions:

- Timed window: LLaMA-Factory's trainer_log.jsonl has, per logging step, the real (non-padding)
  input tokens seen by all ranks (`total_tokens`, from include_num_input_tokens_seen:
  non_padding) and `throughput` = total_tokens / seconds since training began. So each record's
  clock is total_tokens / throughput, and tokens/s is the token difference over the clock
  difference between the first logged step >= `warmup` and the last one: start-up, compilation
  and the profiled step are left out.
- Model FLOPs per token (MFU counts the model's work, not recomputation):
  full fine-tune 6 N; LoRA 4 N + 6 N_lora (the frozen weights get no weight gradients: forward
  2 N plus the input-gradient half of the backward 2 N; the adapters do forward, input and weight
  gradients). N = parameters that take part in matrix products: all of them when the embedding is
  tied to the lm_head (counted once), all but the input embedding when it is not (a lookup).
  Attention scores add 12 L h c per token (QK^T and AV, 4 L h c forward, 3x with the backward),
  c = the mean number of keys a query attends to: (cutoff + 1) / 2 in a packed row (packing
  without neat_packing lets a row's samples see each other), sum n(n+1)/2 / sum n over unpacked
  samples of n tokens. MFU is given without and with that term.
- MFU = FLOPs per token x tokens/s / (GPUs x peak); peak = 989 TFLOP/s, the H100/H200 SXM dense
  bf16 datasheet rate, and beside it the bf16 matmul rate measured on the machine.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PEAK_BF16 = 989e12
LORA_MODULES = ("q", "k", "v", "o", "gate", "up", "down")


def read_log(path: Path) -> list[dict[str, Any]]:
    """The records of a trainer_log.jsonl (a partial last line, still being written, is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def timed(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logging-step records that carry a token count and a throughput, one per step."""
    seen: dict[int, dict[str, Any]] = {}
    for r in records:
        if r.get("throughput") and r.get("total_tokens") and r.get("loss") is not None:
            seen[int(r["current_steps"])] = r
    return [seen[s] for s in sorted(seen)]


def clock(record: dict[str, Any]) -> float:
    """Seconds since training began when this record was logged."""
    return record["total_tokens"] / record["throughput"]


def window(records: list[dict[str, Any]], warmup: int) -> tuple[dict | None, dict | None]:
    """First and last timed records at or after step `warmup`."""
    after = [r for r in timed(records) if r["current_steps"] >= warmup]
    if len(after) < 2:
        return None, None
    return after[0], after[-1]


def window_done(records: list[dict[str, Any]], warmup: int, min_steps: int, seconds: float) -> bool:
    """Whether the timed window holds at least `min_steps` steps and `seconds` seconds."""
    first, last = window(records, warmup)
    if first is None or last is None:
        return False
    steps = last["current_steps"] - first["current_steps"]
    return steps >= min_steps and clock(last) - clock(first) >= seconds


def run_metrics(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Steady-state speed, warm-up cost, peak memory and the loss curve of one run."""
    steps = timed(records)
    losses = [[int(r["current_steps"]), float(r["loss"])] for r in records if "loss" in r]
    out: dict[str, Any] = {"logged_steps": len(steps), "losses": losses}
    vram = [r for r in records if "vram_allocated" in r]
    if vram:
        out["peak_alloc_gib"] = max(r["vram_allocated"] for r in vram)
        out["peak_reserved_gib"] = max(r.get("vram_reserved", 0) for r in vram)
    first, last = window(records, warmup)
    if first is None or last is None:
        return out
    dt = clock(last) - clock(first)
    dsteps = last["current_steps"] - first["current_steps"]
    dtokens = last["total_tokens"] - first["total_tokens"]
    step_s = dt / dsteps
    out.update(
        {
            "window_steps": [first["current_steps"], last["current_steps"]],
            "window_s": round(dt, 2),
            "tokens_per_s": round(dtokens / dt, 1),
            "step_s": round(step_s, 4),
            "tokens_per_step": round(dtokens / dsteps, 1),
            "last_step": last["current_steps"],
        }
    )
    # Time of the first steps beyond what they take in steady state: mostly torch.compile's
    # compilation (and any recompilation of the second and third step) when it is on.
    early = next((r for r in steps if r["current_steps"] >= 3), None)
    if early is not None and early["current_steps"] < first["current_steps"]:
        out["first_steps_extra_s"] = round(clock(early) - early["current_steps"] * step_s, 1)
    return out


def lora_params(meta: dict[str, Any], rank: int) -> int:
    """Trainable parameters of rank-`rank` LoRA on every linear layer of a Qwen2 decoder."""
    h, inter, layers = meta["hidden"], meta["intermediate"], meta["layers"]
    kv = h // meta["heads"] * meta["kv_heads"]
    shapes = {
        "q": (h, h),
        "k": (h, kv),
        "v": (h, kv),
        "o": (h, h),
        "gate": (h, inter),
        "up": (h, inter),
        "down": (inter, h),
    }
    return layers * sum(rank * (i + o) for i, o in (shapes[m] for m in LORA_MODULES))


def matmul_params(meta: dict[str, Any]) -> int:
    """Parameters that take part in matrix products (the input embedding of untied models not)."""
    tied = bool(meta.get("tied", 1))
    return int(meta["n_params"] - (0 if tied else meta["vocab"] * meta["hidden"]))


def flops_per_token(meta: dict[str, Any], finetuning: str, lora_rank: int = 8) -> dict[str, float]:
    """Model FLOPs per token without attention scores (see the module docstring)."""
    n = matmul_params(meta)
    if finetuning == "lora":
        n_lora = lora_params(meta, lora_rank)
        return {
            "n_matmul": n,
            "n_lora": n_lora,
            "flops": 4 * n + 6 * n_lora,
            "formula": "4N+6N_lora",
        }
    return {"n_matmul": n, "n_lora": 0, "flops": 6 * n, "formula": "6N"}


def attention_flops(meta: dict[str, Any], mean_context: float) -> float:
    """Attention-score FLOPs per token (forward and backward) at a mean context length."""
    return 12 * meta["layers"] * meta["hidden"] * mean_context


def mean_context_unpacked(lengths: list[int]) -> float:
    """Mean keys per query over causal samples of the given lengths (token-weighted)."""
    total = sum(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / total if total else 0.0


def mfu(flops: float, tokens_per_s: float, gpus: int, peak: float = PEAK_BF16) -> float:
    """Model FLOPs utilisation."""
    return flops * tokens_per_s / (gpus * peak)


def compare_losses(
    product: list[list[float]], example: list[list[float]], from_step: int
) -> dict[str, Any]:
    """product - example at the steps both logged from `from_step` on, and the example's noise.

    noise = standard deviation of the example's step-to-step change / sqrt(2), the spread of one
    step's loss around its trend.
    """
    a = {int(s): v for s, v in product}
    b = {int(s): v for s, v in example}
    common = sorted(s for s in set(a) & set(b) if s >= from_step)
    if not common:
        return {"steps": 0}
    diffs = [a[s] - b[s] for s in common]
    bs = [b[s] for s in sorted(b) if s >= from_step]
    steps_noise = [y - x for x, y in itertools.pairwise(bs)]
    noise = statistics.pstdev(steps_noise) / math.sqrt(2) if len(steps_noise) > 1 else math.nan
    mean = statistics.fmean(diffs)
    return {
        "steps": len(common),
        "range": [common[0], common[-1]],
        "mean_diff": round(mean, 4),
        "mean_abs_diff": round(statistics.fmean(abs(d) for d in diffs), 4),
        "max_abs_diff": round(max(abs(d) for d in diffs), 4),
        "noise": round(noise, 4),
        # The mean difference is within noise when it is under two standard errors of it.
        "within_noise": bool(abs(mean) <= 2 * noise / math.sqrt(len(common)) + 1e-9)
        if not math.isnan(noise)
        else None,
    }


# Errors that only report that a child failed: the cause is elsewhere in the log.
_WRAPPERS = ("ChildFailedError", "CalledProcessError", "SignalException", "ProcessExitedException")
_ERROR_LINE = re.compile(r"^\s*(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Interrupt))(:.*)?$")


def root_cause(log: str) -> str:
    """The first error line of a training log that is not a launcher's "a child failed"."""
    found = [m.group(0).strip() for m in map(_ERROR_LINE.match, log.splitlines()) if m]
    causes = [line for line in found if not any(w in line for w in _WRAPPERS)]
    return (causes or found or [""])[0][:400]


KERNEL_CLASSES = [
    ("GEMM", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|wgmma|matmul|_mm_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    ("NCCL", re.compile(r"nccl", re.I)),
    ("triton (compiled)", re.compile(r"^triton", re.I)),
    (
        "elementwise/reduce (eager)",
        re.compile(r"elementwise|vectorized|reduce|unrolled|index", re.I),
    ),
]


def classify(name: str) -> str:
    """A coarse class of a GPU kernel, by its name."""
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by intervals."""
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def trace_summary(path: Path, top: int = 15) -> dict[str, Any]:
    """Where one profiled step's time goes, from a torch.profiler Chrome trace.

    GPU busy = union of kernel, memcpy and memset intervals over the step's wall time (the
    ProfilerStep span); kernels grouped by class and by name; CPU operators by total time.
    """
    data = json.loads(path.read_text())
    events = data.get("traceEvents", data if isinstance(data, list) else [])
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e]
    gpu = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    step_us = max((e["dur"] for e in steps), default=0.0)
    busy_us = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        name = e["name"] if e.get("cat") == "kernel" else e["cat"]
        by_class["memcpy/memset" if e.get("cat") != "kernel" else classify(name)] += e["dur"]
        by_name[name][0] += e["dur"]
        by_name[name][1] += 1
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in cpu_ops:
        ops[e["name"]][0] += e["dur"]
        ops[e["name"]][1] += 1
    kernel_total = sum(by_class.values())
    return {
        "trace": path.name,
        "step_ms": round(step_us / 1e3, 2),
        "gpu_busy_ms": round(busy_us / 1e3, 2),
        "gpu_busy_fraction": round(busy_us / step_us, 3) if step_us else None,
        "kernels": len(gpu),
        "by_class_ms": {
            k: round(v / 1e3, 2) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])
        },
        "by_class_share": {
            k: round(v / kernel_total, 3)
            for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])
        }
        if kernel_total
        else {},
        "top_kernels": [
            {"name": k[:90], "ms": round(v[0] / 1e3, 2), "calls": int(v[1]), "class": classify(k)}
            for k, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],
        "top_cpu_ops": [
            {"name": k[:70], "ms": round(v[0] / 1e3, 2), "calls": int(v[1])}
            for k, v in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def trace_markdown(summary: dict[str, Any]) -> str:
    """A trace summary as markdown tables."""
    busy = summary.get("gpu_busy_fraction")
    lines = [
        f"One profiled optimizer step ({summary['trace']}): {summary['step_ms']} ms wall, GPU busy "
        f"{summary['gpu_busy_ms']} ms ({'' if busy is None else f'{100 * busy:.0f} %'}), "
        f"{summary['kernels']} GPU kernels/copies.",
        "",
        "| kernel class | ms | share of kernel time |",
        "|---|---:|---:|",
    ]
    for k, v in summary["by_class_ms"].items():
        lines.append(f"| {k} | {v} | {100 * summary['by_class_share'].get(k, 0):.1f} % |")
    lines += ["", "| top GPU kernels | class | calls | ms |", "|---|---|---:|---:|"]
    for k in summary["top_kernels"]:
        name = k["name"].replace("|", "/")
        lines.append(f"| `{name}` | {k['class']} | {k['calls']} | {k['ms']} |")
    lines += ["", "| top CPU operators (inclusive) | calls | ms |", "|---|---:|---:|"]
    for k in summary["top_cpu_ops"]:
        lines.append(f"| `{k['name'].replace('|', '/')}` | {k['calls']} | {k['ms']} |")
    return "\n".join(lines) + "\n"


def plot_losses(panels: list[dict[str, Any]], out: Path) -> Path | None:
    """One PNG, one panel per comparison: each panel {title, curves: {label: [[step, loss]]}}."""
    panels = [p for p in panels if any(p["curves"].values())]
    if not panels:
        return None
    import matplotlib as mpl  # noqa: PLC0415  (only the plot needs matplotlib)

    mpl.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(
        1, len(panels), figsize=(5.2 * len(panels), 3.8), dpi=110, squeeze=False
    )
    for ax, panel in zip(axes[0], panels, strict=True):
        for label, points in panel["curves"].items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=label, lw=1.2)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("optimizer step (equal tokens per step)")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
