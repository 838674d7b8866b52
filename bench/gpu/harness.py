#!/usr/bin/env python3
"""Issue 17's benchmark: what train.yml renders against LLaMA-Factory's own example configs.

    harness.py run --mode gpu|cpu --playbook PATH --out DIR [--deadline-s S] PHASE...

Phases (in the order given; each is skipped, and says so, when its estimate would pass the
deadline):

- ``setup``: GPUs and versions, the node facts and the supervisor (provision.yml --tags
  host_facts,llamafactory,job_supervisor), the measured bf16 matmul rate, the models the later
  phases need (bench/make_model.py) and the data.
- ``goal-1.5b``, ``goal-0.5b``, ``goal-7b``: the product, then the example, on one GPU:
  1. train.yml (local connection, one logical node per GPU) with the catalogue model, the
     generated weights and the synthetic data, detached; the benchmark follows rank 0's
     trainer_log.jsonl and stops the run (the supervisor's `llama-job stop`) once the timed window
     is long enough. What train.yml rendered (train.yaml, plan.json, ds_config.json) is kept.
  2. LLaMA-Factory's example (examples/train_full/qwen3_full_sft.yaml or
     examples/train_lora/qwen3_lora_sft.yaml of v0.9.5) launched by hand, as its README says:
     ``FORCE_TORCHRUN=1 ... llamafactory-cli train example.yaml``, same model and data, its
     gradient accumulation set so that an optimizer step holds the product's real tokens.
  Both get the same measuring settings and nothing else (MEASURE below).
- ``shard-none``, ``shard-zero2``, ``shard-zero3``, ``shard-zero3_offload``, ``shard-fsdp``:
  train.yml -e deepspeed=<stage> on the 0.5B model, watched to the end of a short run.
- ``scale-1.5b``: the 1.5B product on every GPU as its own logical node (2 GPUs or more only).

Everything lands under --out: results/ (one folder per phase and run: result.json, the rendered
files, logs, trace summaries), summary.md, results.json, loss.png, and profile.tar.gz of it all,
refreshed after every phase. analyse.py says how each figure is computed.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import analyse  # this folder is not a package: imported from the path set above
import dry
import make_model

ROOT = Path(__file__).resolve().parents[2]
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# In every training process: no hub, and LLaMA-Factory's own peak-memory figures in its log.
RUN_ENV = {**NO_MULTICAST, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "RECORD_VRAM": "1"}

# LLaMA-Factory v0.9.5, examples/train_full/qwen3_full_sft.yaml and examples/train_lora/
# qwen3_lora_sft.yaml: their settings, less model, dataset and output paths. The full example
# also names `deepspeed: examples/deepspeed/ds_z3_config.json` ("choices: ds_z0, ds_z2, ds_z3"):
# left out on one GPU, where ZeRO-3 only adds gathering and no memory is short; without it the
# baseline is faster, so the ratios below are the conservative ones.
EXAMPLE_COMMON: dict[str, Any] = {
    "trust_remote_code": True,
    "stage": "sft",
    "do_train": True,
    "cutoff_len": 2048,
    "preprocessing_num_workers": 16,
    "dataloader_num_workers": 4,
    "logging_steps": 10,
    "save_steps": 500,
    "plot_loss": True,
    "overwrite_output_dir": True,
    "save_only_model": False,
    "report_to": "none",
    "per_device_train_batch_size": 1,
    "num_train_epochs": 3.0,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.1,
    "bf16": True,
    "ddp_timeout": 180000000,
}
EXAMPLES: dict[str, dict[str, Any]] = {
    "full": {
        **EXAMPLE_COMMON,
        "finetuning_type": "full",
        "gradient_accumulation_steps": 2,
        "learning_rate": 1.0e-5,
    },
    "lora": {
        **EXAMPLE_COMMON,
        "finetuning_type": "lora",
        "lora_rank": 8,
        "lora_target": "all",
        "gradient_accumulation_steps": 8,
        "learning_rate": 1.0e-4,
    },
}
# Measuring settings, the same for the product and the example: a log line and a token count
# every step, no checkpoint inside the window, and a 5-step warm-up instead of 10 % of a
# thousands-of-steps schedule (so that the few dozen steps a benchmark runs see the full learning
# rate and the loss curves say something). None of these changes a step's work, except that
# counting tokens reads one number back from the GPU per micro-batch in both runs.
MEASURE: dict[str, Any] = {
    "logging_steps": 1,
    "save_steps": 100000,
    "include_num_input_tokens_seen": "non_padding",
    "warmup_ratio": 0.0,  # warmup_steps wins when > 0; the planner refuses null
    "warmup_steps": 5,
}


def profiler_args(step: int) -> dict[str, Any]:
    """LLaMA-Factory's own torch.profiler callback, recording optimizer step `step` only."""
    return {
        "enable_torch_profiler": True,
        "profiler_wait_steps": step - 2,
        "profiler_warmup_steps": 1,
        "profiler_active_steps": 1,
        "profiler_repeat": 1,
        "profiler_record_shapes": False,
        "profiler_profile_memory": False,
        "profiler_with_stack": False,
    }


# Keys of the rendered train.yaml that make the profile (reported as train.yml rendered them).
PROFILE_KEYS = [
    "finetuning_type",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "cutoff_len",
    "packing",
    "neat_packing",
    "disable_gradient_checkpointing",
    "torch_compile",
    "enable_liger_kernel",
    "bf16",
    "pure_bf16",
    "flash_attn",
    "optim",
    "ddp_find_unused_parameters",
    "fsdp",
    "learning_rate",
    "lora_rank",
]


@dataclass
class Goal:
    """One comparison of issue 17: a catalogue model, its fine-tuning and the targets."""

    model: str
    size: str
    finetuning: str
    ratio: float
    mfu: float | None


GOALS = {
    "1.5b": Goal("qwen2.5-1.5b", "1.5b", "full", 4.0, 0.40),
    "0.5b": Goal("qwen2.5-0.5b", "0.5b", "full", 3.0, None),
    "7b": Goal("qwen2.5-7b", "7b", "lora", 9.0, 0.35),
}
STAGES = ["none", "zero0", "zero2", "zero3", "zero3_offload", "fsdp"]


@dataclass
class Box:
    """When to stop a run: after `warmup` steps, a window of `min_steps` steps and `seconds`."""

    warmup: int
    min_steps: int
    seconds: float
    cap: float
    profile_step: int | None = None


@dataclass
class Mode:
    """Shapes, sizes and time boxes of one mode (gpu: the H200; cpu: the dry run here)."""

    name: str
    samples: int
    sizes: dict[str, str]
    product: Box
    example: Box
    shard_steps: int
    # The longest a sharding run may take (the CPU's first DeepSpeed run JIT-builds its comm op).
    shard_cap: float
    # Seconds each phase is expected to take (BENCHMARKS.md timings; bench/README.md).
    estimates: dict[str, float]
    extra_example: dict[str, Any] = field(default_factory=dict)


GPU_MODE = Mode(
    name="gpu",
    # 12000 records (make_model.py's default, what the section 2 proof trained through
    # train.yml): 3 epochs are thousands of optimizer steps, a run long enough for any
    # rule that weighs torch.compile's compilation against the steps it speeds up.
    samples=12000,
    # Every shape bench/make_model.py makes is a size a goal may train.
    sizes={size: size for size in make_model.SHAPES if size != "tiny"},
    product=Box(warmup=8, min_steps=15, seconds=12, cap=270, profile_step=5),
    # The example is not profiled: its steps (dozens of checkpointed micro-batches) make
    # traces of 100 MB, and the goals are about where train.yml's step goes.
    example=Box(warmup=3, min_steps=3, seconds=12, cap=150),
    shard_steps=12,
    shard_cap=200,
    # Expected seconds per phase (bench/README.md, "Time budget", says where from).
    estimates={
        "setup": 60,
        "goal-1.5b": 195,
        "goal-0.5b": 160,
        "goal-7b": 245,
        "shard": 55,
        "scale-1.5b": 160,
    },
)
MODES = {
    "gpu": GPU_MODE,
    # The dry run here: the tiny shape for every goal, a loaded 2-core machine, fp32.
    "cpu": replace(
        GPU_MODE,
        name="cpu",
        samples=600,
        sizes=dict.fromkeys(GPU_MODE.sizes, "tiny"),
        product=Box(warmup=7, min_steps=3, seconds=2, cap=400, profile_step=5),
        example=Box(warmup=3, min_steps=3, seconds=2, cap=300),
        shard_steps=8,
        shard_cap=900,
        estimates={**dict.fromkeys(GPU_MODE.estimates, 240), "shard": 150},
        extra_example={"bf16": False, "preprocessing_num_workers": 2, "dataloader_num_workers": 0},
    ),
}
# Seconds a goal keeps for its example when train.yml's run is cut short by the deadline.
EXAMPLE_RESERVE = 70


class Ctx:
    """Paths, tools and the clock of one benchmark call."""

    def __init__(self, args: argparse.Namespace) -> None:
        """Set up the folders of this call."""
        self.mode = MODES[args.mode]
        # The dry run (dry.py): every phase's own code, planned and checked instead of launched.
        self.dry = bool(getattr(args, "dry", False))
        self.out = args.out.resolve()
        self.work = args.work.resolve()
        self.results = self.out / "results"
        self.models = self.work / "models"
        self.data_dir = self.work / "data"
        self.data = self.data_dir / "synth_alpaca.json"
        self.playbook = args.playbook
        self.python = sys.executable
        self.env_bin = Path(args.env_bin) if args.env_bin else Path(sys.executable).parent
        self.base_dir = Path(args.base_dir)
        self.runs_dir = self.base_dir / "runs"
        self.start = time.monotonic()
        self.deadline = self.start + args.deadline_s
        self.extra_vars = json.loads(args.product_extra) if args.product_extra else {}
        self.gpu_memory_gib = args.gpu_memory_gib
        self.port = 29600
        # Added to the environment of every process a run starts (baselines.py: the GPU cap).
        self.extra_env: dict[str, str] = {}
        for path in (self.results, self.models, self.data_dir):
            path.mkdir(parents=True, exist_ok=True)
        # Logical nodes of the scaling phase: one per GPU (the dry run: two CPU "nodes").
        gpu = self.mode.name == "gpu" and not self.dry
        self.nodes = args.nodes or (gpu_count() if gpu else 2)
        # Models still being generated (setup starts them; a phase waits for its own).
        self.pending: dict[str, subprocess.Popen[bytes]] = {}

    def left(self) -> float:
        """Seconds before the deadline."""
        return self.deadline - time.monotonic()

    def next_port(self) -> int:
        """A fresh master port for the next hand launch."""
        self.port += 1
        return self.port

    def inventory(self, nodes: int) -> Path:
        """The inventory of `nodes` logical nodes (one GPU each), as JSON (a YAML subset)."""
        path = self.work / f"inventory-{nodes}.yml"
        inv = inventory(
            self.mode.name,
            nodes,
            self.base_dir,
            self.env_bin.parent,
            self.gpu_memory_gib,
            extra_env=self.extra_env,
        )
        path.write_text(json.dumps(inv, indent=2) + "\n")
        return path


def say(msg: str) -> None:
    """One progress line with the time."""
    print(f"=== {time.strftime('%H:%M:%S')} {msg}", flush=True)


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def inventory(
    mode: str,
    nodes: int,
    base_dir: Path,
    env_dir: Path,
    gpu_memory_gib: float | None,
    *,
    extra_env: dict[str, str] | None = None,
) -> dict:
    """bench/gpu/inventory.yml's layout for `nodes` logical nodes, local connection.

    gpu: the image's torch environment, one GPU per node, NCCL over lo, NVLink multicast off.
    cpu: the same on this machine, with the controller's training venv and a private base dir.
    """
    node: dict[str, Any] = {
        "cluster_address": "127.0.0.1",
        "cluster_accelerator": "nvidia" if mode == "gpu" else "cpu",
        "nproc_per_node": 1,
        "cluster_base_dir": str(base_dir),
        "cluster_env_dir": str(env_dir),
        "cluster_user": "root",
        "cluster_group": "root",
        "nccl_socket_ifname": "lo",
        "firewall_enabled": False,
        "wheelhouse_enabled": False,
        "pytorch_install": False,
        "llamafactory_install": False,
        "python_env_system_packages": [],
        "cuda_toolkit_enabled": False,
        # Every logical node sees the one filesystem: checkpoints are written once, by rank 0.
        "training_shared_storage": True,
        "master_port": 29711 if mode == "gpu" else 29731,
        "cluster_environment": {**RUN_ENV, **(extra_env or {})},
    }
    if mode == "gpu":
        node["cuda_version"] = "13.0"
    if gpu_memory_gib:
        # The planning knob (planner/nodes.py): wins over the GPU memory the facts report.
        node["gpu_memory_gib"] = gpu_memory_gib
    hosts = {}
    for index in range(nodes):
        host = {**node}
        if mode == "gpu":
            host["gpu_ids"] = [index]
        hosts[f"{mode}{index}"] = host
    names = list(hosts)
    return {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                "ansible_become": False,
            },
            "children": {
                "cluster": {
                    "children": {
                        "master": {"hosts": {names[0]: hosts[names[0]]}},
                        "workers": {"hosts": {n: hosts[n] for n in names[1:]}},
                    }
                }
            },
        }
    }


def run_env(ctx: Ctx) -> dict[str, str]:
    """The environment of every process the benchmark starts."""
    env = {**os.environ, **RUN_ENV, "PYTHONUNBUFFERED": "1", "ANSIBLE_FORCE_COLOR": "0"}
    env.update(ctx.extra_env)
    env["PATH"] = f"{ctx.env_bin}:{env.get('PATH', '')}"
    if ctx.mode.name == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def smi(*query: str) -> list[list[str]]:
    """Rows of an nvidia-smi CSV query (empty without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_used_mib(exclude: set[int]) -> dict[int, int]:
    """memory.used per GPU, less what the processes in `exclude` hold (the model generators)."""
    used = {int(i): int(m) for i, m in smi("--query-gpu=index,memory.used") if m.isdigit()}
    if exclude:
        index = {u: int(i) for i, u in smi("--query-gpu=index,uuid")}
        for uuid, pid, mib in smi("--query-compute-apps=gpu_uuid,pid,used_memory"):
            if pid.isdigit() and int(pid) in exclude and mib.isdigit() and uuid in index:
                used[index[uuid]] -= int(mib)
    return used


class SmiSampler(threading.Thread):
    """The largest memory.used nvidia-smi reports per GPU while a run goes on (every 500 ms)."""

    def __init__(self, ctx: Ctx) -> None:
        """Prepare the sampler; start() begins sampling."""
        super().__init__(daemon=True)
        self.ctx = ctx
        self.max_mib: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        """Sample until stopped."""
        while not self.done.is_set():
            for idx, mib in gpu_used_mib(generator_pids(self.ctx)).items():
                self.max_mib[idx] = max(self.max_mib.get(idx, 0), mib)
            self.done.wait(0.5)

    def stop(self) -> dict[int, float]:
        """Stop sampling; the peaks in GiB."""
        self.done.set()
        return {k: round(v / 1024, 2) for k, v in self.max_mib.items()}


def generator_pids(ctx: Ctx) -> set[int]:
    """Model generators still running (their GPU memory is not the run's)."""
    return {p.pid for p in ctx.pending.values() if p.poll() is None}


def processes_with(text: str) -> list[int]:
    """PIDs whose command line contains `text` (the run's own directory: unique to it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(proc.name))
    return pids


def wait_gpu_idle(ctx: Ctx, seconds: float = 40) -> None:
    """Wait until the last run's GPU memory is released (GPU mode)."""
    if ctx.mode.name != "gpu":
        return
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if all(v < 2048 for v in gpu_used_mib(generator_pids(ctx)).values()):
            return
        time.sleep(1)
    say("warning: GPU memory still in use after the last run")


def follow(log: Path, running: Any, box: Box, cap: float) -> tuple[str, float | None]:  # noqa: ANN401
    """Watch a trainer log until the window is long enough, the run ends, or `cap` seconds pass.

    Returns why it stopped and when (monotonic) the first log record was seen.
    """
    start = time.monotonic()
    first_seen = None
    while True:
        records = analyse.read_log(log)
        if records and first_seen is None:
            first_seen = time.monotonic()
        if analyse.window_done(records, box.warmup, box.min_steps, box.seconds):
            return "window", first_seen
        if not running():
            return "ended", first_seen
        if time.monotonic() - start > cap:
            return "cap", first_seen
        time.sleep(1)


def stop_pids(pids: list[int], grace: float = 20) -> None:
    """SIGTERM these processes, then SIGKILL what is left after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.5)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def tail(path: Path, lines: int = 60) -> str:
    """The last lines of a text file ('' if missing)."""
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def summarise_trace(src_dir: Path, dest: Path) -> dict[str, Any] | None:
    """Summarise the newest torch.profiler trace under src_dir into dest (and keep it gzipped)."""
    traces = (
        sorted(src_dir.rglob("*.json"), key=lambda p: p.stat().st_mtime) if src_dir.exists() else []
    )
    if not traces:
        return None
    trace = traces[-1]
    try:
        summary = analyse.trace_summary(trace)
    except (ValueError, KeyError, OSError) as err:
        return {"error": f"{trace.name}: {err}"}
    (dest / "trace_summary.md").write_text(analyse.trace_markdown(summary))
    packed = dest / "trace.json.gz"
    with trace.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    # The tool brings back 16 MiB a file: keep raw traces only while they are small.
    if packed.stat().st_size > 3 * 2**20:
        packed.unlink()
    return summary


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file as a dict ({} if missing)."""
    if not path.exists():
        return {}
    import yaml  # noqa: PLC0415  (PyYAML comes with the training environment)

    return yaml.safe_load(path.read_text()) or {}


def rendered(train_yaml: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The profile settings train.yml rendered (absent keys are LLaMA-Factory's defaults)."""
    out = {k: train_yaml[k] for k in PROFILE_KEYS if k in train_yaml}
    if plan:
        out["stage"] = plan.get("deepspeed")
        out["effective_batch"] = plan.get("effective_batch")
        out["world_size"] = plan.get("world_size")
    return out


def product_command(
    ctx: Ctx, goal: Goal, *, nodes: int, deepspeed: str | None, steps: int | None, box: Box
) -> list[str]:
    """The train.yml command line of one run (what a user types, plus the measuring settings)."""
    train_args = {**MEASURE, "learning_rate": EXAMPLES[goal.finetuning]["learning_rate"]}
    if steps:
        train_args["max_steps"] = steps
    elif box.profile_step:
        train_args.update(profiler_args(box.profile_step))
    extra = {**ctx.extra_vars}
    extra["train_args"] = {**train_args, **ctx.extra_vars.get("train_args", {})}
    model_dir = ctx.models / ctx.mode.sizes[goal.size]
    cmd = [ctx.playbook, "-i", str(ctx.inventory(nodes)), "train.yml"]
    # Every logical node is this machine: the generated weights are where the nodes read them
    # (shared storage), not copied into each node's models directory.
    cmd += ["-e", f"model={goal.model}", "-e", f"model_path={model_dir}", "-e", "model_shared=true"]
    cmd += ["-e", f"dataset_file={ctx.data}", "-e", "dataset_format=alpaca"]
    cmd += ["-e", f"finetuning_type={goal.finetuning}", "-e", f"detach={str(not steps).lower()}"]
    if deepspeed:
        cmd += ["-e", f"deepspeed={deepspeed}"]
    return [*cmd, "-e", json.dumps(extra)]


def product(
    ctx: Ctx,
    dest: Path,
    goal: Goal,
    *,
    nodes: int = 1,
    deepspeed: str | None = None,
    steps: int | None = None,
    box: Box,
    reserve: float = 0,
) -> dict[str, Any]:
    """Run train.yml; detached and stopped after the window, or watched to the end with `steps`.

    `reserve`: seconds to leave before the deadline (for the example that follows).
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = product_command(ctx, goal, nodes=nodes, deepspeed=deepspeed, steps=steps, box=box)
    (dest / "command.json").write_text(json.dumps(cmd, indent=1) + "\n")
    if ctx.dry:
        planned = dry.product(
            dest, cmd, cap=ctx.gpu_memory_gib, nodes=nodes, records=ctx.mode.samples
        )
        plan = read_json(dest / "plan.json")
        planned["rendered"] = rendered(read_yaml(dest / "train.yaml"), plan)
        return save(dest, {"model": goal.model, "nodes": nodes, **planned})
    before = set(ctx.runs_dir.iterdir()) if ctx.runs_dir.exists() else set()
    wait_gpu_idle(ctx)
    smi = SmiSampler(ctx)
    if ctx.mode.name == "gpu":
        smi.start()
    launched = time.monotonic()
    cap = max(30.0, min(box.cap, ctx.left() - 20 - reserve))
    result: dict[str, Any] = {"kind": "train.yml", "model": goal.model, "nodes": nodes}
    result["stage_asked"] = deepspeed or "auto"
    result["ansible_rc"] = run_logged(cmd, dest / "ansible.log", ctx, cap)
    result["ansible_s"] = round(time.monotonic() - launched, 1)
    new = []
    if ctx.runs_dir.exists():
        new = sorted(set(ctx.runs_dir.iterdir()) - before, key=lambda p: p.stat().st_mtime)
    if not new:
        result.update(ok=False, error=tail(dest / "ansible.log", 40), smi_peak_gib=smi.stop())
        return save(dest, result)
    run_dir = new[-1]
    result["run_id"] = run_dir.name
    first_seen = None
    if not steps and result["ansible_rc"] == 0:
        left = max(10.0, cap - result["ansible_s"])
        log = run_dir / "output" / "trainer_log.jsonl"
        reason, first_seen = follow(log, lambda: bool(processes_with(str(run_dir))), box, left)
        result["stopped_by"] = reason
    # A detached run after its window, or a watched one whose playbook ran out of time.
    stop_run(ctx, run_dir)
    result["smi_peak_gib"] = smi.stop()
    collect_run(run_dir, dest)
    return finish_product(dest, run_dir, result, box=box, launched=launched, first_seen=first_seen)


def finish_product(
    dest: Path,
    run_dir: Path,
    result: dict[str, Any],
    *,
    box: Box,
    launched: float,
    first_seen: float | None,
) -> dict[str, Any]:
    """Figures, rendered settings and the trace summary of a train.yml run."""
    records = analyse.read_log(dest / "trainer_log.jsonl")
    metrics = analyse.run_metrics(records, box.warmup)
    result.update(metrics)
    steps_logged = analyse.timed(records)
    if first_seen is not None and steps_logged:
        result["startup_s"] = round(first_seen - launched - analyse.clock(steps_logged[0]), 1)
    elif steps_logged:
        # A watched run: what the playbook spent outside training (start-up, save, fetch).
        trained = analyse.clock(steps_logged[-1])
        result["outside_training_s"] = round(result["ansible_s"] - trained, 1)
    result["rendered"] = rendered(read_yaml(dest / "train.yaml"), read_json(dest / "plan.json"))
    result["ok"] = "tokens_per_s" in metrics and result["ansible_rc"] == 0
    if not result["ok"]:
        result["error"] = tail(dest / "ansible.log", 30) + "\n---\n" + tail(dest / "node.log", 40)
        node_log = dest / "node.log"
        result["cause"] = analyse.root_cause(
            node_log.read_text(errors="replace") if node_log.exists() else ""
        )
    trace = summarise_trace(run_dir / "output" / "profiler", dest)
    if trace:
        result["trace"] = trace
    return save(dest, result)


def run_logged(cmd: list[str], log: Path, ctx: Ctx, timeout: float) -> int | str:
    """Run a command from the repository root into a log; end its whole session on timeout."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=run_env(ctx),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_session(proc)
            return "timeout"


def end_session(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the session a process leads (started with start_new_session), SIGKILL it after
    `grace` seconds if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_run(ctx: Ctx, run_dir: Path) -> None:
    """Stop a detached run the way playbooks/stop.yml does, then make sure nothing is left."""
    tool = Path("/usr/local/sbin/llama-job")  # cluster_job_bin
    if tool.exists():
        subprocess.run(
            [str(tool), "stop", f"--job={run_dir.name}", "--timeout=20"],
            capture_output=True,
            check=False,
        )
    left = processes_with(str(run_dir))
    if left:
        say(f"{len(left)} processes of {run_dir.name} outlived the supervisor's stop; ending them")
        stop_pids(left)


PRECISION_LINE = re.compile(r"fp8|float8|compute dtype|mixed.precision", re.IGNORECASE)


def collect_run(run_dir: Path, dest: Path) -> None:
    """Keep what train.yml rendered and what the run logged."""
    for name in ("train.yaml", "plan.json", "ds_config.json", "fsdp_config.json"):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, dest / name)
    for name in ("trainer_log.jsonl", "all_results.json"):
        if (run_dir / "output" / name).exists():
            shutil.copy2(run_dir / "output" / name, dest / name)
    logs = sorted((run_dir / "logs").glob("*.log"))
    if logs:
        (dest / "node.log").write_text("\n".join(tail(p, 300) for p in logs) + "\n")
        # What the tail loses: the start-up lines that say which precision the run trained in.
        said = [
            line
            for log in logs
            for line in log.read_text(errors="replace").splitlines()
            if PRECISION_LINE.search(line)
        ]
        (dest / "precision.log").write_text("\n".join(said[:50]) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict ({} if missing)."""
    return json.loads(path.read_text()) if path.exists() else {}


def save(dest: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write result.json beside the run's files."""
    (dest / "result.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def sample_tokens(ctx: Ctx, size: str, cutoff: int) -> list[int]:
    """Tokens of every sample of the call's data for the model of `size` (the dry run: the
    data's mean, with no model to tokenise with)."""
    if ctx.dry:
        return [min(cutoff, dry.SAMPLE_TOKENS)] * ctx.mode.samples
    return sample_lengths(ctx.models / ctx.mode.sizes[size], ctx.data, cutoff)


def sample_lengths(model_dir: Path, data: Path, cutoff: int) -> list[int]:
    """Tokens of each sample as LLaMA-Factory's qwen template renders it, cut at `cutoff`.

    Prompt: the template's default system turn and the user turn (instruction, newline, input);
    response: the output and <|im_end|>; each part tokenised on its own, as the template does.
    """
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(model_dir)
    system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    records = json.loads(data.read_text())
    prompts = [
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
        + "\n".join(x for x in (r["instruction"], r["input"]) if x)
        + "<|im_end|>\n<|im_start|>assistant\n"
        for r in records
    ]
    answers = [f"{r['output']}<|im_end|>\n" for r in records]
    p = tok(prompts, add_special_tokens=False)["input_ids"]
    a = tok(answers, add_special_tokens=False)["input_ids"]
    return [min(cutoff, len(x) + len(y)) for x, y in zip(p, a, strict=True)]


def example(
    ctx: Ctx,
    dest: Path,
    goal: Goal,
    accumulation: int,
    box: Box,
    *,
    cutoff: int = 2048,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """LLaMA-Factory's example config for this model, launched by hand, stopped after the window.

    `settings`: options of LLaMA-Factory's own set over the example's (a hand-tuned variant).
    """
    dest.mkdir(parents=True, exist_ok=True)
    output = ctx.work / "hand" / dest.parent.name / "output"
    shutil.rmtree(output, ignore_errors=True)
    cfg: dict[str, Any] = {
        "model_name_or_path": str(ctx.models / ctx.mode.sizes[goal.size]),
        **EXAMPLES[goal.finetuning],
        "template": "qwen",
        "dataset": "synth_alpaca",
        "dataset_dir": str(ctx.data_dir),
        "output_dir": str(output),
        "cutoff_len": cutoff,
        "gradient_accumulation_steps": accumulation,
        **ctx.mode.extra_example,
        **(settings or {}),
        **MEASURE,
    }
    if box.profile_step:
        cfg.update(profiler_args(box.profile_step))
    import yaml  # noqa: PLC0415

    cfg_path = dest / "example.yaml"
    cfg_path.write_text(
        "# LLaMA-Factory v0.9.5 examples/train_"
        + ("full/qwen3_full_sft.yaml" if goal.finetuning == "full" else "lora/qwen3_lora_sft.yaml")
        + " for this model and data; gradient_accumulation_steps matched to train.yml's tokens per"
        " step; measuring settings as in bench/gpu/harness.py MEASURE\n"
        + yaml.safe_dump(cfg, sort_keys=False)
    )
    if ctx.dry:
        rendered_keys = {k: cfg[k] for k in PROFILE_KEYS if k in cfg}
        return save(dest, {**dry.example(cfg), "model": goal.model, "rendered": rendered_keys})
    env = run_env(ctx)
    port = ctx.next_port()
    env.update(
        {
            "FORCE_TORCHRUN": "1",
            "NNODES": "1",
            "NODE_RANK": "0",
            "NPROC_PER_NODE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if ctx.mode.name == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = "0"
    cmd = [str(ctx.env_bin / "llamafactory-cli"), "train", str(cfg_path)]
    (dest / "command.json").write_text(
        json.dumps(
            {
                "env": {
                    k: env[k]
                    for k in (
                        "FORCE_TORCHRUN",
                        "NNODES",
                        "NODE_RANK",
                        "NPROC_PER_NODE",
                        "MASTER_ADDR",
                        "MASTER_PORT",
                    )
                },
                "cmd": cmd,
            },
            indent=1,
        )
        + "\n"
    )
    wait_gpu_idle(ctx)
    smi = SmiSampler(ctx)
    if ctx.mode.name == "gpu":
        smi.start()
    launched = time.monotonic()
    cap = max(30.0, min(box.cap, ctx.left() - 15))
    with (dest / "node.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ctx.work
        )
        reason, first_seen = follow(
            output / "trainer_log.jsonl", lambda: proc.poll() is None, box, cap
        )
        if proc.poll() is None:
            end_session(proc)
    result: dict[str, Any] = {
        "kind": "example by hand",
        "model": goal.model,
        "accumulation": accumulation,
        "settings": settings or {},
        "rendered": {k: cfg[k] for k in PROFILE_KEYS if k in cfg},
        "stopped_by": reason,
        "rc": proc.returncode,
        "smi_peak_gib": smi.stop(),
    }
    if (output / "trainer_log.jsonl").exists():
        shutil.copy2(output / "trainer_log.jsonl", dest / "trainer_log.jsonl")
    records = analyse.read_log(output / "trainer_log.jsonl")
    result.update(analyse.run_metrics(records, box.warmup))
    steps = analyse.timed(records)
    if first_seen is not None and steps:
        result["startup_s"] = round(first_seen - launched - analyse.clock(steps[0]), 1)
    result["ok"] = "tokens_per_s" in result
    if not result["ok"]:
        result["error"] = tail(dest / "node.log", 40)
        result["cause"] = analyse.root_cause((dest / "node.log").read_text(errors="replace"))
    trace = summarise_trace(output / "profiler", dest)
    if trace:
        result["trace"] = trace
    return save(dest, result)


def model_meta(ctx: Ctx, size: str) -> dict[str, Any]:
    """bench_model.json of a generated model."""
    return read_json(ctx.models / ctx.mode.sizes[size] / "bench_model.json")


def add_mfu(ctx: Ctx, result: dict[str, Any], goal: Goal, context: float, gpus: int) -> None:
    """MFU of a run, without and with attention scores, against 989 and the measured peak."""
    meta = model_meta(ctx, goal.size)
    tps = result.get("tokens_per_s")
    if not meta or not tps:
        return
    rank = int(result.get("rendered", {}).get("lora_rank", 8) or 8)
    flops = analyse.flops_per_token(meta, goal.finetuning, rank)
    attn = analyse.attention_flops(meta, context)
    measured = read_json(ctx.results / "setup" / "matmul.json").get("tflops_median")
    result["flops"] = {**flops, "attention_per_token": attn, "mean_context": round(context, 1)}
    result["mfu"] = round(analyse.mfu(flops["flops"], tps, gpus), 4)
    result["mfu_with_attention"] = round(analyse.mfu(flops["flops"] + attn, tps, gpus), 4)
    if measured:
        result["mfu_vs_measured"] = round(
            analyse.mfu(flops["flops"], tps, gpus, measured * 1e12), 4
        )


def context(result: dict[str, Any], cutoff: int, lengths: list[int]) -> float:
    """Mean keys per query of a run: a packed row is cutoff_len + 1 tokens (LLaMA-Factory pads it
    so), causal over the whole row; unpacked samples attend within themselves."""
    if (result.get("rendered") or {}).get("packing"):
        return (cutoff + 2) / 2
    return analyse.mean_context_unpacked(lengths)


def real_tokens(
    result: dict[str, Any], dest: Path, lengths: list[int], config: str = "train.yaml"
) -> None:
    """Take the filler of packed rows out of a run's token counts.

    include_num_input_tokens_seen: non_padding sums the attention mask, and LLaMA-Factory's
    packing (without neat_packing) gives the filler that pads a row to cutoff_len a mask of 1, so
    the log counts it as input. The real tokens of an optimizer step are the data's tokens per
    epoch over the steps per epoch (trainer_log's total_steps / num_train_epochs); tokens/s is
    scaled by real / logged tokens per step. Unpacked runs count real tokens already.
    """
    cfg = read_yaml(dest / config)
    if not result.get("tokens_per_step") or not cfg.get("packing") or cfg.get("max_steps"):
        return
    total = max(
        (r.get("total_steps", 0) for r in analyse.read_log(dest / "trainer_log.jsonl")), default=0
    )
    epochs = float(cfg.get("num_train_epochs") or 3.0)
    if not total:
        return
    per_step = sum(lengths) / (total / epochs)
    fill = per_step / result["tokens_per_step"]
    result["logged_tokens_per_s"] = result["tokens_per_s"]
    result["logged_tokens_per_step"] = result["tokens_per_step"]
    result["filler_fraction"] = round(1 - fill, 4)
    result["tokens_per_s"] = round(result["tokens_per_s"] * fill, 1)
    result["tokens_per_step"] = round(per_step, 1)


def goal_phase(ctx: Ctx, key: str) -> dict[str, Any]:
    """One goal: train.yml first (its tokens per step), then the example at the same tokens."""
    goal = GOALS[key]
    dest = ctx.results / f"goal-{key}"
    say(f"goal {key}: train.yml {goal.model} ({goal.finetuning})")
    prod = product(ctx, dest / "train_yml", goal, box=ctx.mode.product, reserve=EXAMPLE_RESERVE)
    say(f"goal {key}: train.yml -> {short(prod)}")
    cutoff = int(prod.get("rendered", {}).get("cutoff_len") or 2048)
    lengths = sample_tokens(ctx, goal.size, cutoff)
    mean_len = sum(lengths) / len(lengths)
    real_tokens(prod, dest / "train_yml", lengths)
    default = EXAMPLES[goal.finetuning]["gradient_accumulation_steps"]
    tokens = prod.get("tokens_per_step")
    accumulation = max(1, round(tokens / mean_len)) if tokens else default
    say(
        f"goal {key}: example, accumulation {accumulation}"
        f" ({tokens} tokens/step, {mean_len:.0f} per sample)"
    )
    ex = example(ctx, dest / "example", goal, accumulation, ctx.mode.example, cutoff=cutoff)
    say(f"goal {key}: example -> {short(ex)}")
    add_mfu(ctx, prod, goal, context(prod, cutoff, lengths), 1)
    add_mfu(ctx, ex, goal, analyse.mean_context_unpacked(lengths), 1)
    save(dest / "train_yml", prod)
    save(dest / "example", ex)
    summary: dict[str, Any] = {
        "goal": key,
        "model": goal.model,
        "finetuning": goal.finetuning,
        "target_ratio": goal.ratio,
        "target_mfu": goal.mfu,
        "mean_sample_tokens": round(mean_len, 1),
        "example_accumulation": accumulation,
    }
    if prod.get("tokens_per_s") and ex.get("tokens_per_s"):
        ratio = prod["tokens_per_s"] / ex["tokens_per_s"]
        summary["ratio"] = round(ratio, 2)
        summary["tokens_per_step_ratio"] = round(prod["tokens_per_step"] / ex["tokens_per_step"], 3)
        summary["loss"] = analyse.compare_losses(prod["losses"], ex["losses"], 6)
        summary["ratio_met"] = ratio >= goal.ratio
        if goal.mfu is not None:
            summary["mfu_met"] = prod.get("mfu", 0) >= goal.mfu
    return save(dest, summary)


def shard_phase(ctx: Ctx, stage: str) -> dict[str, Any]:
    """The 0.5B model through train.yml with one sharding mode, a short run to its end."""
    say(f"shard {stage}: train.yml -e deepspeed={stage}, {ctx.mode.shard_steps} steps")
    dest = ctx.results / f"shard-{stage}"
    box = Box(
        warmup=max(2, ctx.mode.shard_steps // 3), min_steps=1, seconds=0, cap=ctx.mode.shard_cap
    )
    res = product(ctx, dest, GOALS["0.5b"], deepspeed=stage, steps=ctx.mode.shard_steps, box=box)
    say(f"shard {stage}: -> {short(res)}")
    return res


def scale_phase(ctx: Ctx) -> dict[str, Any] | None:
    """The 1.5B product on every GPU, one logical node each (needs two GPUs or more)."""
    if ctx.nodes < 2:
        say(f"scale: {ctx.nodes} GPU(s) here, nothing to scale")
        return None
    say(f"scale: train.yml 1.5B on {ctx.nodes} logical nodes")
    goal = GOALS["1.5b"]
    res = product(ctx, ctx.results / "scale-1.5b", goal, nodes=ctx.nodes, box=ctx.mode.product)
    cutoff = int(res.get("rendered", {}).get("cutoff_len") or 2048)
    lengths = sample_tokens(ctx, goal.size, cutoff)
    real_tokens(res, ctx.results / "scale-1.5b", lengths)
    add_mfu(ctx, res, goal, context(res, cutoff, lengths), ctx.nodes)
    return save(ctx.results / "scale-1.5b", res)


def short(result: dict[str, Any]) -> str:
    """One line about a run."""
    if not result.get("ok"):
        cause = result.get("cause") or " | ".join(str(result.get("error", "")).splitlines()[-3:])
        return f"FAILED: {cause}"
    return (
        f"{result['tokens_per_s']:,.0f} tokens/s, {result['tokens_per_step']:,.0f} tokens/step, "
        f"step {result['step_s']} s, peak {result.get('peak_alloc_gib')} GiB, "
        f"stopped by {result.get('stopped_by', 'its end')}"
    )


def phase_sizes(ctx: Ctx, phase: str) -> set[str]:
    """The model shapes a phase trains (and the CPU Adam op, for the offload run)."""
    if phase.startswith(("goal-", "scale-")):
        return {ctx.mode.sizes[phase.split("-", 1)[1]]}
    if phase == "shard-zero3_offload":
        return {ctx.mode.sizes["0.5b"], "cpu_adam"}
    if phase.startswith("shard-"):
        return {ctx.mode.sizes["0.5b"]}
    return set()


def start_models(ctx: Ctx, sizes: set[str]) -> None:
    """Generate the models that are not there yet, in the background (ctx.pending); the dry run
    only checks that make_model.py has their shapes."""
    unknown = sizes - set(make_model.SHAPES) - {"cpu_adam"}
    if unknown:
        raise ValueError(f"no model shape {', '.join(sorted(unknown))} in bench/make_model.py")
    if ctx.dry:
        return
    for size in sorted(sizes - {"cpu_adam"}):
        if (ctx.models / size / "bench_model.json").exists() or size in ctx.pending:
            continue
        cmd = [ctx.python, str(ROOT / "bench" / "make_model.py"), "--size", size]
        cmd += ["--out", str(ctx.models / size)]
        cmd += ["--device", "cuda" if ctx.mode.name == "gpu" else "cpu"]
        if ctx.mode.name == "cpu":
            # fp32 weights: bf16 matrix products are very slow on CPUs without bf16 units.
            cmd += ["--vocab", "16384", "--dtype", "float32"]
        (ctx.results / "setup").mkdir(parents=True, exist_ok=True)
        log = (ctx.results / "setup" / f"make_model_{size}.log").open("w")
        ctx.pending[size] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=run_env(ctx)
        )


def ensure_models(ctx: Ctx, sizes: set[str]) -> None:
    """Wait for the background generation of these models."""
    for size in sorted(sizes):
        proc = ctx.pending.pop(size, None)
        if proc is None:
            continue
        started = time.monotonic()
        rc = proc.wait()
        name = "cpu_adam.log" if size == "cpu_adam" else f"make_model_{size}.log"
        log = tail(ctx.results / "setup" / name, 3).replace("\n", " | ")
        say(f"{size}: rc {rc} (waited {time.monotonic() - started:.0f} s): {log[-300:]}")


def setup_phase(ctx: Ctx, phases: list[str]) -> None:
    """Versions, GPUs, matmul peak, node facts; models (in the background) and data.

    The matmul rate is measured before anything else uses the GPU. Models are generated while the
    facts playbook runs; the setup waits only for those the next phase trains, the others (the
    7B one, ~15 GB to write) finish while that phase starts up.
    """
    dest = ctx.results / "setup"
    dest.mkdir(parents=True, exist_ok=True)
    if ctx.dry:  # what setup runs (versions, facts playbook, models, data) is the CPU dry run's
        say("setup: nothing to plan (the CPU dry run, PROFILE_MODE=cpu, runs it)")
        return
    env = run_env(ctx)
    versions = subprocess.run(
        [ctx.python, "-c", VERSIONS], capture_output=True, text=True, check=False, env=env
    )
    (dest / "versions.txt").write_text(versions.stdout + "\n" + versions.stderr[-2000:])
    say("versions: " + (versions.stdout.strip().splitlines() or ["?"])[-1])
    if ctx.mode.name == "gpu":
        query = "--query-gpu=index,name,memory.total,driver_version,clocks.max.sm"
        gpus = subprocess.run(
            ["nvidia-smi", query, "--format=csv"], capture_output=True, text=True, check=False
        )
        (dest / "gpus.csv").write_text(gpus.stdout)
        say("gpus: " + " / ".join(gpus.stdout.strip().splitlines()[1:]))
        matmul = [ctx.python, str(ROOT / "bench" / "matmul_peak.py"), str(dest / "matmul.json")]
        subprocess.run(matmul, capture_output=True, check=False)
        say(f"bf16 matmul: {read_json(dest / 'matmul.json').get('tflops_median', 0):.0f} TFLOP/s")
    later = [p for p in phases if p != "setup"]
    start_models(ctx, set().union(*(phase_sizes(ctx, p) for p in later)) if later else set())
    if not ctx.data.exists():
        data = [ctx.python, "-c", DATA, str(ROOT / "bench"), str(ctx.data_dir)]
        subprocess.run([*data, str(ctx.mode.samples)], check=True)
    # train.yml compares what every node recorded (llama_host, llama_stack) before it starts: the
    # llamafactory role records the image's stack (llamafactory_install: false installs nothing);
    # job_supervisor installs llama-job, which every launch goes through.
    tags = "host_facts,llamafactory,job_supervisor"
    cmd = [ctx.playbook, "-i", str(ctx.inventory(1)), "provision.yml", "--tags", tags]
    rc = run_logged(cmd, dest / "facts.log", ctx, 180)
    say(f"node facts (provision.yml --tags {tags}): rc {rc}")
    # Every role records its facts in /etc/ansible/facts.d, where train.yml's gathering reads them
    # (the dry run too: it writes llama_host and llama_stack on this machine).
    facts = Path("/etc/ansible/facts.d")
    with contextlib.suppress(OSError):
        shutil.copy2(facts / "llama_host.fact", dest / "llama_host.json")
    if "shard-zero3_offload" in later:
        start_cpu_adam(ctx)
    if later:
        ensure_models(ctx, phase_sizes(ctx, later[0]))


# DeepSpeed's CPU Adam, which accelerate puts in place of torch's AdamW under ZeRO offload: with
# DS_BUILD_OPS=0 it compiles on first use (g++, ninja, Python.h). Built once in the background, so
# that the offload run finds it in ~/.cache/torch_extensions, and so that a toolchain problem shows.
CPU_ADAM = (
    "import shutil, sysconfig, time; from pathlib import Path\n"
    "inc = Path(sysconfig.get_paths()['include']) / 'Python.h'\n"
    "print('g++', shutil.which('g++'), '| ninja', shutil.which('ninja'), '| nvcc',"
    " shutil.which('nvcc'), '|', inc, inc.exists(), flush=True)\n"
    "t = time.time(); from deepspeed.ops.op_builder import CPUAdamBuilder\n"
    "CPUAdamBuilder().load()\n"
    "print(f'cpu_adam built/loaded in {time.time() - t:.0f} s')\n"
)


def start_cpu_adam(ctx: Ctx) -> None:
    """Build DeepSpeed's CPU Adam op in the background (see CPU_ADAM)."""
    log = (ctx.results / "setup" / "cpu_adam.log").open("w")
    # The environment the launcher gives a rank (roles/job/templates/job.env.j2): the build flags,
    # and with them torch's cache key, must be the same, or the run builds the op again.
    env = {**RUN_ENV, "HOME": os.environ.get("HOME", "/root"), "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{ctx.env_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    ctx.pending["cpu_adam"] = subprocess.Popen(
        [ctx.python, "-c", CPU_ADAM], stdout=log, stderr=subprocess.STDOUT, env=env
    )


VERSIONS = (
    "import platform, torch, transformers, llamafactory, peft, accelerate, datasets, tokenizers\n"
    "parts = [f'python {platform.python_version()}', f'torch {torch.__version__}',"
    " f'cuda {torch.version.cuda}', f'transformers {transformers.__version__}',"
    " f'llamafactory {llamafactory.__version__}', f'peft {peft.__version__}',"
    " f'accelerate {accelerate.__version__}', f'datasets {datasets.__version__}',"
    " f'tokenizers {tokenizers.__version__}']\n"
    "try:\n    import deepspeed; parts.append(f'deepspeed {deepspeed.__version__}')\n"
    "except Exception as err:\n    parts.append(f'deepspeed: {err}')\n"
    "print(', '.join(parts))\n"
)
DATA = (
    "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import make_model\n"
    "make_model.write_dataset(Path(sys.argv[2]), int(sys.argv[3]))\n"
)


def pack(ctx: Ctx) -> None:
    """Write the report and the tarball under --out (after every phase: partial results come back).

    The device tool brings back files of 16 MiB at most: raw traces are left out when they would
    make the tarball larger than 15 MiB.
    """
    import report  # noqa: PLC0415  (beside this file)

    report.write(ctx.results, ctx.out, ctx.mode.name)
    if ctx.dry:  # nothing to bring back
        return
    tarball = ctx.out / "profile.tar.gz"
    for with_traces in (True, False):
        with tarfile.open(tarball, "w:gz") as tar:
            tar.add(
                ctx.results,
                arcname="results",
                filter=lambda info, keep=with_traces: (
                    info if keep or not info.name.endswith("trace.json.gz") else None
                ),
            )
            for name in ("summary.md", "results.json", "loss.png"):
                if (ctx.out / name).exists():
                    tar.add(ctx.out / name, arcname=name)
        if tarball.stat().st_size <= 15 * 2**20:
            return


def run(args: argparse.Namespace) -> int:
    """Run the phases in order, within the deadline."""
    phases = args.phases or ["setup", "goal-1.5b", "goal-0.5b"]
    known = ["setup", *(f"goal-{k}" for k in GOALS), *(f"shard-{s}" for s in STAGES), "scale-1.5b"]
    unknown = [p for p in phases if p not in known]
    if unknown:
        raise SystemExit(f"unknown phase {' '.join(unknown)}; the phases are: {' '.join(known)}")
    ctx = Ctx(args)
    # One timings file per call: results of two calls can be unpacked into one folder.
    timings_file = ctx.results / f"timings-{time.strftime('%Y%m%d-%H%M%S')}.json"
    timings: dict[str, float] = {}
    for phase in phases:
        estimate = ctx.mode.estimates["shard" if phase.startswith("shard-") else phase]
        if phase != "setup" and ctx.left() < estimate:
            say(f"skip {phase}: {ctx.left():.0f} s left, it takes about {estimate:.0f} s")
            timings[phase] = -1
            continue
        start = time.monotonic()
        try:
            start_models(ctx, phase_sizes(ctx, phase))
            ensure_models(ctx, phase_sizes(ctx, phase))
            if phase == "setup":
                setup_phase(ctx, phases)
            elif phase.startswith("goal-"):
                goal_phase(ctx, phase.split("-", 1)[1])
            elif phase.startswith("shard-"):
                shard_phase(ctx, phase.split("-", 1)[1])
            elif phase == "scale-1.5b":
                scale_phase(ctx)
            else:
                say(f"unknown phase {phase}")
        except Exception as err:  # one phase's failure must not lose the others
            say(f"{phase} failed: {err!r}")
            (ctx.results / f"{phase}.error.txt").write_text(repr(err) + "\n")
        timings[phase] = round(time.monotonic() - start, 1)
        timings_file.write_text(json.dumps(timings, indent=1) + "\n")
        say(f"{phase}: {timings[phase]} s (call at {time.monotonic() - ctx.start:.0f} s)")
        pack(ctx)
    import report  # noqa: PLC0415

    print(report.brief(ctx.results))
    skipped = [p for p, t in timings.items() if t == -1]
    say("done" + (f"; skipped for time, for the next call: {' '.join(skipped)}" if skipped else ""))
    return 0


def main() -> int:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run phases")
    r.add_argument("--mode", choices=sorted(MODES), default="gpu")
    r.add_argument("--playbook", required=True, help="the ansible-playbook to run train.yml with")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--work", type=Path, default=Path("/tmp/profile-work"))
    r.add_argument("--base-dir", default="/opt/llama-cluster", help="cluster_base_dir of the nodes")
    r.add_argument("--env-bin", help="bin/ of the training environment (default: this Python's)")
    r.add_argument("--deadline-s", type=float, default=500)
    r.add_argument(
        "--gpu-memory-gib", type=float, help="set gpu_memory_gib (the planning knob) on the nodes"
    )
    r.add_argument("--nodes", type=int, help="logical nodes of scale-1.5b (default: the GPUs)")
    r.add_argument("--dry", action="store_true", help="plan and check each launch (dry.py)")
    r.add_argument("--product-extra", help="JSON extra vars for every train.yml run")
    r.add_argument("phases", nargs="*")
    rep = sub.add_parser("report", help="rewrite summary.md/results.json/loss.png from results/")
    rep.add_argument("--out", type=Path, required=True)
    rep.add_argument("--mode", default="gpu")
    args = parser.parse_args()
    if args.cmd == "report":
        import report  # noqa: PLC0415

        report.write(args.out / "results", args.out, args.mode)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
