"""The decisions behind train.yml's node checks, case by case: gpu_ids a node does not have, and
the checkpoint a resumed run continues from (molecule/train/tests/test_bad_input.py runs both
on real nodes)."""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.filter import preflight
from ansible_collections.llama.cluster.plugins.module_utils.planner.checkpoints import resume_point
from ansible_collections.llama.cluster.plugins.module_utils.planner.render import dataset_files


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
