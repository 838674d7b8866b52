"""Bad requests to train.yml fail on the controller, with the problem and the fix, before any
node is contacted; and the DeepSpeed-stage rule picks what group_vars/all/training.yml states.

The inventories point at TEST-NET addresses (192.0.2.0/24) that nothing answers: a request that
got past validation would fail on "unreachable" instead of the message asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")


def _node(address: str, **extra: object) -> str:
    settings = {"ansible_host": address, "cluster_accelerator": "cpu", "nproc_per_node": 1}
    settings.update(extra)
    return json.dumps(settings)


def _inventory(tmp: Path, master: dict[str, str], workers: dict[str, str]) -> Path:
    path = tmp / "inventory.yml"
    lines = ["all:", "  children:", "    cluster:", "      children:"]
    lines += ["        master:", "          hosts:"] + [
        f"            {h}: {v}" for h, v in master.items()
    ]
    if workers:
        lines += ["        workers:", "          hosts:"] + [
            f"            {h}: {v}" for h, v in workers.items()
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def two_nodes(tmp_path: Path) -> Path:
    return _inventory(tmp_path, {"a": _node("192.0.2.1")}, {"b": _node("192.0.2.2")})


def _train(inventory: Path, *extra: str, playbook: str = "train.yml") -> tuple[int, str]:
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), playbook, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={"ANSIBLE_NOCOLOR": "1", "PATH": "/usr/bin:/bin", "HOME": str(inventory.parent)},
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def _fails_before_nodes(inventory: Path, *extra: str) -> str:
    rc, out = _train(inventory, *extra)
    assert rc != 0, out[-2000:]
    assert "Train | Prepare every node" not in out, "a node was contacted"
    assert "UNREACHABLE" not in out
    return out


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


def test_effective_batch_and_world_size_are_printed(tmp_path: Path) -> None:
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", nproc_per_node=4)},
        {"b": _node("192.0.2.2", nproc_per_node=4), "c": _node("192.0.2.3", nproc_per_node=4)},
    )
    out = _plan(
        inventory, "-e", "model=tiny", "-e", '{"train_args": {"gradient_accumulation_steps": 3}}'
    )
    assert "Nodes 3 x 4 processes = world size 12" in out
    assert "Effective batch 72 = per-device 2 x accumulation 3 x world size 12" in out


@pytest.mark.parametrize(
    ("model", "extra", "stage"),
    [
        ("tiny", {}, "none"),  # the lab: CPU, plain DDP
        ("qwen2.5-7b", {}, "none"),  # LoRA on 7B: bf16 weights fit in one GPU
        ("qwen2.5-0.5b", {}, "none"),  # full fine-tuning that fits: DDP
        ("qwen2.5-7b", {"finetuning_type": "full"}, "zero2"),  # full 7B: shard grads + optimizer
        # full 8B on 24 GiB GPUs, 16 ranks: ZeRO-2 does not fit, ZeRO-3 does
        ("llama3-8b", {"finetuning_type": "full", "training_gpu_memory_gib": 24}, "zero3"),
        # the same on 2 ranks: even ZeRO-3 does not fit, so the optimizer and weights go to CPU
        (
            "llama3-8b",
            {"finetuning_type": "full", "training_gpu_memory_gib": 24, "nproc": 1},
            "zero3_offload",
        ),
    ],
)
def test_deepspeed_stage_rule(tmp_path: Path, model: str, extra: dict, stage: str) -> None:
    accelerator = "cpu" if model == "tiny" else "nvidia"
    extra = dict(extra)
    nproc = extra.pop("nproc", 8)
    inventory = _inventory(
        tmp_path,
        {"a": _node("192.0.2.1", cluster_accelerator=accelerator, nproc_per_node=nproc)},
        {"b": _node("192.0.2.2", cluster_accelerator=accelerator, nproc_per_node=nproc)},
    )
    out = _plan(inventory, "-e", f"model={model}", "-e", json.dumps(extra))
    assert f"DeepSpeed: {stage} (chosen by the rule" in out
