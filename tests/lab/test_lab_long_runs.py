"""What long runs meet, on the 2 x 2 lab (issue 44): one watched train.yml run, three restarts
allowed and -e min_nodes=1, takes three faults in turn, each measured against its bound
(docs/faults.md):

1. the worker restarted (docker restart: systemd shuts it down and boots it): not a stop
   request; its agent is back by itself at boot (llama-job rejoin) and the run goes on with it;
2. the worker's runs disk fills during a save (a tmpfs mounted over its output between two
   saves, shrunk once two checkpoints count there, enlarged again once the attempt failed): the
   attempt fails naming the node, the path and the free space; nothing earlier was deleted, and
   the restart (the code of -e resume=true) continues from the last whole checkpoint, the
   cut-off one set aside;
3. the worker killed for good (docker kill; started again only once the run has ended): after
   the restart window the run continues on the master alone with the same effective batch, its
   loss curve going on, and finishes.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.fault_timings import record_fault
from tests.support.lab_nodes import (
    RUNS,
    address,
    booted,
    master_status,
    new_run,
    node,
    play,
    wait_for,
)
from train_runner import DEFAULT_INVENTORY

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.lab
# Checkpoints every 5 steps, a step logged each (the lab's plan: micro-batch 2 x 4 ranks).
# Far more steps than the faults need (a step of the tiny model can take 0.1 s), so that the
# last attempt, on the master alone, still has steps to go.
ARGS = {"max_steps": 150, "save_steps": 5, "save_total_limit": 2, "logging_steps": 1}
RESTART_WINDOW_S = 60  # job_restart_timeout for this run (120 s by default)
# How long the tests wait for the run to get somewhere (a start of the training stack on a
# loaded 2-core machine once took 5 minutes): a limit on waiting, not a bound of the product.
PROGRESS_S = 1200
# From the reboot to the master's next attempt: the node's part is back within the restart
# window of its going down (llama-job rejoin refuses later), then the master starts the attempt
# on every node: + 30 s for a loaded 2-core machine.
REBOOT_S = RESTART_WINDOW_S + 30
# From the kill of a node to the master's next attempt without it: its connection closes at
# once, the master waits the window, then starts the attempt on the nodes that remain (+ 30 s:
# the stop, a loaded machine).
LOST_S = RESTART_WINDOW_S + 30
_run: dict[str, object] = {}


def _log(host: str) -> str:
    return node(host, f"cat {RUNS}/{_run['run_id']}/logs/{host}.log").stdout


def _attempt(master: str, attempt: int, step: int = 1) -> bool:
    status = master_status(master, str(_run["run_id"]))
    return (
        status.get("attempt") == attempt
        and status.get("phase") == "running"
        and ((status.get("progress") or {}).get("current_steps") or 0) >= step
    )


def _begun(master: str, attempt: int) -> bool:
    """Whether the master has started `attempt` (every node it needs is back), running or not."""
    return (master_status(master, str(_run["run_id"])).get("attempt") or 0) >= attempt


def _curve(run_id: str) -> list[tuple[int, float]]:
    text = (ROOT / "runs" / run_id / "trainer_log.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(r["current_steps"], r["loss"]) for r in records if "loss" in r]


@pytest.fixture(scope="module")
def run(provisioned, lab_hosts: list[str]) -> dict[str, object]:
    """The watched run of the three faults; the worker as it was after it."""
    master, worker = lab_hosts
    before = set(node(master, f"ls {RUNS}").stdout.split())
    process, out = play(
        "train.yml", "-e", "model=tiny", "-e", json.dumps({"train_args": ARGS}),
        "-e", "max_restarts=3", "-e", "min_nodes=1",
        "-e", f"job_restart_timeout={RESTART_WINDOW_S}",
    )  # fmt: skip
    _run.update(play=process, out=out, address=address(worker), started=time.monotonic())
    found = wait_for("the run's directory", lambda: new_run(master, before), PROGRESS_S, process)
    _run["run_id"] = found
    yield _run
    if process.poll() is None:  # a test failed half-way: end the run, leave the lab free
        process.kill()
        process.wait()
        subprocess.run(
            ["ansible-playbook", "-i", str(DEFAULT_INVENTORY), "playbooks/stop.yml"],
            cwd=ROOT, capture_output=True, check=False,
        )  # fmt: skip
    if node(worker, "true").returncode != 0:  # killed and not started again: as it was
        subprocess.run(["docker", "start", worker], check=False, capture_output=True)
        booted(worker)
    node(worker, f"umount -l {RUNS}/{_run['run_id']}/output")


def test_a_restarted_node_rejoins_the_run_within_the_restart_window(
    run: dict, lab_hosts: list[str]
) -> None:
    master, worker = lab_hosts
    wait_for("the first checkpoint", lambda: _attempt(master, 1, 7), PROGRESS_S, run["play"])
    down = time.monotonic()
    subprocess.run(["docker", "restart", "-t", "60", worker], check=True, capture_output=True)
    assert address(worker) == run["address"], f"{worker} came back with another address"
    wait_for("attempt 2 on both nodes", lambda: _begun(master, 2), REBOOT_S * 2, run["play"])
    elapsed = time.monotonic() - down
    record_fault(
        "a worker restarted (docker restart: systemd shuts it down and boots it)",
        elapsed,
        REBOOT_S,
        f"its part rejoins at boot (llama-job rejoin) within job_restart_timeout "
        f"({RESTART_WINDOW_S} s here) of its going down; the master then starts every node "
        "again; + 30 s for a loaded 2-core machine",
    )
    assert elapsed < REBOOT_S
    restart = master_status(master, str(run["run_id"]))["restarts"][-1]
    assert (restart["after"]["node"], restart["after"]["kind"]) == (worker, "vanished"), restart
    assert restart["left_out"] == []
    text = _log(worker)
    assert "this node is shutting down: its command ends; its part rejoins when it boots" in text


def test_a_full_disk_during_a_save_is_named_and_the_run_continues_from_its_last_whole_checkpoint(
    run: dict, lab_hosts: list[str]
) -> None:
    master, worker = lab_hosts
    run_id = str(run["run_id"])
    wait_for("attempt 2's steps", lambda: _attempt(master, 2, 1), PROGRESS_S, run["play"])
    output, log = f"{RUNS}/{run_id}/output", f"{RUNS}/{run_id}/logs/{worker}.log"
    marks = f"{output}/checkpoint-*/llama_job_saved.json"
    # One shell on the worker (no round trip between what it sees and what it does): right after
    # a save counts, a small disk of its own over the output (the run's declaration copied
    # onto it); once two saves count there, only 40 KiB more free (a checkpoint takes about 230
    # KiB); once the agent says the disk is full, every checkpoint on it is listed, whole (its
    # marker) or cut, and the disk is enlarged again for the restart.
    fill = (
        "touch /tmp/fill-t0; "
        f"new=$(find {output} -maxdepth 2 -name llama_job_saved.json -newer /tmp/fill-t0); "
        f'until [ -n "$new" ]; do sleep 0.05; '
        f"new=$(find {output} -maxdepth 2 -name llama_job_saved.json -newer /tmp/fill-t0); done; "
        f"cp -p {output}/llama_job_markers.json /tmp/markers.json; "
        f"mount -t tmpfs -o size=64m,mode=0750,uid=$(id -u llama),gid=$(id -g llama) "
        f"llama-full {output} && cp -p /tmp/markers.json {output}/; "
        f"until [ $(ls {marks} 2>/dev/null | wc -l) -ge 2 ]; do sleep 0.05; done; "
        f"used=$(df -k --output=used {output} | tail -1); "
        f"mount -o remount,size=$((used + 40))k {output}; "
        f"until grep -q 'on {worker} is full' {log}; do sleep 0.2; done; "
        f"for c in {output}/checkpoint-*; do "
        '[ -f $c/llama_job_saved.json ] && echo "${c##*/} whole" || echo "${c##*/} cut"; done; '
        f"mount -o remount,size=64m {output}"
    )
    filled = node(worker, fill, timeout=900)
    assert filled.returncode == 0, filled.stderr
    held = sorted(
        (int(name.rsplit("-", 1)[1]), what)
        for name, what in (line.split() for line in filled.stdout.splitlines())
    )
    whole = [f"checkpoint-{step}" for step, what in held if what == "whole"]
    assert held[-1][1] == "cut", held  # the save the full disk cut off
    assert len(whole) >= 2, held  # nothing earlier deleted: the whole ones before it are there
    wait_for("attempt 3", lambda: _attempt(master, 3, 1), PROGRESS_S, run["play"])
    restart = master_status(master, run_id)["restarts"][-1]
    said = restart["after"]["message"]
    assert restart["after"]["node"] == worker, restart
    assert re.search(
        rf"the disk of {output} on {worker} is full after step \d+: [\d.,]+ (bytes|KiB) free of "
        r"[\d.]+ KiB",
        said,
    ), said
    assert restart["checkpoint"] == whole[-1], (restart, held)  # the last whole one
    text = _log(worker)
    assert f"attempt 3 resumes from {whole[-1]}" in text, text[-3000:]
    # The tmpfs is a filesystem of its own: the cut-off checkpoint is set aside beside it.
    assert f"set aside checkpoint-{held[-1][0]} (" in text, text[-3000:]
    assert f"{output}/set-aside/restart-3" in text, text[-3000:]


def test_a_node_lost_for_good_leaves_the_run_to_the_master_with_the_same_effective_batch(
    run: dict, lab_hosts: list[str]
) -> None:
    master, worker = lab_hosts
    run_id = str(run["run_id"])
    checkpoint = int(master_status(master, run_id)["restarts"][-1]["checkpoint"].rsplit("-")[1])

    def going() -> bool:
        return _attempt(master, 3, checkpoint + 7)

    wait_for("attempt 3's steps", going, PROGRESS_S, run["play"])
    subprocess.run(["docker", "kill", worker], check=True, capture_output=True)
    lost = time.monotonic()
    wait_for("attempt 4 on the master alone", lambda: _begun(master, 4), LOST_S * 2, run["play"])
    elapsed = time.monotonic() - lost
    record_fault(
        "a worker lost for good with min_nodes=1 (docker kill)",
        elapsed,
        LOST_S,
        f"its connection closes at once; the master waits job_restart_timeout ({RESTART_WINDOW_S} "
        "s here) for it, then continues on the master; + 30 s for a loaded 2-core machine",
    )
    assert elapsed < LOST_S
    restart = master_status(master, run_id)["restarts"][-1]
    assert restart["left_out"] == [worker], restart
    plan = json.loads(node(master, f"cat {RUNS}/{run_id}/plan.json").stdout)
    assert f"effective batch {plan['batch']['effective']} kept" in restart["note"], restart
    started = _log(master).split("attempt 4: starting")[1].splitlines()[0]
    micro = plan["train_args"]["per_device_train_batch_size"]
    accumulation = plan["train_args"]["gradient_accumulation_steps"]
    assert f"per_device_train_batch_size={micro}" in started, started
    assert f"gradient_accumulation_steps={2 * accumulation}" in started, started
    process = run["play"]
    process.wait(timeout=900)  # type: ignore[attr-defined]
    said = " ".join(Path(str(run["out"])).read_text().split())
    assert process.returncode == 0, said[-4000:]  # type: ignore[attr-defined]
    assert f"Ran without: {worker} (min_nodes, from attempt 4:" in said, said[-3000:]
    # The loss curve goes on: the last attempt starts at the step after its checkpoint, at the
    # loss the run had there, and reaches the last step.
    resumed = int(str(restart["checkpoint"]).rsplit("-", 1)[1])
    curve = _curve(run_id)
    last = [i for i, (step, _) in enumerate(curve) if step == resumed + 1][-1]
    before = dict(curve[:last])
    assert curve[-1][0] == ARGS["max_steps"], curve[-5:]
    assert abs(curve[last][1] - before[resumed]) < 0.1 * before[resumed], curve
    subprocess.run(["docker", "start", worker], check=True, capture_output=True)
    assert address(worker) == run["address"], f"{worker} came back with another address"
    booted(worker)
    record_fault(
        "the whole long run: a full disk, a reboot, a node lost for good (2 x 2 lab)",
        time.monotonic() - float(run["started"]),
        1800,
        "three faults, three restarts, one train.yml run",
    )
