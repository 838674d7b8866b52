"""Measure what one checkpoint of a technique takes on disk, for tests/data/checkpoint_sizes.json
(planner/disk.py's model is replayed against every entry by
tests/unit/planner/test_checkpoint_sizes.py).

    python bench/checkpoint_sizes.py --name NAME --model DIR --finetuning full|lora|freeze \\
        [--optim adamw_torch|adamw_8bit|...] [--quantization-bit 4] [--deepspeed CONFIG.json] \\
        [--nproc N] [--cpu] [--set key=value ...] --out results/checkpoint_sizes

Trains a few steps with LLaMA-Factory through the product's own launcher
(roles/run_config/files/llama_launcher.py, one node of N processes under torchrun), saves one
checkpoint, and prints one JSON entry for tests/data/checkpoint_sizes.json's `cpu_checkpoints`:
the model's parameter count and shape, the run's arguments, and the checkpoint's bytes by file
(and in all). The GPU machine's checkpoints (`checkpoints` there) come from
bench/gpu/memory_grid.py, which saves one checkpoint of each point it trains.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "roles/run_config/files/llama_launcher.py"
DATA = ROOT / "data/demo_alpaca.json"


def shape(model: Path) -> dict[str, int]:
    """The decoder's shape from config.json, as the planner reads it."""
    config = json.loads((model / "config.json").read_text())
    return {
        "hidden": int(config["hidden_size"]),
        "intermediate": int(config["intermediate_size"]),
        "layers": int(config["num_hidden_layers"]),
    }


def parameters(model: Path) -> int:
    """The model's parameters, counted from its safetensors headers."""
    total = 0
    for path in model.glob("*.safetensors"):
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


def train_args(args: argparse.Namespace, run: Path) -> dict[str, object]:
    """train.yaml for a few steps and one checkpoint."""
    data = run / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "demo.json").write_text(DATA.read_text())
    (data / "dataset_info.json").write_text(json.dumps({"demo": {"file_name": "demo.json"}}))
    config: dict[str, object] = {
        "model_name_or_path": str(args.model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": args.finetuning,
        "template": "qwen",
        "dataset": "demo",
        "dataset_dir": str(data),
        "cutoff_len": 64,
        "output_dir": str(run / "output"),
        "per_device_train_batch_size": 1,
        "max_steps": 2,
        "save_steps": 2,
        "save_on_each_node": True,
        "logging_steps": 1,
        "report_to": "none",
        "optim": args.optim,
        "ddp_timeout": 600,
        "dataloader_num_workers": 0,
    }
    if args.cpu:
        config.update(use_cpu=True, bf16=False)
    else:
        config["bf16"] = True
    if args.quantization_bit:
        config["quantization_bit"] = args.quantization_bit
    if args.deepspeed:
        config["deepspeed"] = str(args.deepspeed)
    for item in args.set:
        key, value = item.split("=", 1)
        config[key] = json.loads(value) if value[:1] in "[{0123456789tf" else value
    return config


def measure(checkpoint: Path) -> dict[str, int]:
    """Every file of the checkpoint (one directory down too), by relative path, in bytes."""
    return {
        str(path.relative_to(checkpoint)): path.stat().st_size
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file()
    }


def main() -> int:
    """Train, save one checkpoint, print its entry."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--finetuning", choices=("full", "lora", "freeze"), default="full")
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--quantization-bit", type=int, default=0)
    parser.add_argument("--deepspeed", type=Path)
    parser.add_argument("--stage", default="none", help="the planner's name of the stage")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="a train.yaml key=value")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/checkpoint_sizes")
    args = parser.parse_args()
    run = args.out / args.name
    run.mkdir(parents=True, exist_ok=True)
    config = train_args(args, run)
    (run / "train.yaml").write_text(json.dumps(config, indent=2))
    env = {
        **os.environ,
        "FORCE_TORCHRUN": "1",
        "NNODES": "1",
        "NODE_RANK": "0",
        "NPROC_PER_NODE": str(args.nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": os.environ.get("MASTER_PORT", "29741"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    with (run / "train.log").open("w") as log:
        subprocess.run(
            [sys.executable, str(LAUNCHER), str(run / "train.yaml")],
            env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
        )  # fmt: skip
    files = measure(run / "output" / "checkpoint-2")
    entry = {
        "name": args.name,
        "model": {"params": parameters(args.model), "shape": shape(args.model)},
        "finetuning_type": args.finetuning,
        "stage": args.stage,
        "nproc": args.nproc,
        "world": args.nproc,
        "args": {k: config[k] for k in ("optim", "bf16") if k in config}
        | ({"quantization_bit": args.quantization_bit} if args.quantization_bit else {})
        | ({"lora_rank": 8, "lora_target": "all"} if args.finetuning == "lora" else {}),
        "files": files,
        "checkpoint_bytes": sum(files.values()),
    }
    print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
