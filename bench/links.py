"""Step times over emulated links: LLaMA-Factory on the CPU lab against the cost model.

    python bench/links.py                      2 and 3 nodes, 1000 and 100 Mbit/s, four plans
    python bench/links.py --nodes 2 --rates 100 --plans none:1,zero3:1 --steps 6
    python bench/links.py --nodes 2 --nproc 2 --cpus 0.9 --prefix i39links \
        --plans none:1,none:8,zero2:1,zero3:1,zero3_hpz:1,hsdp:1     2 nodes x 2 ranks (issue 39)

Starts lab containers of its own (the node image; the training stack mounted read-only from
$LLAMA_CLUSTER_TRAIN_VENV, as molecule's train scenario does), each held to --cpus CPUs so that
one, two or three nodes on this machine compute at the same rate, and makes a Qwen2-shaped model
with scripts/make_tiny_model.py (--hidden wide: about 12 M parameters at 768, so that moving
gradients costs as much as computing them on a CPU). Then, for each link rate:

1. every node's egress on eth0 is limited with tc's token bucket (`tbf`; the lab's kernel has no
   netem, so no added latency), and check.yml's own all-reduce (roles/preflight/files/
   allreduce.py: gloo, 16 MiB) measures the link, the figure train.yml's planner reads;
2. every plan (`stage:accumulation`; stage none is DDP) trains --steps optimizer steps through
   LLaMA-Factory: bench/lf_entry.py under torchrun on every node, as `llamafactory-cli train`
   with FORCE_TORCHRUN=1 starts it, the DeepSpeed configuration rendered from the project's
   templates/deepspeed.json.j2; the step time is the mean after --warmup steps.

With --nproc N every node runs N ranks (torchrun's local ranks: they talk over the node's
loopback, which tc leaves alone), so that the hybrid plans shard inside a node and replicate
across nodes: zero3_hpz (ZeRO++ hpZ, DeepSpeed) and hsdp (FSDP's hybrid shard). On a CPU these
need what accelerate and DeepSpeed do on GPUs, done in the bench's entry only (ENTRY below).

The prediction is the planner's arithmetic with the compute part measured, since the cost
model's compute coefficients are fitted on H200s:

    predicted = the plan's step time on one node of N ranks (compute, optimizer, the engine's
                own work, and what the node's ranks exchange over its loopback)
              + planner/cost.py communication_seconds(traffic(shape, setup, nodes x N), link)

with setup.half false (the CPU trains in fp32) and setup.local_ranks N (what crosses nodes).
The plan with the best predicted tokens/s at a rate and node count is the one the planner's
search would choose: it is marked, and so is the fastest measured. Writes
bench/results/links.md (the table and its command) and links.json. A benchmark, not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "collections"))

from ansible_collections.llama.cluster.plugins.filter.run_config import fsdp_option  # noqa: E402
from ansible_collections.llama.cluster.plugins.module_utils.planner import cost  # noqa: E402
from ansible_collections.llama.cluster.plugins.module_utils.planner.measured_memory import (  # noqa: E402
    Shape,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (  # noqa: E402
    layer_class,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Stage  # noqa: E402

IMAGE = "llama-cluster-node:bookworm-2"
# Mounted read-only; the node's own python3 (the same minor version) imports from it.
VENV = os.environ.get("LLAMA_CLUSTER_TRAIN_VENV", "/var/cache/llama-cluster/venv-train")
SITE = f"{VENV}/lib/python3.11/site-packages"
MASTER_PORT = 29400
# Container and network names start with this (--prefix): two benches, or a bench beside someone
# else's, never share a name.
PREFIX = "links"


def sh(*argv: str, check: bool = True, timeout: float | None = None) -> str:
    """Run a command on this machine; its stdout."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    if check and done.returncode:
        raise SystemExit(f"{shlex.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def node(i: int) -> str:
    return f"{PREFIX}-node{i + 1}"


def set_prefix(prefix: str) -> None:
    """Name this bench's containers, network and logs after `prefix`."""
    global PREFIX  # noqa: PLW0603 - one bench per process
    PREFIX = prefix


def start_nodes(count: int, cpus: float, work: Path) -> None:
    """Start `count` containers on a network of their own; the venv and the work dir mounted."""
    stop_nodes()
    sh("docker", "network", "create", PREFIX)
    for i in range(count):
        out = work / "out" / node(i)
        out.mkdir(parents=True, exist_ok=True)
        sh(
            "docker", "run", "-d", "--name", node(i), "--hostname", node(i),
            "--network", PREFIX, "--cap-add", "NET_ADMIN", f"--cpus={cpus}",
            "-v", f"{VENV}:{VENV}:ro", "-v", f"{work}:/work:ro", "-v", f"{out}:/out",
            IMAGE, "sleep", "infinity",
        )  # fmt: skip


def stop_nodes() -> None:
    names = sh("docker", "ps", "-aq", "--filter", f"name=^{PREFIX}-node").split()
    if names:
        sh("docker", "rm", "-f", *names)
    sh("docker", "network", "rm", PREFIX, check=False)


def limit(nodes: int, mbit: int | None) -> None:
    """Each node's egress at `mbit` (None: unlimited): tbf, a burst of 10 ms at the rate."""
    for i in range(nodes):
        if mbit is None:
            sh("docker", "exec", node(i), "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            continue
        burst = max(16, mbit * 1000 // 8 // 100)  # kbyte
        sh(
            "docker", "exec", node(i), "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
            "rate", f"{mbit}mbit", "burst", f"{burst}kb", "latency", "50ms",
        )  # fmt: skip


def torchrun(
    nodes: int,
    script: str,
    args: list[str],
    env: dict[str, str],
    *,
    timeout: float,
    nproc: int = 1,
) -> None:
    """The script under torchrun on the first `nodes` nodes at once, `nproc` ranks each, as the
    launcher starts it."""
    procs = []
    for rank in range(nodes):
        exports = {
            "PYTHONPATH": SITE,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "GLOO_SOCKET_IFNAME": "eth0",
            **env,
        }
        argv = [
            "docker", "exec", *[f"--env={k}={v}" for k, v in exports.items()], node(rank),
            "python3", "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node_rank={rank}",
            f"--nproc_per_node={nproc}", f"--master_addr={node(0)}",
            f"--master_port={MASTER_PORT}", script, *args,
        ]  # fmt: skip
        log = open(f"/tmp/{PREFIX}-rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -9
        log.close()
        if code:
            failed.append(f"rank {rank} exited {code}: /tmp/{PREFIX}-rank{rank}.log")
    if failed:
        for i in range(nodes):  # leave no rank behind for the next run
            sh("docker", "exec", node(i), "pkill", "-f", "torchrun", check=False)
        raise SystemExit("\n".join(failed))


def measure_link(work: Path, nodes: int) -> dict[str, Any]:
    """check.yml's gloo all-reduce over the nodes (rank 0 writes its JSON line)."""
    torchrun(
        nodes,
        "/work/allreduce.py",
        ["--mib", "16", "--iterations", "5", "--warmup", "1", "--result", "/out/allreduce.json"],
        {},
        timeout=300,
    )
    return json.loads((work / "out" / node(0) / "allreduce.json").read_text())


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["bool"] = bool
    env.filters["to_nice_json"] = lambda v, indent=2, sort_keys=False: json.dumps(v, indent=indent)
    env.filters["to_json"] = json.dumps
    return env


def deepspeed_config(stage: str, nproc: int = 1) -> dict[str, Any]:
    """templates/deepspeed.json.j2 rendered for `stage` with roles/run_config's values (a node
    of `nproc` ranks: ZeRO++ hpZ's partition)."""
    defaults = yaml.safe_load((ROOT / "roles/run_config/defaults/main.yml").read_text())
    defaults["run_config_plan"] = {"nproc_per_node": nproc}
    data = yaml.safe_load((ROOT / "roles/run_config/vars/main.yml").read_text())
    env = _templates()

    def resolve(value: Any) -> Any:  # noqa: ANN401 - YAML data
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, str) and "{{" in value:
            return yaml.safe_load(env.from_string(value).render(**defaults))
        return value

    # The role's __run_config_ds_section: the ZeRO stage's section and what the stage adds.
    ds = Stage(stage)
    section = dict(data["__run_config_ds_zero"][ds.zero])
    for what in ("offload_optimizer", "offload_params", "hybrid"):
        if getattr(ds, what):
            section.update(data[f"__run_config_ds_{what}"])
    section = resolve(section)
    template = env.from_string((ROOT / "templates/deepspeed.json.j2").read_text())
    return json.loads(template.render(run_config_ds_zero=section))


def fsdp_config(layer_class: str) -> dict[str, Any]:
    """templates/fsdp_config.json.j2 as train.yml renders it, less what needs a GPU: FSDP's
    sync_module_states (and the RAM-efficient loading that relies on it) sets up on the
    accelerator's current device, which a CPU has none of (accelerate raises)."""
    template = _templates().from_string((ROOT / "templates/fsdp_config.json.j2").read_text())
    config = json.loads(template.render(run_config_layer_class=layer_class))
    return {**config, "sync_module_states": False, "cpu_ram_efficient_loading": False}


@dataclass
class Plan:
    stage: str
    accumulation: int

    @classmethod
    def parse(cls, text: str) -> Plan:
        stage, _, accumulation = text.partition(":")
        return cls(stage, int(accumulation or 1))

    @property
    def label(self) -> str:
        name = LABELS.get(self.stage) or self.stage.replace("zero", "ZeRO-")
        return f"{name}, accumulation {self.accumulation}"

    @property
    def fsdp(self) -> bool:
        return Stage(self.stage).fsdp


LABELS = {"none": "DDP", "zero3_hpz": "ZeRO++ hpZ", "hsdp": "HSDP"}


# DeepSpeed's CPU backend builds its shared-memory all-reduce (for ranks of one node) at start-up,
# which needs a compiler the node image lacks: the entry marks the op unavailable, and DeepSpeed
# all-reduces over gloo (a node's ranks over its loopback).
# On GPUs accelerate starts DeepSpeed's communication before the model loads; on a CPU it does
# not, and ZeRO-3's zero.Init would then size its batch for one rank: the entry starts it.
# FSDP (LINKS_FSDP): accelerate 1.11 enables FSDP for GPU-like devices only (its state.py: a
# CPU run stays MULTI_CPU), passes each rank's device as cpu:<local rank>, which FSDP refuses
# beside its compute device cpu, and FSDP's hybrid shard takes the node's group size from the
# accelerator's device count (torch.cpu.device_count() is 1): the entry makes the CPU run FSDP,
# passes the device as cpu, and counts a node's ranks as its devices.
ENTRY = """import functools
import os
import runpy
import deepspeed
import deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
if os.environ.get("LINKS_DEEPSPEED") == "1":
    deepspeed.init_distributed(dist_backend="gloo")
if os.environ.get("LINKS_FSDP") == "1":
    import torch
    import accelerate.state
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.cpu.device_count = lambda: int(os.environ["LOCAL_WORLD_SIZE"])
    state_init = accelerate.state.AcceleratorState.__init__

    @functools.wraps(state_init)
    def fsdp_on_cpu(self, *args, **kwargs):
        state_init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if self.distributed_type == DistributedType.MULTI_CPU and plugin is not None:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    accelerate.state.AcceleratorState.__init__ = fsdp_on_cpu
    fsdp_init = FullyShardedDataParallel.__init__

    @functools.wraps(fsdp_init)
    def cpu_device(self, *args, **kwargs):
        device = kwargs.get("device_id")
        if isinstance(device, torch.device) and device.type == "cpu":
            kwargs["device_id"] = torch.device("cpu")
        fsdp_init(self, *args, **kwargs)
        if not getattr(FullyShardedDataParallel, "said", False):
            FullyShardedDataParallel.said = True
            inter = getattr(self, "_inter_node_pg", None)
            print(f"FSDP {kwargs.get('sharding_strategy')}: shard over "
                  f"{self.process_group.size()} ranks, replicated over "
                  f"{inter.size() if inter is not None else 1}", flush=True)

    FullyShardedDataParallel.__init__ = cpu_device
runpy.run_path("/work/lf_entry.py", run_name="__main__")
"""


def train_config(plan: Plan, steps: int, cutoff: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_name_or_path": "/work/model",
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "links",
        "dataset_dir": "/work/data",
        "template": "qwen",
        "cutoff_len": cutoff,
        "packing": True,
        "overwrite_cache": True,
        "preprocessing_num_workers": 1,
        "output_dir": "/out/run",
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": plan.accumulation,
        "learning_rate": 1e-4,
        "max_steps": steps,
        "bf16": False,
        "use_cpu": True,
        "ddp_timeout": 600,
        "ddp_find_unused_parameters": False,
    }
    if plan.fsdp:  # as roles/run_config writes it (filter/run_config.py: fsdp_option)
        config["fsdp"] = fsdp_option(Stage(plan.stage))
        config["fsdp_config"] = "/work/fsdp.json"
    elif plan.stage != "none":
        config["deepspeed"] = f"/work/ds_{plan.stage}.json"
    return config


def train(
    work: Path,
    plan: Plan,
    nodes: int,
    *,
    steps: int,
    warmup: int,
    cutoff: int,
    nproc: int = 1,
) -> dict[str, Any]:
    """One run of the plan on the first `nodes` nodes of `nproc` ranks (its config in `work`);
    rank 0's timing window."""
    name = f"{plan.stage}-{plan.accumulation}.yaml"
    (work / name).write_text(yaml.safe_dump(train_config(plan, steps, cutoff)))
    result = work / "out" / node(0) / "bench" / "rank0.json"
    result.unlink(missing_ok=True)
    env = {
        "BENCH_OUT": "/out/bench",
        "BENCH_WARMUP_STEPS": str(warmup),
        "BENCH_SKIP_SAVE": "1",
        "LINKS_DEEPSPEED": "1" if Stage(plan.stage).zero is not None else "0",
        "LINKS_FSDP": "1" if plan.fsdp else "0",
        # The plan's environment, as train.yml sets it in every rank (planner/plan.py).
        **Stage(plan.stage).environment,
    }
    started = time.monotonic()
    torchrun(nodes, "/work/entry.py", [f"/work/{name}"], env, timeout=1800, nproc=nproc)
    rank0 = json.loads(result.read_text())
    return {
        "step_s": rank0["window_s"] / rank0["window_steps"],
        "window_steps": rank0["window_steps"],
        "tokens_per_step": rank0["window_slot_tokens"] / rank0["window_steps"],
        "wall_s": time.monotonic() - started,
        "loss": [h["loss"] for h in rank0["log_history"] if "loss" in h],
    }


def prepare(work: Path, hidden: int, lines: int, nproc: int = 1) -> Shape:
    """The model, an alpaca dataset of long answers, the DeepSpeed and FSDP configs (for nodes
    of `nproc` ranks), the scripts."""
    model = work / "model"
    if not (model / "tiny_model.json").is_file():
        sh(
            sys.executable,
            str(ROOT / "scripts/make_tiny_model.py"),
            str(model),
            "--hidden",
            str(hidden),
            "--vocab-size",
            "400",
        )
    summary = json.loads((model / "tiny_model.json").read_text())
    config = json.loads((model / "config.json").read_text())
    words = ["every", "rank", "waits", "for", "the", "slow", "link", "between", "two", "nodes"]
    rows = [
        {
            "instruction": f"question {i}",
            "input": "",
            "output": " ".join(words[(i + j) % len(words)] for j in range(200)),
        }
        for i in range(lines)
    ]
    data = work / "data"
    data.mkdir(exist_ok=True)
    (data / "links.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"links": {"file_name": "links.json"}}))
    (work / "entry.py").write_text(ENTRY)
    for stage in ("zero1", "zero2", "zero3", "zero3_hpz"):
        ds = deepspeed_config(stage, nproc)
        (work / f"ds_{stage}.json").write_text(json.dumps(ds, indent=2))
    (work / "fsdp.json").write_text(json.dumps(fsdp_config(layer_class(config)), indent=2))
    for script in (ROOT / "bench/lf_entry.py", ROOT / "roles/preflight/files/allreduce.py"):
        (work / script.name).write_text(script.read_text())
    return Shape.from_config(config, float(summary["parameters"]))


def communication(shape: Shape, row: dict[str, Any], cutoff: int) -> float:
    """The cost model's seconds of communication per step of a row's plan (fp32 over gloo, no
    latency: tbf adds none) over the link its all-reduce measured."""
    nproc = int(row.get("nproc", 1))
    setup = cost.Setup(
        "full", row["stage"], False, cutoff, row["accumulation"], half=False, local_ranks=nproc,
        gloo=True,
    )  # fmt: skip
    link = cost.Link.from_gbps(row["busbw_gbps"], 0.0, "allreduce.py, gloo")
    world = row["nodes"] * nproc
    moved = cost.traffic(shape, setup, world)
    return cost.communication_seconds(moved, link, world) or 0.0


def micro_batch_seconds(one: dict[str, dict[str, Any]]) -> float:
    """Seconds of one micro-batch's forward and backward on one node: the slope between the
    one-node DDP runs of different accumulation (0 without two of them)."""
    ddp = sorted((r["accumulation"], r["step_s"]) for r in one.values() if r["stage"] == "none")
    if len(ddp) < 2 or ddp[0][0] == ddp[-1][0]:
        return 0.0
    (a0, t0), (a1, t1) = ddp[0], ddp[-1]
    return (t1 - t0) / (a1 - a0)


def assess(rows: list[dict[str, Any]], one: dict[str, dict[str, Any]], shape: Shape,
           cutoff: int) -> None:  # fmt: skip
    """Each row's prediction and error; per node count and rate, the plan of the best predicted
    tokens/s (the planner's choice) and the fastest measured, over every plan and among the
    plans of the same tokens per step (what the planner's search compares: the user's batch).

    predicted = the plan's step on one node + its communication - under ZeRO, the share of the
    one-node step each rank now does for its 1/n partition: the step's work that is not per
    micro-batch (the optimizer over the fp32 weights, the engine's partition copies), which
    cost.py models as the optimizer term over the partition (HSDP's partition is a node's
    ranks, on one node as on several: no saving)."""
    micro = micro_batch_seconds(one)
    for row in rows:
        base = one[row["plan"]]["step_s"]
        per_step = max(0.0, base - row["accumulation"] * micro)
        whole = row["stage"] in ("none", "hsdp")
        shared = 0.0 if whole else per_step * (1 - 1 / row["nodes"])
        row["one_node_s"], row["partition_saving_s"] = base, shared
        row["communication_s"] = communication(shape, row, cutoff)
        row["predicted_s"] = base - shared + row["communication_s"]
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
    for suffix, key in (("", ()), ("_batch", ("tokens_per_step",))):
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for row in rows:
            groups.setdefault((row["nodes"], row["mbit"], *(row[k] for k in key)), []).append(row)
        for group in groups.values():
            best = max(group, key=lambda r: r["tokens_per_step"] / r["predicted_s"])
            fastest = max(group, key=lambda r: r["tokens_per_step"] / r["measured_s"])
            for row in group:
                row["chosen" + suffix], row["fastest" + suffix] = row is best, row is fastest


def measure_group(
    args: argparse.Namespace, plans: list[Plan], *, nodes: int, mbit: int
) -> list[dict[str, Any]]:
    """Every plan on `nodes` nodes over a link limited to `mbit`: the measured step times."""
    limit(args.max_nodes, mbit)
    measured = measure_link(args.work, nodes)
    group = []
    for plan in plans:
        run = train(
            args.work,
            plan,
            nodes,
            steps=args.steps,
            warmup=args.warmup,
            cutoff=args.cutoff,
            nproc=args.nproc,
        )
        row = {
            "nodes": nodes,
            "nproc": args.nproc,
            "mbit": mbit,
            "busbw_gbps": measured["busbw_gbps"],
            "plan": plan.label,
            "stage": plan.stage,
            "accumulation": plan.accumulation,
            "measured_s": run["step_s"],
            "tokens_per_step": plan.accumulation * args.cutoff * nodes * args.nproc,
            "loss": run["loss"],
        }
        print(json.dumps(row), flush=True)
        group.append(row)
    limit(args.max_nodes, None)
    return group


def table(rows: list[dict[str, Any]], command: str) -> str:
    """The Markdown table: per row the prediction's parts, the measurement and the marks."""

    def marks(row: dict[str, Any], suffix: str) -> str:
        names = [n for n in ("chosen", "fastest") if row[n + suffix]]
        return ", ".join(names)

    out = [
        "| nodes | link (set) | all-reduce | plan | one node s | communication s "
        "| partition saving s | predicted s/step | measured s/step | error | of all plans "
        "| of the same batch |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        shape = f"{r['nodes']} x {r['nproc']}" if r.get("nproc", 1) > 1 else f"{r['nodes']}"
        out.append(
            f"| {shape} | {r['mbit']} Mbit/s | {r['busbw_gbps'] * 1000:.0f} Mbit/s "
            f"| {r['plan']} | {r['one_node_s']:.2f} | {r['communication_s']:.2f} "
            f"| {r['partition_saving_s']:.2f} | {r['predicted_s']:.2f} "
            f"| {r['measured_s']:.2f} | {r['error']:+.0%} | {marks(r, '')} "
            f"| {marks(r, '_batch')} |"
        )
    errors = [abs(r["error"]) for r in rows]
    agree = all(
        r["chosen"] == r["fastest"] and r["chosen_batch"] == r["fastest_batch"] for r in rows
    )
    out += [
        "",
        f"Largest error {max(errors):.0%}, mean {sum(errors) / len(errors):.0%}; the chosen plan "
        + ("is" if agree else "is not always")
        + " the fastest measured.",
        "",
        f"    {command}",
    ]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2,3")
    parser.add_argument("--rates", default="1000,100", help="Mbit/s each node may send")
    parser.add_argument("--plans", default="none:1,none:8,zero2:1,zero3:1")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--cutoff", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cpus", type=float, default=0.6)
    parser.add_argument("--nproc", type=int, default=1, help="ranks on every node")
    parser.add_argument("--prefix", default=PREFIX, help="names of the containers and network")
    parser.add_argument("--work", type=Path, default=Path("/tmp/links-bench"))
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results")
    parser.add_argument("--keep", action="store_true", help="leave the containers running")
    parser.add_argument("--table-from", type=Path, help="recompute the table of a links.json")
    args = parser.parse_args()
    if args.table_from:
        report(json.loads(args.table_from.read_text()), args.results)
        return
    set_prefix(args.prefix)
    args.work.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.nodes.split(",")]
    rates = [int(r) for r in args.rates.split(",")]
    plans = [Plan.parse(p) for p in args.plans.split(",")]
    args.max_nodes = max(counts)
    shape = prepare(args.work, args.hidden, 400, args.nproc)
    start_nodes(args.max_nodes, args.cpus, args.work)
    rows: list[dict[str, Any]] = []
    try:
        one = {}
        for plan in plans:
            run = train(
                args.work,
                plan,
                1,
                steps=args.steps,
                warmup=args.warmup,
                cutoff=args.cutoff,
                nproc=args.nproc,
            )
            one[plan.label] = {"stage": plan.stage, "accumulation": plan.accumulation, **run}
            print(f"1 node, {plan.label}: {run['step_s']:.2f} s/step", flush=True)
        for nodes in counts:
            for mbit in rates:
                rows += measure_group(args, plans, nodes=nodes, mbit=mbit)
    finally:
        if not args.keep:
            stop_nodes()
    command = shlex.join(["python", "bench/links.py", *sys.argv[1:]])
    meta = {
        "shape": asdict(shape),
        "cutoff": args.cutoff,
        "cpus": args.cpus,
        "nproc": args.nproc,
        "command": command,
    }
    report({"rows": rows, "one_node": one, **meta}, args.results)


def report(results: dict[str, Any], directory: Path) -> None:
    """Predictions and marks for the measured rows; links.json and links.md in `directory`."""
    shape = Shape(**results["shape"])
    assess(results["rows"], results["one_node"], shape, results["cutoff"])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "links.json").write_text(json.dumps(results, indent=1))
    text = table(results["rows"], results["command"])
    (directory / "links.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
