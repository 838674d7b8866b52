"""What the planner's tests share: the project's own data (the catalogue, training.yml's
defaults and rules), nodes as describe_nodes gives them, a request as run_plan passes it, and
the plan of a request (assembly.plan, the action's path without the model staged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from ansible_collections.llama.cluster.plugins.module_utils.planner.assembly import plan
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Plan

ROOT = Path(__file__).resolve().parents[2]


CATALOGUE = yaml.safe_load((ROOT / "group_vars/all/models.yml").read_text())["models_catalogue"]
TRAINING = yaml.safe_load((ROOT / "group_vars/all/training.yml").read_text())
STAGES = ["none", "zero0", "zero2", "zero3", "zero3_offload", "fsdp"]
SETTINGS = {
    "catalogue": CATALOGUE,
    "defaults": TRAINING["training_defaults"],
    "rules": TRAINING["training_profile_rules"],
    "memory": TRAINING["training_memory"],
    "compile": TRAINING["training_compile"],
    "stages": STAGES,
}
H200_GIB = round(143771 / 1024, 1)  # what an H200 reports (nvidia-smi memory.total, MiB)
RTX4090_GIB = round(24564 / 1024, 1)  # a 24 GB card
GPU_MODELS = sorted(m for m in CATALOGUE if m != "tiny")
# Qwen2.5-7B's config.json, the fields that matter, as the catalogue carries it.
QWEN25_7B_CONFIG = CATALOGUE["qwen2.5-7b"]["config"]


# The optional packages of a provisioned node's stack (the lock installs them everywhere).
STACK = {"bitsandbytes": "0.50.2", "liger-kernel": "0.8.5"}


def nodes(
    count: int = 1,
    nproc: int = 1,
    gib: float | None = H200_GIB,
    accelerator: str = "nvidia",
    packages: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    return [
        {
            "host": f"n{i}",
            "rank": i,
            "accelerator": accelerator,
            "nproc": nproc,
            "gpu_memory_gib": None if accelerator == "cpu" else gib,
            "memory_source": "CPU node" if accelerator == "cpu" else "facts, GPU",
            "packages": STACK if packages is None else packages,
        }
        for i in range(count)
    ]


def request(model: str = "qwen2.5-7b", **extra: Any) -> dict[str, Any]:
    asked = {
        "model": model,
        "deepspeed": "auto",
        "train_args": {},
        "tokens_per_step": TRAINING["training_tokens_per_step"],
        "max_restarts": 0,
        "cutoff_len": 0,
        "timestamp": "20260101-000000",
    }
    asked.update(extra)
    return asked


def make_plan(
    model: str = "qwen2.5-7b",
    *,
    cluster: list[dict[str, Any]] | None = None,
    settings: dict[str, Any] | None = None,
    **extra: Any,
) -> Plan:
    cluster = nodes() if cluster is None else cluster
    return plan(
        request(model, **extra),
        nodes=cluster,
        ranks={n["host"]: n["rank"] for n in cluster},
        datasets=[{"name": "demo_alpaca", "file": "data/demo_alpaca.json", "formatting": "alpaca"}],
        settings=settings or SETTINGS,
    )


# GPU memory per GPU a card reports (GiB), and node counts, of the stage table and the model tests.
MEMORIES = (24, 48, 80, 141)
NODE_COUNTS = (1, 2, 4)


def hostvars(
    accelerator: str = "nvidia", mib: list[int | None] | None = None, **extra: Any
) -> dict:
    settings: dict[str, Any] = {"cluster_accelerator": accelerator, "training_gpu_memory_gib": 80}
    if mib is not None:
        gpus = [{"index": i, "memory_mib": m, "name": "GPU"} for i, m in enumerate(mib)]
        settings["ansible_local"] = {"llama_host": {"gpus": gpus, "gpu_count": len(gpus)}}
    settings.update(extra)
    return settings
