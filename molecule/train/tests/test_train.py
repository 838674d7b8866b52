"""train.yml on the 2-node molecule lab: a real run, both faults, and a resume.

Each test drives `ansible-playbook train.yml` against molecule's inventory, exactly as a user
would, and inspects the nodes with `docker exec` and the controller's runs/ directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# Container names carry a prefix so that two checkouts can run the scenario side by side.
PREFIX = os.environ.get("LLAMA_MOLECULE_PREFIX", "mol")
NODES = (f"{PREFIX}-train-node1", f"{PREFIX}-train-node2")
RUNS = "/opt/llama-cluster/runs"
# A run long enough to be killed mid-way (kills come at step 12): 28 samples / (2 per device x
# 2 ranks) = 7 steps per epoch, 70 steps.
LONG_RUN = {"train_args": {"num_train_epochs": 10, "save_steps": 5}}
# Seconds from killing a process to the play having failed and stopped every rank.
FAULT_BOUND_S = 90

_state: dict[str, str] = {}


def _inventory() -> str:
    path = os.environ.get("MOLECULE_INVENTORY_FILE")
    if not path:
        pytest.skip("runs under molecule verify (MOLECULE_INVENTORY_FILE is not set)")
    return path


def _playbook_cmd(*extra: str) -> list[str]:
    return ["ansible-playbook", "-i", _inventory(), "train.yml", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"}


def _node(node: str, command: str) -> str:
    done = subprocess.run(
        ["docker", "exec", node, "sh", "-c", command],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout


def _said(output: str) -> str:
    """The play's output with the YAML callback's line wrapping undone."""
    return " ".join(output.split())


def _run_id(output: str) -> str:
    match = re.search(r"Run (train-\d{8}-\d{6}-[\w-]+)", output)
    assert match, f"no run id in the play's output:\n{output[-3000:]}"
    return match.group(1)


def _current_step(run_id: str) -> int:
    lines = _node(NODES[0], f"cat {RUNS}/{run_id}/output/trainer_log.jsonl 2>/dev/null")
    steps = [json.loads(line)["current_steps"] for line in lines.splitlines() if line.strip()]
    return max(steps, default=0)


def _training_pids(node: str) -> list[int]:
    """PIDs of the training processes (LLaMA-Factory's launcher under torchrun) on a node."""
    out = _node(node, "ps -eo pid=,args=")
    return [
        int(line.split()[0])
        for line in out.splitlines()
        if "llamafactory" in line and "launcher.py" in line
    ]


def _any_training_process() -> dict[str, str]:
    found = {}
    for node in NODES:
        out = _node(node, "ps -eo pid=,args= | grep -E 'llamafactory|torchrun' | grep -v grep")
        if out.strip():
            found[node] = out
    return found


def _kill_mid_run(victim: str) -> tuple[subprocess.CompletedProcess, str, float]:
    """Start a long run, SIGKILL the victim's training process mid-run, wait for the play."""
    proc = subprocess.Popen(
        _playbook_cmd("-e", "model=tiny", "-e", json.dumps(LONG_RUN)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    run_id = ""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        runs = _node(NODES[0], f"ls {RUNS} 2>/dev/null").split()
        fresh = sorted(r for r in runs if r not in _state.values() and r.startswith("train-"))
        if fresh:
            run_id = fresh[-1]
            if _current_step(run_id) >= 12:
                break
        assert proc.poll() is None, "the play ended before the run reached step 12"
        time.sleep(2)
    else:
        proc.kill()
        pytest.fail("the run did not reach step 12 within 600 s")
    pids = _training_pids(victim)
    assert pids, f"no training process on {victim}"
    _node(victim, f"kill -9 {pids[0]}")
    killed_at = time.monotonic()
    output, _ = proc.communicate(timeout=FAULT_BOUND_S * 2)
    elapsed = time.monotonic() - killed_at
    return subprocess.CompletedProcess(proc.args, proc.returncode, output), run_id, elapsed


def test_tiny_model_trains_across_both_nodes() -> None:
    started = time.monotonic()
    done = subprocess.run(
        _playbook_cmd("-e", "model=tiny"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    run_id = _run_id(output)
    _state["first"] = run_id
    local = ROOT / "runs" / run_id
    logs = {node: (local / "logs" / f"{node}.log").read_text() for node in NODES}
    assert all("world size: 2" in log for log in logs.values()), "a rank did not see world size 2"
    records = [json.loads(x) for x in (local / "trainer_log.jsonl").read_text().splitlines() if x]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses, "no loss was logged"
    assert (local / "training_loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "checkpoint-5" in _node(NODES[0], f"ls {RUNS}/{run_id}/output")
    assert "final loss" in _said(output)
    print(f"2-node tiny run {run_id}: {time.monotonic() - started:.0f} s, final loss {losses[-1]}")


def test_second_run_keeps_the_first_runs_output() -> None:
    first = _state.get("first")
    if not first:
        pytest.skip("the first run did not complete")
    assert "adapter_model.safetensors" in _node(NODES[0], f"ls {RUNS}/{first}/output")


def test_killing_the_worker_stops_every_rank_and_names_it() -> None:
    done, run_id, elapsed = _kill_mid_run(NODES[1])
    _state["worker_fault"] = run_id
    assert done.returncode != 0, "the play succeeded although a rank was killed"
    assert f"failed on {NODES[1]}" in _said(done.stdout), done.stdout[-4000:]
    assert elapsed < FAULT_BOUND_S, f"the play took {elapsed:.0f} s to fail"
    assert _any_training_process() == {}, "training processes are left"


def test_killing_rank0_stops_every_rank_and_names_it() -> None:
    done, run_id, elapsed = _kill_mid_run(NODES[0])
    _state["rank0_fault"] = run_id
    assert done.returncode != 0, "the play succeeded although rank 0 was killed"
    assert f"failed on {NODES[0]}" in _said(done.stdout), done.stdout[-4000:]
    assert elapsed < FAULT_BOUND_S, f"the play took {elapsed:.0f} s to fail"
    assert _any_training_process() == {}, "training processes are left"


def test_resume_continues_from_the_checkpoint_step() -> None:
    run_id = _state.get("worker_fault")
    if not run_id:
        pytest.skip("the fault test did not leave a run")
    saved = _node(NODES[0], f"ls {RUNS}/{run_id}/output")
    steps = sorted(int(m) for m in re.findall(r"checkpoint-(\d+)", saved))
    assert steps, "the killed run left no checkpoint"
    before = _node(NODES[0], f"cat {RUNS}/{run_id}/output/trainer_log.jsonl").splitlines()
    done = subprocess.run(
        _playbook_cmd("-e", "resume=true", "-e", f"run_id={run_id}"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    lines = (ROOT / "runs" / run_id / "trainer_log.jsonl").read_text().splitlines()
    resumed = [json.loads(x) for x in lines[len(before) :] if x.strip()]
    assert resumed, "the resumed run logged nothing"
    assert resumed[0]["current_steps"] == steps[-1] + 1, (
        f"resumed at step {resumed[0]['current_steps']}, expected {steps[-1] + 1} "
        f"(after checkpoint-{steps[-1]})"
    )
    assert resumed[-1]["current_steps"] == resumed[-1]["total_steps"]


def _playbook(playbook: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ansible-playbook", "-i", _inventory(), playbook, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # failures are reported on stderr
        text=True,
        env=_env(),
        check=False,
        timeout=900,
    )


def test_export_merges_the_lora_adapter_into_the_base_model() -> None:
    run_id = _state.get("first")
    if not run_id:
        pytest.skip("the first run did not complete")
    done = _playbook("playbooks/export.yml", "-e", f"run_id={run_id}")
    assert done.returncode == 0, done.stdout[-4000:]
    merged = _node(NODES[0], f"ls {RUNS}/{run_id}/merged")
    assert "model.safetensors" in merged
    assert "tokenizer.json" in merged
    again = _playbook("playbooks/export.yml", "-e", f"run_id={run_id}")
    assert again.returncode == 0
    assert "changed=0" in again.stdout, "a second export changed something"


def test_detached_run_is_followed_logged_and_stopped() -> None:
    started = _playbook(
        "train.yml", "-e", "model=tiny", "-e", "detach=true", "-e", json.dumps(LONG_RUN)
    )
    assert started.returncode == 0, started.stdout[-4000:]
    run_id = _run_id(started.stdout)
    assert "Follow it: ansible-playbook playbooks/status.yml" in _said(started.stdout)
    refused = _playbook("train.yml", "-e", "model=tiny")
    assert refused.returncode != 0
    assert "is running another job" in _said(refused.stdout)
    assert "One job at a time" in _said(refused.stdout)
    status = _playbook("playbooks/status.yml")
    assert status.returncode == 0
    assert run_id in _said(status.stdout)
    assert "running" in _said(status.stdout)
    logs = _playbook("playbooks/logs.yml")
    assert logs.returncode == 0
    assert (ROOT / "runs" / run_id / "logs" / f"{NODES[1]}.log").is_file()
    stopped = _playbook("playbooks/stop.yml")
    assert stopped.returncode == 0, stopped.stdout[-4000:]
    assert _any_training_process() == {}
    assert "adapter" not in _node(NODES[0], f"ls {RUNS}/{run_id}/output"), "it finished too soon"
