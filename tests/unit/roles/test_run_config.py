"""What roles/run_config writes from a plan (plugins/filter/run_config.py): train.yaml's arguments
and text, the dataset registry; and the key and bookkeeping of each node's tokenized copy
(files/pretokenize.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter.run_config import (
    dataset_info,
    train_args,
    train_yaml,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Stage

from tests.support.planning import (
    ROOT,
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


TRAIN_PYTHON = Path(
    os.environ.get("LLAMA_CLUSTER_TRAIN_PYTHON", "/var/cache/llama-cluster/venv-train/bin/python")
)


# roles/run_config/files/pretokenize.py's key and bookkeeping, run in the training venv (where it
# runs on a node); the tokenizing itself runs in every train.yml run of molecule's train scenario.
_PRETOKENIZE = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import pretokenize
calls = json.loads(sys.stdin.read())
out = [pretokenize.cache_key(train)[0] for train in calls["keys"]]
cache = Path(calls["cache"])
out.append(pretokenize.prune(cache, 2, cache / calls["current"]))
print(json.dumps(out))
"""


def test_the_tokenized_copy_is_keyed_by_the_data_and_tokenizer_not_the_run(tmp_path: Path) -> None:
    if not TRAIN_PYTHON.exists():
        pytest.skip(f"no training venv at {TRAIN_PYTHON}: run scripts/setup-train-venv.sh")
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"model": 1}')
    runs = []
    for name in ("run1", "run2", "run3"):  # each run has its own copy of the dataset
        data = tmp_path / name / "data"
        data.mkdir(parents=True)
        (data / "dataset_info.json").write_text('{"d": {"file_name": "d.json"}}')
        (data / "d.json").write_text('[{"instruction": "a", "output": "b"}]')
        runs.append(str(data))
    (tmp_path / "run3/data/d.json").write_text('[{"instruction": "a", "output": "c"}]')
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"model": 2}')
    base = {"model_name_or_path": str(model), "dataset": "d", "dataset_dir": runs[0],
            "template": "qwen", "cutoff_len": 128, "learning_rate": 1e-4}  # fmt: skip
    keys = [
        base,
        {
            **base,
            "dataset_dir": runs[1],
            "output_dir": "/x",
            "learning_rate": 5e-3,
            "ddp_timeout": 9,
        },
        {**base, "dataset_dir": runs[2]},  # the dataset changed
        {**base, "cutoff_len": 256},
        {**base, "template": "llama3"},
        {**base, "packing": True},
        {**base, "max_samples": 10},
        {**base, "model_name_or_path": str(other)},
    ]
    cache = tmp_path / "cache"
    for name in ("old", "older", "current", "newer"):
        (cache / name).mkdir(parents=True)
        (cache / name / "data.arrow").write_text(name)
        (cache / f"{name}.json").write_text("{}")
    for age, name in enumerate(("newer", "old", "older", "current")):  # current: least recent
        os.utime(cache / name, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
    done = subprocess.run(
        [str(TRAIN_PYTHON), "-c", _PRETOKENIZE, str(ROOT / "roles/run_config/files")],
        input=json.dumps({"keys": keys, "cache": str(cache), "current": "current"}),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    *found, removed = json.loads(done.stdout.splitlines()[-1])
    assert found[1] == found[0], "another run directory or a training argument made a new copy"
    assert len(set(found[2:]) | {found[0]}) == len(found) - 1, found  # every data change: a new key
    # Two kept: the current copy (even when least recently used) and the most recent other.
    assert sorted(removed) == ["old", "older"]
    assert sorted(p.name for p in cache.iterdir()) == [
        "current",
        "current.json",
        "newer",
        "newer.json",
    ]
