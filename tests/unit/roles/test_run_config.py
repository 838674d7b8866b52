"""What roles/run_config writes from a plan (plugins/filter/run_config.py): train.yaml's arguments
and text, the dataset registry.
"""

from __future__ import annotations

from dataclasses import replace

import yaml
from ansible_collections.llama.cluster.plugins.filter.run_config import (
    dataset_info,
    train_args,
    train_yaml,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Stage

from tests.support.planning import (
    make_plan,
    nodes,
)


def test_train_yaml_adds_the_model_data_and_paths() -> None:
    plan = make_plan("qwen2.5-0.5b", cluster=nodes(2), deepspeed="zero2")
    data = plan.to_dict()
    args = train_args(data, "/runs/r1")
    assert args["model_name_or_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert args["deepspeed"] == "/runs/r1/ds_config.json"
    assert (args["dataset_dir"], args["output_dir"]) == ("/runs/r1/data", "/runs/r1/output")
    assert args["cutoff_len"] == 2048
    assert args["save_on_each_node"] is True
    assert not any(key.startswith("lora_") for key in args)  # a full fine-tune
    shared = train_args(data, "/runs/r1", shared_storage=True)
    assert "save_on_each_node" not in shared
    fsdp = train_args({**data, "stage": Stage.FSDP.properties()}, "/runs/r1")
    assert fsdp["fsdp_config"] == "/runs/r1/fsdp_config.json"
    assert "deepspeed" not in fsdp
    assert "tokenized_path" not in args  # the ranks tokenize unless asked
    pretokenized = train_args(data, "/runs/r1", False, True)
    assert pretokenized["tokenized_path"] == "/runs/r1/tokenized"
    streaming = {**data, "train_args": {**plan.train_args, "streaming": True}}
    assert "tokenized_path" not in train_args(streaming, "/runs/r1", False, True)


def test_train_yaml_lists_the_arguments_in_sections_with_the_reasons_beside_them() -> None:
    planned = make_plan("qwen2.5-0.5b", cluster=nodes(2), deepspeed="zero2")
    # No reason for checkpointing or compile.
    batch = replace(planned.batch, why="4 rows fit", checkpointing_why="", compile_why="")
    plan = replace(planned, batch=batch).to_dict()
    args = {
        **train_args(plan, "/runs/r1"),
        "report_to": "none",
        "learning_rate": 5e-05,
        "my_own": "a b",
        "disable_gradient_checkpointing": True,
    }
    text = train_yaml(args, plan, "/runs/r1", "10.0.0.1", 29500)
    lines = text.splitlines()
    assert lines[0] == f"# LLaMA-Factory training configuration, run {plan['run_id']}."
    assert "#   MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 \\" in lines
    assert "#   llamafactory-cli train /runs/r1/train.yaml" in lines
    titles = [x for x in lines if x.startswith("### ")]
    assert titles == [
        "### model",
        "### method",
        "### dataset",
        "### output",
        "### train",
        "### performance",
        "### other settings",
    ]
    assert "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct" in lines
    assert 'report_to: "none"  # no wandb/tensorboard unless asked for' in lines
    assert "learning_rate: 5.0e-05" in lines  # a float to PyYAML too
    assert "deepspeed: /runs/r1/ds_config.json  # ZeRO stage chosen for this run: zero2" in lines
    batch = f"per_device_train_batch_size: {args['per_device_train_batch_size']}  # 4 rows fit"
    assert batch in lines
    assert "disable_gradient_checkpointing: true" in lines  # no reason given: no comment
    others = lines[lines.index("### other settings") + 1 :]
    assert others == ['my_own: "a b"', "save_total_limit: 3"]  # outside the sections, sorted
    assert yaml.safe_load(text) == args
    assert text.endswith("\n")


def test_dataset_info_registers_each_file_beside_it() -> None:
    info = dataset_info(
        [{"name": "a", "file": "x/a.json", "formatting": "sharegpt", "columns": {"messages": "c"}}]
    )
    assert info == {
        "a": {"formatting": "sharegpt", "columns": {"messages": "c"}, "file_name": "a.json"}
    }
