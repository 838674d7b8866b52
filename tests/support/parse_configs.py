"""Parse rendered run directories with the training stack's own parsers; print JSON verdicts.

Runs inside the training venv (LLAMA_CLUSTER_TRAIN_PYTHON), as one process for many run
directories: LLaMA-Factory's get_train_args for train.yaml (with the DeepSpeed or FSDP file it
names), DeepSpeed's DeepSpeedConfig for ds_config.json after transformers filled its "auto"
values, and accelerate's config loader for accelerate.yaml. GPU-only settings cannot be checked
on a CPU, so the parser is told `use_cpu: true`; everything else is parsed as rendered.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import yaml
from accelerate.commands.config.config_args import load_config_from_file
from deepspeed.runtime.config import DeepSpeedConfig
from llamafactory.hparams import get_train_args


def _error() -> str:
    lines = traceback.format_exc().strip().splitlines()
    return lines[-1] if lines else "unknown error"


def check(run_dir: Path) -> dict[str, str]:
    """Verdicts for one run directory: 'ok' or the parser's error, per file."""
    verdict: dict[str, str] = {}
    args = yaml.safe_load((run_dir / "train.yaml").read_text())
    args["use_cpu"] = True
    try:
        _, _, training, finetuning, _ = get_train_args(args)
        verdict["train.yaml"] = "ok"
        verdict["finetuning_type"] = finetuning.finetuning_type
        if training.deepspeed:
            ds = training.hf_deepspeed_config.config
            stage = DeepSpeedConfig(ds).zero_optimization_stage
            verdict["ds_config.json"] = f"ok stage {stage}"
        if training.fsdp:
            verdict["fsdp_config.json"] = "ok " + ",".join(
                str(o.value if hasattr(o, "value") else o) for o in training.fsdp
            )
    except Exception:
        verdict["train.yaml"] = _error()
    try:
        config = load_config_from_file(str(run_dir / "accelerate.yaml"))
        verdict["accelerate.yaml"] = f"ok {config.distributed_type}"
    except Exception:
        verdict["accelerate.yaml"] = _error()
    return verdict


def main() -> None:
    """Check every run directory given on the command line."""
    # DeepSpeed and FSDP need a process group: one process of a world of one, as torchrun sets.
    os.environ.update(
        {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ.setdefault("MASTER_PORT", "29599")
    results = {run: check(Path(run)) for run in sys.argv[1:]}
    print("VERDICTS " + json.dumps(results))


if __name__ == "__main__":
    main()
