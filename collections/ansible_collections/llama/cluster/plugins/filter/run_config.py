"""What roles/run_config writes into a run directory: train.yaml (its arguments and its text),
the dataset registry and the list of files; and the filters the role and train.yml call.
The plan itself is made by llama.cluster.run_plan (module_utils/planner).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.planner.disk import (
    disk_budget,
    log_bytes,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    hosts_without_gpu_facts,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import (
    DEEPSPEED_STAGES,
    LORA_KEYS,
)

# The stages that train with a ds_config.json (the role's are the keys of its vars/main.yml).
DEEPSPEED_FILES = tuple(stage for stage in DEEPSPEED_STAGES if stage.startswith("zero"))
# The stages that train with FSDP (fsdp_config.json), and train.yaml's fsdp for each: hsdp shards
# inside a node and replicates across nodes (FSDP's HYBRID_SHARD: its shard group is the GPUs a
# node's ranks see, which train.yml limits to them).
FSDP_STAGES = {"fsdp": "full_shard auto_wrap", "hsdp": "hybrid_shard auto_wrap"}

# train.yaml's sections, in order; an argument in none of them goes under "other settings".
TRAIN_YAML_SECTIONS = [
    (title, keys.split())
    for title, keys in (
        ("model", "model_name_or_path trust_remote_code"),
        (
            "method",
            "stage do_train finetuning_type lora_rank lora_target deepspeed fsdp fsdp_config",
        ),
        (
            "dataset",
            "dataset dataset_dir tokenized_path template cutoff_len max_samples overwrite_cache "
            "preprocessing_num_workers dataloader_num_workers",
        ),
        (
            "output",
            "output_dir logging_steps save_steps save_on_each_node save_only_model plot_loss "
            "overwrite_output_dir report_to include_num_input_tokens_seen",
        ),
        (
            "train",
            "per_device_train_batch_size gradient_accumulation_steps learning_rate "
            "num_train_epochs max_steps lr_scheduler_type warmup_ratio bf16 fp16 pure_bf16 "
            "ddp_timeout resume_from_checkpoint",
        ),
        (
            "performance",
            "packing neat_packing flash_attn disable_gradient_checkpointing "
            "ddp_find_unused_parameters torch_compile",
        ),
    )
]
# Why a value is what it is, beside it in train.yaml.
TRAIN_YAML_COMMENTS = {
    "trust_remote_code": "the model ships its own modelling code",
    "lora_target": 'modules LoRA adapts; "all" = every linear layer',
    "fsdp": "shard parameters, gradients and optimizer states across every rank",
    "cutoff_len": "tokens per sample; longer samples are truncated",
    "overwrite_cache": "re-tokenise each run: the dataset files live in this run directory",
    "tokenized_path": (
        "tokenized on this node before launch (a link to the node's copy): the ranks load it"
    ),
    "save_on_each_node": "every node keeps its own checkpoints, so every node can resume",
    "save_only_model": (
        "checkpoints without optimizer state (group_vars/all/training.yml says why)"
    ),
    "overwrite_output_dir": "false: never wipe output; a relaunch resumes from the last checkpoint",
    "plot_loss": "writes training_loss.png into output_dir",
    "ddp_timeout": "seconds a collective may block before the process group gives up",
    "report_to": "no wandb/tensorboard unless asked for",
    "include_num_input_tokens_seen": (
        "log the tokens trained on: the summary reports the measured tokens/s"
    ),
    "resume_from_checkpoint": "continue this checkpoint (set by -e resume=true)",
    "packing": "samples packed into full rows of cutoff_len tokens: almost no padding",
    "neat_packing": "true needs flash-attn 2 (flash_attn: fa2)",
    "ddp_find_unused_parameters": ("every parameter is used: no search for unused ones per step"),
}
# The planner's reasons (plan.decisions) shown beside the value it chose.
DECISION_COMMENTS = {
    "disable_gradient_checkpointing": "checkpointing",
    "torch_compile": "torch_compile",
    "per_device_train_batch_size": "batch",
}
# A text written bare in YAML; anything else (and YAML's words for booleans and null) as JSON.
BARE = re.compile(r"^[A-Za-z/][A-Za-z0-9_./,:+-]*$")
YAML_WORDS = ("true", "false", "yes", "no", "on", "off", "null", "none")


def train_args(
    plan: Mapping[str, Any],
    run_dir: str,
    shared_storage: bool = False,
    deepspeed_stages: Sequence[str] = DEEPSPEED_FILES,
    pretokenize: bool = False,
) -> dict[str, Any]:
    """What train.yaml holds: the plan's training arguments plus the model, data and paths.

    The model's path on every node (plan.model.path, resolved by the planner's model.py) is
    model_name_or_path. pretokenize: the ranks load the datasets tokenized before launch from
    <run>/tokenized (roles/run_config/tasks/tokenize.yml makes it); never for streaming
    datasets, which LLaMA-Factory cannot save.
    """
    model = plan["model"]
    lora = model["finetuning_type"] == "lora"
    args = {k: v for k, v in plan["train_args"].items() if lora or k not in LORA_KEYS}
    args.update(
        {
            "model_name_or_path": model["path"],
            "do_train": True,
            "finetuning_type": model["finetuning_type"],
            "dataset": ",".join(d["name"] for d in plan["datasets"]),
            "dataset_dir": f"{run_dir}/data",
            "template": model["template"],
            "cutoff_len": int(model["cutoff_len"]),
            "output_dir": f"{run_dir}/output",
        }
    )
    if lora:
        args["lora_target"] = model["lora_target"]
    if model.get("trust_remote_code"):
        args["trust_remote_code"] = True
    if plan["deepspeed"] in deepspeed_stages:
        args["deepspeed"] = f"{run_dir}/ds_config.json"
    if plan["deepspeed"] in FSDP_STAGES:
        args["fsdp"] = FSDP_STAGES[plan["deepspeed"]]
        args["fsdp_config"] = f"{run_dir}/fsdp_config.json"
    if pretokenize and not args.get("streaming"):
        args["tokenized_path"] = f"{run_dir}/tokenized"
    if int(plan["nnodes"]) > 1 and not shared_storage:
        args["save_on_each_node"] = True
    return args


def _yaml_value(value: object) -> str:
    if isinstance(value, str) and BARE.match(value) and value.lower() not in YAML_WORDS:
        return value
    text = json.dumps(value)
    mantissa, exponent, power = text.partition("e")
    if isinstance(value, float) and exponent and "." not in mantissa:
        return f"{mantissa}.0e{power}"  # 5e-05 is a string to YAML 1.1 readers (PyYAML)
    return text


def train_yaml(
    args: Mapping[str, Any],
    plan: Mapping[str, Any],
    run_dir: str,
    master_addr: str,
    master_port: int | str,
) -> str:
    """train.yaml's text: `args` (train_args) in sections, each value with why it is so, under a
    header that says how every node launches it."""
    nnodes = int(plan["nnodes"])
    comments = {
        **TRAIN_YAML_COMMENTS,
        "deepspeed": f"ZeRO stage chosen for this run: {plan['deepspeed']}",
        **(
            {
                "fsdp": "shard inside each node, replicate across nodes (the environment's "
                "FSDP_SHARDING_STRATEGY=HYBRID_SHARD makes accelerate do it)"
            }
            if plan["deepspeed"] == "hsdp"
            else {}
        ),
        "gradient_accumulation_steps": (
            f"effective batch = per-device x this x world size = {plan['effective_batch']}"
        ),
    }
    decisions = plan.get("decisions") or {}
    comments.update({key: decisions.get(why, "") for key, why in DECISION_COMMENTS.items()})
    lines = [
        f"# LLaMA-Factory training configuration, run {plan['run_id']}.",
        "# Every node runs the same file; the launcher gives each node its rank through the "
        "environment:",
        f"#   FORCE_TORCHRUN=1 NNODES={nnodes} NODE_RANK=<0..{nnodes - 1}> NPROC_PER_NODE=<n> \\",
        f"#   MASTER_ADDR={master_addr} MASTER_PORT={master_port} \\",
        f"#   llamafactory-cli train {run_dir}/train.yaml",
    ]
    listed = {key for _, keys in TRAIN_YAML_SECTIONS for key in keys}
    others = sorted(key for key in args if key not in listed)
    sections = [*TRAIN_YAML_SECTIONS, *([("other settings", others)] if others else [])]
    for title, keys in sections:
        lines += ["", f"### {title}"]
        for key in (k for k in keys if k in args):
            # A comment is one line, whatever its words hold (a decision may name the model).
            comment = (
                " ".join(str(comments.get(key) or "").split()) if title != "other settings" else ""
            )
            line = f"{key}: {_yaml_value(args[key])}"
            lines.append(f"{line}  # {comment}" if comment else line)
    return "\n".join(lines) + "\n"


def dataset_info(datasets: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """dataset_info.json: one entry per dataset, its file copied beside it as <name>.json."""
    return {
        d["name"]: {
            **{k: v for k, v in d.items() if k not in ("name", "file")},
            "file_name": f"{d['name']}.json",
        }
        for d in datasets
    }


def run_files(texts: Mapping[str, str], run_dir: str) -> list[dict[str, Any]]:
    """The run directory's files for the llama_files module: {name: text} -> entries, without
    the empty texts (a configuration the run does not use); a .json file is checked as JSON."""
    return [
        {
            "path": f"{run_dir}/{name}",
            "content": text if text.endswith("\n") else text + "\n",
            "json": name.endswith(".json"),
        }
        for name, text in texts.items()
        if text
    ]


def run_disk_budget(
    plan: Mapping[str, Any],
    free: Mapping[str, Any],
    runs_dir: str = "the runs directory",
    log_max_mib: object = 0,
    logs_kept: object = 0,
) -> dict[str, Any]:
    """The planner's disk_budget, with a job's node log rotated past log_max_mib, logs_kept
    rotated files kept, counted beside the checkpoints (0: no log counted)."""
    logs = log_bytes(log_max_mib, logs_kept) if log_max_mib else 0
    return disk_budget(plan, free, runs_dir, logs)


def unprobed(ranks: Iterable[str], hostvars: Any) -> list[str]:  # noqa: ANN401 - hostvars
    """The GPU nodes whose facts do not list their GPUs yet."""
    return hosts_without_gpu_facts(list(ranks), hostvars)


class FilterModule:
    """The run directory's filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "run_config_unprobed": unprobed,
            "run_config_train_args": train_args,
            "run_config_train_yaml": train_yaml,
            "run_config_dataset_info": dataset_info,
            "run_config_files": run_files,
            "run_config_disk_budget": run_disk_budget,
        }
