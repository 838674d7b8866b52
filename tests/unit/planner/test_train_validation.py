"""Bad requests to train.yml fail on the controller, with the problem and the fix, before any
node is contacted; and the plan train.yml prints follows group_vars/all/training.yml and every
node's GPU facts.

The inventories point at TEST-NET addresses (192.0.2.0/24) that nothing answers: a request that
got past validation would fail on "unreachable" instead of the message asserted here. GPU nodes
carry their facts in the inventory (`ansible_local`, the shape roles/host_facts records), so the
planner finds them as it finds cached facts and contacts no node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.action.run_plan import dataset_files
from ansible_collections.llama.cluster.plugins.filter import preflight
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.resume import resume_point

from tests.support.playbooks import _fails_before_nodes, _inventory, _node, _train

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def two_nodes(tmp_path: Path) -> Path:
    return _inventory(tmp_path, {"a": _node("192.0.2.1")}, {"b": _node("192.0.2.2")})


def test_unknown_model_lists_the_known_ones(two_nodes: Path) -> None:
    out = _fails_before_nodes(two_nodes, "-e", "model=gpt-5")
    assert 'Unknown model "gpt-5"' in out
    for known in ("qwen-7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama3-8b", "tiny"):
        assert known in out


def test_missing_model_says_how_to_give_one(two_nodes: Path) -> None:
    out = _fails_before_nodes(two_nodes)
    assert "No model given" in out
    assert "-e model=" in out


def test_unknown_dataset_lists_the_known_ones(two_nodes: Path) -> None:
    out = _fails_before_nodes(two_nodes, "-e", "model=tiny", "-e", "dataset=demo_alpaca,nope")
    assert "Unknown dataset nope" in out
    assert "demo_alpaca, demo_sharegpt" in out


def test_malformed_dataset_json_names_the_file(two_nodes: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"instruction": "hi", "output": "there"},')
    out = _fails_before_nodes(two_nodes, "-e", "model=tiny", "-e", f"dataset_file={bad}")
    assert f"{bad} is not valid JSON" in out
    assert "json.tool" in out


def test_missing_dataset_file_names_the_path(two_nodes: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.json"
    out = _fails_before_nodes(two_nodes, "-e", "model=tiny", "-e", f"dataset_file={missing}")
    assert f"{missing} does not exist" in out


def test_records_without_the_format_keys_are_refused(two_nodes: Path, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.json"
    wrong.write_text('[{"prompt": "hi", "answer": "there"}]')
    out = _fails_before_nodes(two_nodes, "-e", "model=tiny", "-e", f"dataset_file={wrong}")
    assert "1 of 1 records" in out
    assert (
        'not valid alpaca records (indexes count from 0): record 0 (line 1): has no "instruction"'
        in out
    )


def test_inventory_without_cluster_hosts_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yml"
    empty.write_text("all:\n  hosts: {}\n")
    out = _fails_before_nodes(empty, "-e", "model=tiny")
    assert "no hosts in the group 'cluster'" in out


def test_two_masters_are_refused(tmp_path: Path) -> None:
    inventory = _inventory(tmp_path, {"a": _node("192.0.2.1"), "b": _node("192.0.2.2")}, {})
    out = _fails_before_nodes(inventory, "-e", "model=tiny")
    assert "must hold exactly one host" in out


def test_mixed_process_counts_are_refused(tmp_path: Path) -> None:
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", nproc_per_node=2)},
        {"b": _node("192.0.2.2", nproc_per_node=1)},
    )
    out = _fails_before_nodes(inventory, "-e", "model=tiny")
    assert "different numbers of processes (a: 2, b: 1)" in out
    # Issue 39: planned nodes are of one shape; the way out is one variable, named with its value.
    assert "Set nproc_per_node=1 for the whole cluster" in out
    assert "or leave b out of the cluster group" in out


def test_ranks_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", node_rank=0)},
        {"b": _node("192.0.2.2", node_rank=2)},
    )
    out = _fails_before_nodes(inventory, "-e", "model=tiny")
    assert "do not add up" in out


def test_unknown_deepspeed_stage_is_refused(two_nodes: Path) -> None:
    out = _fails_before_nodes(two_nodes, "-e", "model=tiny", "-e", "deepspeed=zero4")
    assert 'Unknown deepspeed="zero4"' in out


def test_a_resumed_run_refuses_restarts_that_are_not_a_count(two_nodes: Path) -> None:
    # Issue 24: with resume=true, max_restarts=two used to run silently with no restarts.
    out = _fails_before_nodes(two_nodes, "-e", "resume=true", "-e", "max_restarts=two")
    assert '-e max_restarts = "two" (must be an integer >= 0)' in out


def test_train_args_must_be_a_mapping(two_nodes: Path) -> None:
    out = _fails_before_nodes(two_nodes, "-e", "model=tiny", "-e", "train_args=fast")
    assert "train_args must be a mapping" in out


def _plan(inventory: Path, *extra: str) -> str:
    """The plan train.yml would print, computed on the controller only."""
    rc, out = _train(
        inventory, "-e", "render_hosts=no_node", *extra, playbook="tests/playbooks/render_run.yml"
    )
    assert rc == 0, out[-2000:]
    return out


def _large_dataset(tmp: Path, records: int = 2048) -> list[str]:
    """-e arguments for an alpaca file of `records` records (demo_alpaca's, repeated): a plan
    for many processes asks each step for more records than demo_alpaca's 28, which is refused."""
    demo = json.loads((ROOT / "data" / "demo_alpaca.json").read_text())
    path = tmp / "large_alpaca.json"
    path.write_text(json.dumps([demo[i % len(demo)] for i in range(records)]))
    return ["-e", f"dataset_file={path}", "-e", "dataset_format=alpaca"]


def test_effective_batch_and_world_size_are_printed(tmp_path: Path) -> None:
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", nproc_per_node=4)},
        {"b": _node("192.0.2.2", nproc_per_node=4), "c": _node("192.0.2.3", nproc_per_node=4)},
    )
    accumulate = '{"train_args": {"gradient_accumulation_steps": 3}}'
    out = _plan(inventory, "-e", "model=tiny", "-e", accumulate, *_large_dataset(tmp_path))
    assert "Nodes 3 x 4 processes = world size 12" in out
    assert "Effective batch 72 = per-device 2 x accumulation 3 x world size 12" in out


H100_MIB, H200_MIB, RTX4090_MIB = 81559, 143771, 24564


@pytest.mark.parametrize(
    ("model", "extra", "gpu_mib", "stage"),
    [
        ("tiny", {}, None, "none"),  # the lab: CPU, plain DDP
        ("qwen2.5-7b", {}, H100_MIB, "none"),  # LoRA on 7B: bf16 weights fit in one GPU
        ("qwen2.5-0.5b", {}, H100_MIB, "none"),  # full fine-tuning that fits: DDP
        # shard the optimizer: ZeRO-1 fits and moves the gradients once per step (cost model)
        ("qwen2.5-7b", {"finetuning_type": "full"}, H100_MIB, "zero1"),
        # full 8B on 24 GiB GPUs, 16 ranks: ZeRO-2 does not fit, ZeRO-3 does
        ("llama3-8b", {"finetuning_type": "full"}, RTX4090_MIB, "zero3"),
        # the same on 2 ranks: even ZeRO-3 does not fit, so the optimizer and weights go to CPU
        ("llama3-8b", {"finetuning_type": "full", "nproc": 1}, RTX4090_MIB, "zero3_offload"),
    ],
)
def test_deepspeed_stage_rule(
    tmp_path: Path, model: str, extra: dict, gpu_mib: int | None, stage: str
) -> None:
    extra = dict(extra)
    nproc = extra.pop("nproc", 8)
    mib = None if gpu_mib is None else [gpu_mib] * nproc
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", gpu_mib=mib, nproc_per_node=nproc)},
        {"b": _node("192.0.2.2", gpu_mib=mib, nproc_per_node=nproc)},
    )
    out = _plan(
        inventory, "-e", f"model={model}", "-e", json.dumps(extra), *_large_dataset(tmp_path)
    )
    assert f"DeepSpeed: {stage} (" in out


def test_an_effective_batch_larger_than_the_dataset_is_refused_naming_the_largest(
    tmp_path: Path,
) -> None:
    # The lab's probe (issue 40): a per-device batch of 1,000,000 on 28 records was planned
    # without a word and held 10 GB per node until stopped.
    two = _inventory(tmp_path, {"a": _node("192.0.2.1")}, {"b": _node("192.0.2.2")})
    huge = '{"train_args": {"per_device_train_batch_size": 1000000}}'
    out = _fails_before_nodes(two, "-e", "model=tiny", "-e", huge)
    assert (
        "The effective batch is 2000000 records per optimizer step (per_device_train_batch_size "
        "1000000 x gradient_accumulation_steps 1 x 2 processes), more than the dataset's 28 "
        "records. The largest that fits is per_device_train_batch_size=14 with "
        "gradient_accumulation_steps=1 (effective batch 28)"
    ) in out
    # The largest it names is planned.
    fits = '{"train_args": {"per_device_train_batch_size": 14}}'
    assert "Effective batch 28 = per-device 14" in _plan(two, "-e", "model=tiny", "-e", fits)
    # More processes than records: nothing fits but a larger dataset or fewer nodes.
    many = _inventory(
        tmp_path, {"a": _node("192.0.2.1", nproc_per_node=16)}, {"b": _node("192.0.2.2",
                                                                            nproc_per_node=16)}
    )  # fmt: skip
    out = _fails_before_nodes(many, "-e", "model=tiny")
    assert "fewer records than processes, so some would train on nothing" in out


def test_the_plan_is_for_the_smallest_gpu_in_the_facts(tmp_path: Path) -> None:
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", gpu_mib=[H200_MIB])},
        {"b": _node("192.0.2.2", gpu_mib=[H200_MIB, RTX4090_MIB], gpu_ids=[1])},
    )
    out = _plan(inventory, "-e", "model=qwen2.5-1.5b", "-e", "finetuning_type=full")
    assert "GPU memory planned for: 24.0 GiB per GPU (smallest node: b, facts, GPU)" in out
    assert "DeepSpeed: zero1 (the fastest predicted of" in out


def test_the_plan_lists_what_was_decided(tmp_path: Path) -> None:
    inventory = _inventory(tmp_path, {"a": _node("192.0.2.1", gpu_mib=[H200_MIB])}, {})
    out = _plan(
        inventory,
        "-e",
        "model=qwen2.5-1.5b",
        "-e",
        "finetuning_type=full",
        "-e",
        "cutoff_len=1024",
        "-e",
        "tokens_per_step=3072",
        "-e",
        "max_restarts=2",
    )
    for line in (
        "qwen2.5-1.5b (Qwen/Qwen2.5-1.5B-Instruct), full, 1.54B parameters",
        "Nodes 1 x 1 processes = world size 1 (nvidia)",
        "Effective batch 3 = per-device 3 x accumulation 1 x world size 1",
        "Tokens per optimizer step: 3072 per process x 1 = 3072 (packed rows of 1024 tokens)",
        "DeepSpeed: none (the fastest predicted of",
        "Gradient checkpointing: off",
        # The dataset checker counted demo_alpaca's records: the run's length is known.
        "Packing: on; torch.compile: off (about 15 optimizer steps of ~",
        "GPU memory planned for: 140.4 GiB per GPU",
        "Restarts after a failure: at most 2",
    ):
        assert line in out, line


def test_a_gpu_node_without_cached_facts_is_read_before_planning(tmp_path: Path) -> None:
    facts = tmp_path / "facts.d"
    facts.mkdir()
    gpus = [{"index": 0, "memory_mib": RTX4090_MIB}]
    (facts / "llama_host.fact").write_text(json.dumps({"gpus": gpus, "gpu_count": 1}))
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "cluster_accelerator": "nvidia",
        "host_facts_facts_dir": str(facts),
    }
    inventory = _inventory(tmp_path, {"a": _node("127.0.0.1", **local)}, {})
    out = _plan(inventory, "-e", "model=qwen2.5-7b")
    assert "Read the GPUs of the nodes whose facts are not cached" in out
    assert "GPU memory planned for: 24.0 GiB per GPU (smallest node: a, facts, GPU)" in out


def test_nodes_that_disagree_on_the_accelerator_are_refused(tmp_path: Path) -> None:
    # As issue 13 found it: the GPU nodes have neither facts nor nproc_per_node, and the refusal
    # must be about the accelerators, not about processes, facts or an unreachable node.
    gpu = {"ansible_host": "192.0.2.1", "cluster_accelerator": "nvidia"}
    inventory = _inventory(
        tmp_path,
        {"a": json.dumps(gpu)},
        {"b": _node("192.0.2.2"), "c": json.dumps({**gpu, "ansible_host": "192.0.2.3"})},
    )
    out = " ".join(_fails_before_nodes(inventory, "-e", "model=tiny").split())
    # The inventory check (roles/inventory_check) refuses it first, naming both groups of nodes.
    assert (
        "Settings differ between nodes: cluster_accelerator ('nvidia' on a, c; 'cpu' on b)" in out
    )
    assert "nproc_per_node" not in out


def test_a_model_of_unknown_size_is_refused(two_nodes: Path) -> None:
    # A directory of the controller (roles/model_stage reads its config.json before the plan)
    # whose config gives no shape to count the parameters from.
    model = two_nodes.parent / "mine"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mystery"}')
    out = _fails_before_nodes(
        two_nodes, "-e", "model=mine", "-e", f"model_path={model}", "-e", "model_template=qwen"
    )
    assert "its size is unknown" in out
    assert "-e model_params_b=7.6" in out


# Every number a user can give, wrong, in one request: one message lists them all.
BAD_NUMBERS = {
    "train_args.learning_rate = -0.0001 (must be a number > 0)": {"learning_rate": -1e-4},
    "train_args.num_train_epochs = 0 (must be a number > 0)": {"num_train_epochs": 0},
    "train_args.per_device_train_batch_size = 0 (must be an integer >= 1)": {
        "per_device_train_batch_size": 0
    },
    "train_args.gradient_accumulation_steps = -8 (must be an integer >= 1)": {
        "gradient_accumulation_steps": -8
    },
    "train_args.logging_steps = 0 (must be an integer >= 1)": {"logging_steps": 0},
    "train_args.save_steps = 'often' (must be an integer >= 1)": {"save_steps": "often"},
    "train_args.max_steps = 0 (must be an integer >= 1 or -1": {"max_steps": 0},
    "train_args.warmup_ratio = 1.5 (must be a number in [0, 1))": {"warmup_ratio": 1.5},
    "train_args.lora_rank = 0 (must be an integer >= 1)": {"lora_rank": 0},
    "train_args.cutoff_len = 0 (must be an integer >= 1)": {"cutoff_len": 0},
}
# Names LLaMA-Factory 0.9.5 does not take, or that the plan sets itself, in the same request.
BAD_NAMES = {
    "train_args.lerning_rate is not an argument of LLaMA-Factory 0.9.5 (closest: learning_rate": {
        "lerning_rate": 1e-4
    },
    "train_args key 'bad key: x' is not an argument name": {"bad key: x": 1},
    "train_args.output_dir is set by the plan, which would replace it: leave it out": {
        "output_dir": "/tmp/mine"
    },
    "train_args.template is set by the plan, which would replace it: leave it out (ask for the "
    "template with -e model_template=<template>)": {"template": "qwen"},
}
BAD_RUN_INPUTS = {
    "model_template = 'qwn3' is not a template of LLaMA-Factory 0.9.5 (closest: qwen3": (
        "model_template=qwn3"
    ),
    "run_id = 'train-1-x' names a run to continue (-e resume=true -e run_id=<id>)": (
        "run_id=train-1-x"
    ),
    "-e cutoff_len = 'long' (must be an integer >= 1 or 0": "cutoff_len=long",
    "-e max_restarts = -1 (must be an integer >= 0)": "max_restarts=-1",
    "-e tokens_per_step (training_tokens_per_step) = 'many' (must be an integer >= 1)": (
        "tokens_per_step=many"
    ),
}


@pytest.fixture(scope="module")
def bad_numbers(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("bad")
    inventory = _inventory(tmp, {"a": _node("192.0.2.1")}, {"b": _node("192.0.2.2")})
    train_args = {
        k: v for one in [*BAD_NUMBERS.values(), *BAD_NAMES.values()] for k, v in one.items()
    }
    extra = [x for value in BAD_RUN_INPUTS.values() for x in ("-e", value)]
    return _fails_before_nodes(
        inventory, "-e", "model=tiny", "-e", json.dumps({"train_args": train_args}), *extra
    )


@pytest.mark.parametrize("message", [*BAD_NUMBERS, *BAD_NAMES, *BAD_RUN_INPUTS])
def test_a_bad_number_is_refused_before_any_node_is_touched(bad_numbers: str, message: str) -> None:
    assert message in bad_numbers
    assert "The request cannot be planned" in bad_numbers
    assert "nothing was changed on any node" in bad_numbers
    # The refusal is the first play's, on localhost: no node appears in the recap (the block up
    # to the play times that follow it).
    recap = bad_numbers[bad_numbers.index("PLAY RECAP") :].split("PLAY TIMES", maxsplit=1)[0]
    assert "localhost" in recap
    assert " a " not in recap
    assert " b " not in recap


def _linked(address: str, peer: str, gbps: float) -> str:
    """A GPU node (one H200) whose check.yml link facts name one peer at `gbps`."""
    links = {
        "measured_at": "2026-12-02T08:00:00Z",
        "interfaces": {"eth1": {"kind": "ethernet", "speed_mbps": 10000, "mtu": 1500}},
        "ifname": "eth1",
        "peers": {peer: {"ifname": "eth1", "tcp_gbps": gbps, "rtt_ms": 0.3}},
    }
    node = json.loads(_node(address, gpu_mib=[H200_MIB]))
    node["ansible_local"]["llama_links"] = links
    return json.dumps(node)


def test_nodes_predicted_to_train_slower_than_one_are_refused_before_launch(
    tmp_path: Path,
) -> None:
    inventory = _inventory(
        tmp_path, {"a": _linked("192.0.2.1", "b", 9.4)}, {"b": _linked("192.0.2.2", "a", 9.6)}
    )
    asked = ("-e", "model=qwen2.5-7b", "-e", "finetuning_type=full", "-e", "render_hosts=no_node")
    rc, out = _train(inventory, *asked, playbook="tests/playbooks/render_run.yml")
    assert rc != 0
    assert "Refused before launch: 2 nodes would train slower than 1" in out
    assert "link 9.4 Gbit/s, check.yml's slowest TCP stream, a to b" in out
    assert "LoRA (-e finetuning_type=lora)" in out
    # The user's figure wins over the facts, and the override trains anyway.
    out = _plan(inventory, *asked, "-e", "link_gbps=800")
    assert "Link between nodes: 800 Gbit/s (link_gbps (inventory or -e, a))" in out
    out = _plan(inventory, *asked, "-e", "allow_slow_scaling=true")
    assert "training anyway (-e allow_slow_scaling=true)" in out


def test_train_yml_refuses_zero3_over_a_10_mbit_link_before_any_node_changes(
    tmp_path: Path,
) -> None:
    inventory = _inventory(
        tmp_path, {"a": _linked("192.0.2.1", "b", 0.01)}, {"b": _linked("192.0.2.2", "a", 0.01)}
    )
    out = _fails_before_nodes(inventory, "-e", "model=tiny", "-e", "deepspeed=zero3")
    assert "Refused before launch: 2 nodes would" in out
    assert "link 0.01 Gbit/s, check.yml's slowest TCP stream" in out


def test_the_plan_alone_refuses_as_a_real_run_does_and_makes_nothing(tmp_path: Path) -> None:
    # train.yml --check: the tiny model is not made (its config.json, which the go/no-go reads,
    # comes from a scratch copy), no run directory is claimed, and the refusal is the same.
    inventory = _inventory(
        tmp_path, {"a": _linked("192.0.2.1", "b", 0.01)}, {"b": _linked("192.0.2.2", "a", 0.01)}
    )
    out = _fails_before_nodes(inventory, "--check", "-e", "model=tiny", "-e", "deepspeed=zero3")
    assert "Refused before launch: 2 nodes would" in out
    assert not (tmp_path / ".cache" / "llama-cluster" / "models" / "tiny").exists()
    assert not (tmp_path / "runs").exists()


# The decisions behind train.yml's node checks, case by case: gpu_ids a node does not have, and
# the checkpoint a resumed run continues from (molecule/train/tests/test_bad_input.py runs both
# on real nodes).


def _gpus(*indexes: int) -> dict:
    return {"llama_host": {"gpus": [{"index": i, "name": "NVIDIA H200"} for i in indexes]}}


def test_gpu_ids_that_a_node_has_pass() -> None:
    facts = {"n1": _gpus(0, 1, 2, 3), "n2": _gpus(0, 1)}
    assert preflight.preflight_gpu_ids({"n1": [0, 3], "n2": None}, facts) == []


def test_gpu_ids_a_node_lacks_name_the_node_the_ids_and_what_it_has() -> None:
    facts = {"n1": _gpus(0, 1, 2, 3), "n2": _gpus(0, 1), "n3": {"llama_host": {"gpus": []}}}
    problems = preflight.preflight_gpu_ids(
        {"n1": [0, 1, 2, 3], "n2": [0, 1, 2, 3], "n3": [0]}, facts
    )
    assert problems == [
        "n2: gpu_ids [0, 1, 2, 3] name 2, 3, which n2 does not have (it has 0, 1, in "
        "ansible_local.llama_host.gpus)",
        "n3: gpu_ids [0] name 0, which n3 does not have (it has no GPUs, in "
        "ansible_local.llama_host.gpus)",
    ]


def test_gpu_ids_that_are_not_indexes_are_named() -> None:
    problems = preflight.preflight_gpu_ids({"n1": ["0", "gpu1", True]}, {"n1": _gpus(0, 1)})
    assert problems == [
        "n1: gpu_ids ['0', 'gpu1', True] name gpu1, True, which n1 does not have (it has 0, 1, "
        "in ansible_local.llama_host.gpus)"
    ]


RUN = "/opt/llama-cluster/runs/train-1"


def _found(*steps: int, cut: tuple[int, ...] = ()) -> list[dict]:
    """What `find` lists in a node's output directory: checkpoint dirs and their trainer state."""
    out = f"{RUN}/output"
    entries = [{"path": f"{out}/checkpoint-{s}", "isdir": True} for s in (*steps, *cut)]
    entries += [{"path": f"{out}/checkpoint-{s}/trainer_state.json", "isdir": False} for s in steps]
    entries.append({"path": f"{out}/trainer_state.json", "isdir": False})
    return entries


def _point(found: dict, sharded: bool = False) -> dict:
    return resume_point(found, "train-1", RUN, "T", sharded)


def test_every_node_with_the_same_checkpoints_resumes_from_the_latest() -> None:
    point = _point({"n1": _found(5, 10), "n2": _found(5, 10)})
    assert (point["ok"], point["checkpoint"], point["set_aside"]) == (True, "checkpoint-10", {})
    assert point["message"] == (
        "Resuming train-1 from checkpoint-10, the latest checkpoint that every node has."
    )


def test_a_checkpoint_only_some_nodes_have_is_set_aside_on_the_others() -> None:
    point = _point({"n1": _found(5, 10), "n2": _found(5), "n3": _found(5, cut=(10,))})
    assert (point["ok"], point["step"]) == (True, 5)
    assert point["set_aside"] == {"n1": ["checkpoint-10"], "n3": ["checkpoint-10"]}
    assert point["message"] == (
        "Resuming train-1 from checkpoint-5, the latest checkpoint that every node has; moving "
        "checkpoint-10 (not on every node) on n1; checkpoint-10 (cut off while being written) "
        f"on n3 to {RUN}/set-aside/T."
    )


def test_a_node_without_the_checkpoint_fails_naming_it_and_the_copy_that_fixes_it() -> None:
    point = _point({"n1": _found(5, 10), "n2": []})
    assert not point["ok"]
    assert point["message"] == (
        "Run train-1 cannot resume: no checkpoint is on every node, and every node loads it from "
        "its own disk. n1 has checkpoint-5, checkpoint-10; n2 has none. n2 lacks checkpoint-10: "
        f"copy {RUN}/output/checkpoint-10 from n1 to the same path on n2 (e.g. rsync -a as the "
        "cluster user), then resume again; or start a new run (ansible-playbook train.yml -e "
        "model=...)."
    )


def test_a_sharded_checkpoint_cannot_be_copied_from_another_node() -> None:
    point = _point({"n1": _found(10), "n2": _found(5), "n3": _found(10)}, sharded=True)
    assert not point["ok"]
    assert (
        "n2 lacks checkpoint-10: each node's checkpoint holds only its own ranks'"
        in (point["message"])
    )
    assert f"restore {RUN}/output on n2 (from a backup)" in point["message"]


@pytest.mark.parametrize(
    ("found", "said"),
    [
        ({"n1": [], "n2": []}, "Run train-1 has no checkpoint yet (save_steps decides"),
        (
            {"n1": _found(cut=(5,)), "n2": []},
            "checkpoint-5 on n1 has no trainer_state.json (cut off while being written)",
        ),
    ],
)
def test_a_run_without_a_complete_checkpoint_says_to_start_a_new_one(found, said) -> None:
    point = _point(found)
    assert not point["ok"]
    assert said in point["message"]
    assert "start a new run instead" in point["message"]


def test_the_run_trains_on_the_file_each_dataset_check_returned() -> None:
    run = [{"name": "a", "file": "data/a.json"}, {"name": "b", "file": "data/b.json", "x": 1}]
    checked = {"b": {"file": "/runs/datasets/b.valid.jsonl", "valid": 3}}
    assert dataset_files(run, checked) == [
        {"name": "a", "file": "data/a.json"},
        {"name": "b", "file": "/runs/datasets/b.valid.jsonl", "x": 1},
    ]
