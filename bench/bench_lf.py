"""Benchmark LLaMA-Factory training configs: tokens/s, MFU, peak memory, loss curves.

Subcommands:

``run``     write a LLaMA-Factory YAML for a preset, start it the way ``llamafactory-cli train``
            with ``FORCE_TORCHRUN=1`` does (torchrun with NNODES/NODE_RANK/NPROC_PER_NODE/
            MASTER_ADDR/MASTER_PORT; one torchrun per logical node), with ``bench/lf_entry.py`` as
            the script so a measuring callback rides along, and summarise the result.
``report``  gather every run's summary under a results folder into ``results.csv``,
            ``results.md`` and ``loss_curves.json``, with profile/baseline and scaling ratios.
``plot``    draw the loss curves of two or more runs into a PNG (needs matplotlib; CPU is fine).

How numbers are counted (see lf_entry.py): real tokens are non-pad input tokens (prompt and
response) summed over all ranks; the window starts after ``--warmup`` optimizer steps and ends at
the last step, both after a CUDA sync; tokens/s = real tokens in window / window seconds.
MFU = 6 * N * tokens/s / (GPUs * peak), N = all parameters (tied embeddings counted once, so the
lm_head matmul is counted and the embedding lookup is not), peak = 989 TFLOP/s dense bf16 (H100/H200
SXM datasheet); attention-score FLOPs are not counted. Peak memory is
``torch.cuda.max_memory_allocated`` per rank, and nvidia-smi's largest ``memory.used`` per GPU.

Every process started here gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PEAK_BF16_TFLOPS = 989.0
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
ENTRY = Path(__file__).resolve().parent / "lf_entry.py"

# LLaMA-Factory's examples/train_full/*_full_sft.yaml, without DeepSpeed, batch 8 per device,
# cutoff 1024: gradient checkpointing on (LLaMA-Factory's default), trainable weights upcast to
# fp32 with bf16 autocast, padded batches (no packing), SDPA attention.
BASELINE: dict[str, Any] = {
    "stage": "sft",
    "do_train": True,
    "finetuning_type": "full",
    "template": "qwen",
    "cutoff_len": 1024,
    "overwrite_cache": True,
    "preprocessing_num_workers": 16,
    "dataloader_num_workers": 4,
    "logging_steps": 5,
    "save_strategy": "no",
    "plot_loss": False,
    "overwrite_output_dir": True,
    "report_to": "none",
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 1.0e-5,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.1,
    "bf16": True,
    "ddp_timeout": 180000000,
    "flash_attn": "sdpa",
    "seed": 42,
}

# The performance profile as first measured (with Liger). BENCHMARKS.md has the rules and the
# evidence: for the 0.5B and 1.5B models Liger turned out slower, so the recommended profile is
# `profile_noliger` (the `profile` name is kept so that recorded results keep their meaning).
# Packing fills 1024-token rows, so the micro-batch is counted in rows: 3 rows carry about as many
# real tokens as 8 padded samples of this data (mean 336 tokens), which keeps the optimisation the
# same.
PROFILE: dict[str, Any] = {
    **BASELINE,
    "disable_gradient_checkpointing": True,
    "packing": True,
    "neat_packing": False,
    "enable_liger_kernel": True,
    "per_device_train_batch_size": 3,
    # Without gradient checkpointing the HF Trainer would turn on DDP's find_unused_parameters
    # (an extra autograd-graph walk every step); every parameter is used, so switch it off.
    "ddp_find_unused_parameters": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    "baseline": BASELINE,
    "profile": PROFILE,
    # Ablations of the profile.
    "profile_pure_bf16": {**PROFILE, "pure_bf16": True, "bf16": False},
    "profile_mb8": {**PROFILE, "per_device_train_batch_size": 8},
    "baseline_nogc": {**BASELINE, "disable_gradient_checkpointing": True},
    "baseline_pack": {**BASELINE, "packing": True, "per_device_train_batch_size": 3},
    "profile_noliger": {**PROFILE, "enable_liger_kernel": False},
    "profile_noliger_mb8": {
        **PROFILE,
        "enable_liger_kernel": False,
        "per_device_train_batch_size": 8,
    },
}


def _yaml_value(value: Any) -> str:  # noqa: ANN401
    """Render a scalar as YAML (bools lower-case, strings quoted when needed)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def _parse_set(items: list[str]) -> dict[str, Any]:
    """Turn ``key=value`` strings into a dict, values parsed as JSON where possible."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, raw = item.partition("=")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def write_config(
    path: Path,
    *,
    preset: str,
    model: Path,
    data_dir: Path,
    steps: int,
    output_dir: Path,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    """Write the LLaMA-Factory YAML for `preset` and return the settings."""
    cfg: dict[str, Any] = {
        "model_name_or_path": str(model),
        "trust_remote_code": True,
        **PRESETS[preset],
        "dataset": "synth_alpaca",
        "dataset_dir": str(data_dir),
        "output_dir": str(output_dir),
        "max_steps": steps,
        **overrides,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# bench/bench_lf.py preset {preset}"]
    lines += [f"{k}: {_yaml_value(v)}" for k, v in cfg.items()]
    path.write_text("\n".join(lines) + "\n")
    return cfg


class _SmiSampler(threading.Thread):
    """Sample nvidia-smi memory.used every 500 ms and keep the maximum per GPU."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.max_mib: dict[int, int] = {}
        self.proc: subprocess.Popen[str] | None = None

    def run(self) -> None:
        """Read nvidia-smi's loop output until it is stopped."""
        try:
            self.proc = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=index,memory.used",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    "500",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            return
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                idx, mib = int(parts[0]), int(parts[1])
                self.max_mib[idx] = max(self.max_mib.get(idx, 0), mib)

    def stop(self) -> None:
        """Stop the nvidia-smi loop."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()


def _node_env(
    args: argparse.Namespace, run_dir: Path, rank: int, visible: str, nproc: int
) -> dict[str, str]:
    """Environment of one logical node's torchrun, as llamafactory-cli would set it."""
    nodes = args.nodes
    env = dict(os.environ)
    env.update(NO_MULTICAST)
    env.update(
        {
            # What llamafactory-cli's launcher adds for torchrun (OPTIM_TORCH defaults on).
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
            "CUDA_VISIBLE_DEVICES": visible,
            "NNODES": str(nodes),
            "NODE_RANK": str(rank),
            "NPROC_PER_NODE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(args.port),
            "BENCH_OUT": str(run_dir),
            "BENCH_WARMUP_STEPS": str(args.warmup),
            "BENCH_SKIP_SAVE": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if os.environ.get("HF_DATASETS_CACHE"):
        # Logical nodes on one host must not share the datasets cache (each writes it).
        env["HF_DATASETS_CACHE"] = f"{os.environ['HF_DATASETS_CACHE']}/node{rank}"
    if nodes > 1:
        env["NCCL_SOCKET_IFNAME"] = "lo"
        if args.separate_hostid:
            env["NCCL_HOSTID"] = f"bench-node-{rank}"
    if args.record_vram:
        env["RECORD_VRAM"] = "1"
    return env


def launch(args: argparse.Namespace) -> int:
    """Start the run (one torchrun per logical node), wait, and summarise it."""
    run_dir = args.results / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    overrides = _parse_set(args.set or [])
    cfg_path = run_dir / "config.yaml"
    cfg = write_config(
        cfg_path,
        preset=args.preset,
        model=args.model,
        data_dir=args.data_dir,
        steps=args.steps,
        output_dir=args.work / args.name,
        overrides=overrides,
    )
    gpus = args.gpus.split(",")
    nodes = args.nodes
    nproc = 1 if nodes > 1 else len(gpus)
    if nodes > 1 and len(gpus) != nodes:
        raise SystemExit("--nodes > 1 wants one GPU per node in --gpus")

    smi = _SmiSampler()
    smi.start()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    start = time.time()
    for rank in range(nodes):
        env = _node_env(args, run_dir, rank, gpus[rank] if nodes > 1 else args.gpus, nproc)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nodes),
            "--node_rank",
            str(rank),
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(args.port),
            str(ENTRY),
            str(cfg_path),
        ]
        log = (run_dir / f"node{rank}.log").open("wb")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    rcs: list[int | None] = [None] * nodes
    deadline = start + args.timeout
    while any(rc is None for rc in rcs) and time.time() < deadline:
        rcs = [p.poll() for p in procs]
        if any(rc not in (None, 0) for rc in rcs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    smi.stop()
    for log in logs:
        log.close()
    rcs = [p.returncode for p in procs]
    summary = summarise(
        run_dir, args=args, cfg=cfg, rcs=rcs, wall_s=time.time() - start, smi_mib=smi.max_mib
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    return 0 if summary.get("ok") else 1


def _model_params(model: Path) -> int | None:
    """Read the parameter count that make_model.py stored beside the weights."""
    meta = model / "bench_model.json"
    return json.loads(meta.read_text())["n_params"] if meta.exists() else None


def summarise(
    run_dir: Path,
    *,
    args: argparse.Namespace,
    cfg: dict[str, Any],
    rcs: list[int | None],
    wall_s: float,
    smi_mib: dict[int, int],
) -> dict[str, Any]:
    """Combine the per-rank JSON files into one summary.json."""
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("rank*.json"))]
    n_params = _model_params(args.model)
    gpus = len(args.gpus.split(","))
    summary: dict[str, Any] = {
        "name": args.name,
        "preset": args.preset,
        "model": args.model.name,
        "n_params": n_params,
        "nodes": args.nodes,
        "gpus": gpus,
        "separate_hostid": bool(args.separate_hostid),
        "return_codes": rcs,
        "wall_s": round(wall_s, 1),
        "config": cfg,
        "ok": False,
        "smi_peak_mib": smi_mib,
    }
    if len(ranks) != gpus or any(r.get("window_s") is None for r in ranks):
        return _save(run_dir, summary)
    window_s = max(r["window_s"] for r in ranks)
    real = sum(r["window_real_tokens"] for r in ranks)
    slots = sum(r["window_slot_tokens"] for r in ranks)
    tps = real / window_s
    rank0 = next(r for r in ranks if r["rank"] == 0)
    summary.update(
        {
            "ok": True,
            "steps": rank0["steps"],
            "warmup_steps": rank0["warmup_steps"],
            "window_steps": rank0["window_steps"],
            "window_s": round(window_s, 3),
            "step_s": round(window_s / max(1, rank0["window_steps"]), 4),
            "tokens_per_s": round(tps, 1),
            "tokens_per_s_per_gpu": round(tps / gpus, 1),
            "real_tokens_per_step": round(real / max(1, rank0["window_steps"]), 1),
            "pad_fraction": round(1 - real / slots, 4) if slots else None,
            "max_mem_alloc_gib": [round(r["max_memory_allocated"] / 2**30, 2) for r in ranks],
            "max_mem_reserved_gib": [round(r["max_memory_reserved"] / 2**30, 2) for r in ranks],
            "loss": [
                {"step": h["step"], "loss": h["loss"]}
                for h in rank0.get("log_history", [])
                if "loss" in h
            ],
        }
    )
    if n_params:
        flops = 6 * n_params * tps
        summary["model_tflops_per_gpu"] = round(flops / gpus / 1e12, 1)
        summary["mfu"] = round(flops / (gpus * PEAK_BF16_TFLOPS * 1e12), 4)
        if args.measured_peak and args.measured_peak.exists():
            measured = json.loads(args.measured_peak.read_text())["tflops_median"]
            summary["mfu_vs_measured_matmul"] = round(flops / (gpus * measured * 1e12), 4)
    return _save(run_dir, summary)


def _save(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Write summary.json and return the summary."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


COLUMNS = [
    "name",
    "model",
    "preset",
    "nodes",
    "gpus",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "mfu",
    "mfu_vs_measured_matmul",
    "step_s",
    "real_tokens_per_step",
    "pad_fraction",
    "max_mem_alloc_gib",
    "smi_peak_mib",
    "ok",
]


def report(args: argparse.Namespace) -> int:
    """Write results.csv, results.md and loss_curves.json from every summary.json found."""
    rows = [json.loads(p.read_text()) for p in sorted(args.results.glob("*/summary.json"))]
    with (args.results / "results.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k) for k in COLUMNS})
    by_key = {(r["model"], r["preset"], r["nodes"], r["gpus"]): r for r in rows if r.get("ok")}
    md = [
        "| run | model | preset | GPUs | tokens/s | tokens/s/GPU | MFU (989) | MFU (matmul) |"
        " step s | real tok/step | pad % | peak alloc GiB | vs baseline | 2-GPU scaling |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        if not r.get("ok"):
            md.append(
                f"| {r['name']} | {r['model']} | {r['preset']} | {r['gpus']} | failed "
                f"(rc {r['return_codes']}) |" + " |" * 9
            )
            continue
        base = by_key.get((r["model"], "baseline", r["nodes"], r["gpus"]))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        one = by_key.get((r["model"], r["preset"], 1, 1))
        scaling = (
            f"{r['tokens_per_s'] / (r['gpus'] * one['tokens_per_s']):.2f}"
            if one and r["gpus"] > 1
            else ""
        )
        mfu_m = r.get("mfu_vs_measured_matmul")
        md.append(
            f"| {r['name']} | {r['model']} | {r['preset']} | {r['gpus']} "
            f"({r['nodes']} node{'s' if r['nodes'] > 1 else ''}) | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | {100 * r.get('mfu', math.nan):.1f} % | "
            f"{'' if mfu_m is None else f'{100 * mfu_m:.1f} %'} | {r['step_s']:.3f} | "
            f"{r['real_tokens_per_step']:,.0f} | {100 * (r['pad_fraction'] or 0):.1f} | "
            f"{max(r['max_mem_alloc_gib']):.1f} | {ratio} | {scaling} |"
        )
    (args.results / "results.md").write_text("\n".join(md) + "\n")
    curves = {r["name"]: r.get("loss", []) for r in rows if r.get("ok")}
    (args.results / "loss_curves.json").write_text(json.dumps(curves))
    print("\n".join(md))
    return 0


def plot(args: argparse.Namespace) -> int:
    """Plot the named runs' loss curves (from loss_curves.json) into a PNG."""
    import matplotlib as mpl  # noqa: PLC0415  (only the plot needs matplotlib)

    mpl.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    curves = json.loads(args.curves.read_text())
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name in args.runs:
        pts = curves.get(name, [])
        if pts:
            ax.plot([p["step"] for p in pts], [p["loss"] for p in pts], label=name, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    """Dispatch the subcommands."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one config and summarise it")
    run.add_argument("--name", required=True)
    run.add_argument("--preset", choices=sorted(PRESETS), required=True)
    run.add_argument("--model", type=Path, required=True)
    run.add_argument("--data-dir", type=Path, required=True)
    run.add_argument("--gpus", default="0", help="CUDA device ids, comma-separated")
    run.add_argument("--nodes", type=int, default=1, help="logical nodes (one GPU each if > 1)")
    run.add_argument(
        "--separate-hostid",
        action="store_true",
        help="give each logical node its own NCCL_HOSTID (sockets, not NVLink)",
    )
    run.add_argument("--steps", type=int, default=100)
    run.add_argument("--warmup", type=int, default=20)
    run.add_argument("--port", type=int, default=29500)
    run.add_argument("--timeout", type=float, default=540)
    run.add_argument("--results", type=Path, default=Path("bench/results"))
    run.add_argument("--work", type=Path, default=Path("/tmp/bench-runs"))
    run.add_argument("--measured-peak", type=Path, help="matmul_peak.py's JSON")
    run.add_argument("--record-vram", action="store_true")
    run.add_argument("--set", action="append", help="override a YAML key: key=value")
    rep = sub.add_parser("report", help="tabulate every run under a results folder")
    rep.add_argument("--results", type=Path, default=Path("bench/results"))
    plo = sub.add_parser("plot", help="plot loss curves")
    plo.add_argument("--curves", type=Path, required=True)
    plo.add_argument("--out", type=Path, required=True)
    plo.add_argument("--title", default="loss")
    plo.add_argument("runs", nargs="+")
    args = parser.parse_args()
    return {"run": launch, "report": report, "plot": plot}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
