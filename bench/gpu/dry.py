"""The dry run of bench/gpu's phases (issue 46): every phase of harness.py and baselines.py walks
its own code on the CPU, in seconds, up to each launch, so that a command left for the GPU
machine cannot fail there on something the CPU could have caught (a goal without a model shape,
a hand config with an argument LLaMA-Factory does not take, a plan the planner refuses, a run
the GPU machine's disk refuses).

At each launch, instead of training:
- train.yml (`product`): its command's extra vars are planned by the planner itself, as
  scripts/what-fits.py plans a card (group_vars/all's settings), for one GPU of each card the
  device tool lends (an H100 and an H200, or the phase's memory cap), with the GPU machine's
  host memory, stack and free disk; a refusal, or checkpoints the disk cannot hold, fail the
  phase with the planner's own message. The result carries the plan's settings and predicted
  tokens/s, so the phase's later steps (the hand configs sized from train.yml's tokens per
  step) run on real figures.
- a hand launch (`example`): the config harness.py wrote must hold only LLaMA-Factory 0.9.5's
  argument names (the planner's llamafactory_names.json).

    PROFILE_MODE=dry [BENCH=baselines] bash bench/gpu/profile.sh PHASE...   # any ready command
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "collections"))
GIB = 2**30
# The GPU machine as the device tool lends it (KINDS.md, BENCHMARKS.md section 7): one H100 (79.2
# GiB as nvidia-smi reports it) or one H200 (140.4), 16 cores, 128 GiB of memory, 46.9 GiB free
# where the runs directory is (/opt), the stack of bench/gpu/wheels.txt.
CARDS = {"H100": 79.2, "H200": 140.4}
HOST_MEMORY_GIB = 120.0
DISK_FREE_GIB = 46.9
STACK = {"bitsandbytes": "0.50.2", "liger-kernel": "0.8.5"}
# What run_plan takes from train.yml's extra vars into the planner's request (action/run_plan.py
# _request); the others (detach, dataset_file, model_path, ...) are for the playbook.
REQUEST_KEYS = (
    "model",
    "finetuning_type",
    "lora_target",
    "cutoff_len",
    "train_args",
    "max_restarts",
    "allow_slow_scaling",
    "fp8",
    "quantization_bit",
    "deepspeed",
    "numerics",
    "tokens_per_step",
)
# A sample's tokens with the qwen template (bench/README.md: 391 on average for make_model.py's
# data): what the dry run sizes hand configs with instead of tokenising a model it did not make.
SAMPLE_TOKENS = 391


@functools.cache
def _what_fits() -> ModuleType:
    """scripts/what-fits.py: the planner's settings, request and node as train.yml builds them."""
    spec = importlib.util.spec_from_file_location("what_fits", ROOT / "scripts" / "what-fits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extra_vars(cmd: list[str]) -> dict[str, Any]:
    """The -e values of an ansible-playbook command line ('k=v' or JSON), later ones winning."""
    extra: dict[str, Any] = {}
    for flag, value in itertools.pairwise(cmd):
        if flag != "-e":
            continue
        if value.startswith("{"):
            extra.update(json.loads(value))
        else:
            key, _, text = value.partition("=")
            extra[key] = {"true": True, "false": False}.get(text, text)
    return extra


def plan_for(extra: dict[str, Any], gib: float, nodes: int, records: int) -> dict[str, Any]:
    """The planner's plan of train.yml's extra vars on `nodes` GPUs of `gib` each (PlanError
    when it refuses), and its checkpoints checked against the machine's free disk."""
    fits = _what_fits()
    from ansible_collections.llama.cluster.plugins.module_utils.planner.disk import (  # noqa: PLC0415
        disk_budget,
    )
    from ansible_collections.llama.cluster.plugins.module_utils.planner.errors import (  # noqa: PLC0415
        PlanError,
    )

    asked = {k: extra[k] for k in REQUEST_KEYS if k in extra}
    asked["dataset_records"] = records
    hosts = [f"gpu{i}" for i in range(nodes)]
    described = [
        {
            **fits.node(float(extra.get("gpu_memory_gib") or gib)),
            "host": host,
            "rank": rank,
            "host_memory_gib": HOST_MEMORY_GIB,
            "compute_capability": 9.0,
            "torchao": "0.17.0",
            "packages": STACK,
        }
        for rank, host in enumerate(hosts)
    ]
    planned = fits.plan(
        fits.request(asked["model"], asked),
        nodes=described,
        ranks={h: i for i, h in enumerate(hosts)},
        datasets=[],
        settings={**fits.settings(), "shared_storage": True},
    )
    free = dict.fromkeys(hosts, DISK_FREE_GIB * GIB)
    disk = disk_budget(planned, free, "/opt/llama-cluster/runs")
    if not disk["ok"]:
        raise PlanError(f"the GPU machine's disk ({DISK_FREE_GIB} GiB free): {disk['message']}")
    return planned


def product(dest: Path, cmd: list[str], *, cap: float | None, nodes: int, records: int) -> dict:
    """A train.yml run of the dry run: its command planned for every card (or the cap)."""
    extra = extra_vars(cmd)
    cards = {f"{cap:g} GiB cap": cap} if cap else CARDS
    plans = {card: plan_for(extra, gib, nodes, records) for card, gib in cards.items()}
    planned = next(iter(plans.values()))
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "plan.json").write_text(json.dumps(planned, indent=1, default=str) + "\n")
    import yaml  # noqa: PLC0415  (PyYAML comes with the controller's and the training venv)

    (dest / "train.yaml").write_text(yaml.safe_dump(planned["train_args"], sort_keys=False))
    tokens = float(planned["tokens_per_optimizer_step"])
    speed = float(planned["performance"].get("tokens_per_s") or tokens)
    return {
        "kind": "train.yml (dry run)",
        "ok": True,
        "dry": True,
        "plans": {card: p["summary"] for card, p in plans.items()},
        "tokens_per_s": round(speed, 1),
        "tokens_per_step": tokens,
        "step_s": round(tokens / speed, 3),
        "losses": [],
    }


def example(cfg: dict[str, Any]) -> dict[str, Any]:
    """A hand launch of the dry run: its config's names checked against LLaMA-Factory's."""
    from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import (  # noqa: PLC0415
        llamafactory_names,
    )

    names = llamafactory_names()
    unknown = sorted(set(cfg) - names["train_args"])
    if unknown:
        raise ValueError(f"not arguments of LLaMA-Factory {names['version']}: {', '.join(unknown)}")
    tokens = float(cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"])
    return {
        "kind": "example by hand (dry run)",
        "ok": True,
        "dry": True,
        "tokens_per_s": 1.0,
        "tokens_per_step": tokens * cfg["cutoff_len"],
        "step_s": tokens * cfg["cutoff_len"],
        "losses": [],
    }
