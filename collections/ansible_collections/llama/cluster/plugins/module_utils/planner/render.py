"""Rendering helpers for roles/run_config: train.yaml's arguments, the dataset registry and the
run directory's files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .schema import LORA_KEYS


def train_yaml(
    plan: Mapping[str, Any],
    run_dir: str,
    shared_storage: bool = False,
    deepspeed_stages: Sequence[str] = ("zero0", "zero1", "zero2", "zero3", "zero3_offload"),
    pretokenize: bool = False,
) -> dict[str, Any]:
    """What train.yaml holds: the plan's training arguments plus the model, data and paths.

    pretokenize: the ranks load the datasets tokenized before launch from <run>/tokenized
    (roles/run_config/tasks/tokenize.yml makes it); never for streaming datasets, which
    LLaMA-Factory cannot save.
    """
    model = plan["model"]
    lora = model["finetuning_type"] == "lora"
    args = {k: v for k, v in plan["train_args"].items() if lora or k not in LORA_KEYS}
    args.update(
        {
            "model_name_or_path": plan["model_name_or_path"],
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
    if plan["deepspeed"] == "fsdp":
        args["fsdp"] = "full_shard auto_wrap"
        args["fsdp_config"] = f"{run_dir}/fsdp_config.json"
    if pretokenize and not args.get("streaming"):
        args["tokenized_path"] = f"{run_dir}/tokenized"
    if int(plan["nnodes"]) > 1 and not shared_storage:
        args["save_on_each_node"] = True
    return args


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


def dataset_files(
    datasets: list[Mapping[str, Any]], checked: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The run's datasets, in order, each with the file to train on that its check returned.

    checked maps a dataset name to a check result ({"file": ...}, as llama_dataset_check returns
    it); a dataset without one keeps its file.
    """
    return [
        {**entry, "file": checked[entry["name"]]["file"]}
        if entry["name"] in checked
        else dict(entry)
        for entry in datasets
    ]
