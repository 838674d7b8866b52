"""Bad input on the 2-node molecule lab: train.yml refuses it before anything changes on a node.

Node-side cases (the controller-only ones are in tests/test_train_validation.py and
tests/test_datasets.py): a node whose recorded torch differs, gpu_ids a node does not have, and
resuming a run whose checkpoints are not on every node. One real run (the valid records of a
dataset with bad ones, -e dataset_skip_invalid=true) makes the checkpoints the resume refusal
works on; a resume that trains is test_train.py's, of its killed run.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from scenario import NODES, ROOT, RUNS, _env, _inventory, _node, _run_id, _said

MIXED = ROOT / "tests" / "data" / "sharegpt_mixed.json"
FACTS = "/etc/ansible/facts.d"
# 12 valid records / (2 per device x 2 ranks) = 3 steps per epoch; checkpoints 2, 4 and 6.
SHORT_RUN = {
    "train_args": {
        "num_train_epochs": 2,
        "save_steps": 2,
        "logging_steps": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 1,
    }
}

_state: dict[str, str] = {}


def _play(*extra: str) -> tuple[int, str]:
    done = subprocess.run(
        ["ansible-playbook", "-i", _inventory(), "train.yml", *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        check=False,
        timeout=900,
    )
    return done.returncode, _said(done.stdout)


def _changed(output: str) -> dict[str, int]:
    """changed= of every host in the play recap."""
    return {host: int(n) for host, n in re.findall(r"(\S+) : ok=\d+ changed=(\d+)", output)}


def _no_node_changed(output: str) -> None:
    changed = _changed(output)
    assert changed, f"no play recap in:\n{output[-3000:]}"
    assert {node: changed.get(node, 0) for node in NODES} == dict.fromkeys(NODES, 0), changed


def _runs() -> dict[str, str]:
    return {node: _node(node, f"ls {RUNS} 2>/dev/null") for node in NODES}


@contextmanager
def _recorded(node: str, fact: str, **values: str) -> Iterator[None]:
    """The node's local fact with some values changed, restored afterwards."""
    path = f"{FACTS}/{fact}.fact"
    original = _node(node, f"cat {path}")
    assert original.strip(), f"{node} has no {path}"
    edited = json.dumps({**json.loads(original), **values})
    subprocess.run(["docker", "exec", "-i", node, "sh", "-c", f"cat > {path}"], input=edited,
                   text=True, check=True)  # fmt: skip
    try:
        yield
    finally:
        subprocess.run(["docker", "exec", "-i", node, "sh", "-c", f"cat > {path}"],
                       input=original, text=True, check=True)  # fmt: skip


def test_a_node_whose_recorded_torch_differs_is_named_before_anything_changes() -> None:
    before = _runs()
    with _recorded(NODES[1], "llama_stack", torch="2.10.0"):
        rc, out = _play("-e", "model=tiny")
    assert rc != 0
    assert (
        f"Preflight: the nodes disagree. {NODES[1]}: torch is 2.10.0, but 2.11.0 on {NODES[0]}"
        in out
    ), out[-3000:]
    assert "Re-run provision.yml (or fix that node)" in out
    _no_node_changed(out)
    assert _runs() == before, "a run directory was made"


def test_gpu_ids_a_node_does_not_have_are_named_before_anything_changes() -> None:
    before = _runs()
    rc, out = _play("-e", "model=tiny", "-e", json.dumps({"gpu_ids": [3]}))
    assert rc != 0
    for node in NODES:
        assert f"{node}: gpu_ids [3] name 3, which {node} does not have (it has no GPUs" in out, (
            out[-3000:]
        )
    assert "Fix gpu_ids in the inventory" in out
    _no_node_changed(out)
    assert _runs() == before, "a run directory was made"


def test_skip_invalid_trains_on_the_valid_records_only() -> None:
    rc, out = _play(
        "-e", "model=tiny", "-e", f"dataset_file={MIXED}", "-e", "dataset_format=sharegpt",
        "-e", "dataset_skip_invalid=true", "-e", json.dumps(SHORT_RUN),
    )  # fmt: skip
    assert rc == 0, out[-5000:]
    assert "Training on the 12 valid records; 2 left out (first indexes: 3, 9)." in out
    run_id = _run_id(out)
    _state["run"] = run_id
    for node in NODES:
        data = _node(node, f"cat {RUNS}/{run_id}/data/user_data.json").splitlines()
        assert len(data) == 12, f"{node} got {len(data)} records"
        saved = _node(node, f"ls {RUNS}/{run_id}/output")
        assert {"checkpoint-2", "checkpoint-4", "checkpoint-6"} <= set(saved.split()), saved
    log = (ROOT / "runs" / run_id / "logs" / f"{NODES[0]}.log").read_text()
    assert re.search(r"Num examples = 12\b", log), "LLaMA-Factory did not train on 12 examples"


def _run_or_skip() -> str:
    run_id = _state.get("run")
    if not run_id:
        pytest.skip("the skip-invalid run did not complete")
    return run_id


def test_resume_refuses_when_a_worker_lacks_the_checkpoint_and_says_what_to_do() -> None:
    run_id = _run_or_skip()
    output = f"{RUNS}/{run_id}/output"
    held = f"/root/held-{run_id}"
    listing = {node: _node(node, f"ls -R {output}") for node in NODES}
    _node(NODES[1], f"mkdir -p {held} && mv {output}/checkpoint-* {held}/")
    try:
        rc, out = _play("-e", "resume=true", "-e", f"run_id={run_id}")
    finally:
        _node(NODES[1], f"mv {held}/* {output}/ && rmdir {held}")
    assert rc != 0
    assert (
        f"Run {run_id} cannot resume: no checkpoint is on every node, and every node loads it "
        f"from its own disk. {NODES[0]} has checkpoint-2, checkpoint-4, checkpoint-6; {NODES[1]} "
        f"has none. {NODES[1]} lacks checkpoint-6: copy {output}/checkpoint-6 from {NODES[0]} "
        f"to the same path on {NODES[1]}"
    ) in out, out[-3000:]
    _no_node_changed(out)
    assert {node: _node(node, f"ls -R {output}") for node in NODES} == listing
