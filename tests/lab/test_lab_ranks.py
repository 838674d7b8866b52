"""Two training processes on every lab node (world size 4), and the faults of one local rank.

One watched train.yml run on the provisioned lab (tests/conftest.py: `provisioned`; the lab runs
`nproc_per_node: 2`, roles/lab_cluster) with two restarts allowed takes four faults in turn, each
measured from the fault to the moment every process of that attempt is gone from both nodes and
asserted against its bound (docs/faults.md):

1. one local rank of the worker killed (SIGKILL) once checkpoint-10 is saved: every rank on both
   nodes stops, and the run restarts;
2. the restart resumes all four ranks from checkpoint-10, the checkpoint every node holds;
3. one local rank of the worker frozen (SIGSTOP) while its three siblings block in a collective:
   the stall clock names the worker and its stopped process, every rank stops, the run restarts;
4. the worker's agent (llama-job run) killed: every rank on both nodes stops and, no restart
   left, the play fails naming the worker.

Then the controller holds one log per rank and status.yml names every rank. The tests share the
run (module state); each asserts what its fault proves.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from itertools import pairwise
from pathlib import Path

import pytest

from tests.support.fault_timings import record_fault
from tests.support.lab_nodes import RUNS, master_status, node
from train_runner import DEFAULT_INVENTORY, Cluster

ROOT = Path(__file__).resolve().parents[2]
# 28 samples / (2 per device x 4 ranks): 4 steps an epoch; far more steps than the faults need
# (the last fault ends the run), a checkpoint every 5 steps, the latest 4 kept.
LONG_RUN = {"train_args": {"num_train_epochs": 400, "save_steps": 5, "save_total_limit": 4}}
SAVE_STEPS = 5
# The stall clock's floor for this run: a frozen rank is given up after this much silence (the
# default, 600 s, leaves room for evaluations and saves of large models).
STALL_FLOOR_S = 30
# The bounds, from the fault to every process of the attempt gone from both nodes (docs/faults.md).
RANK_DIES_S = 30  # the agent's 0.2 s loop, one message, job_stop_timeout (10 s); a loaded machine
FROZEN_S = STALL_FLOOR_S + 10 + 20  # the stall floor + job_stop_timeout + a loaded machine

pytestmark = pytest.mark.lab
_run: dict[str, object] = {}


def ranks_of(host: str) -> dict[int, dict[str, str]]:
    """The node's training processes (LLaMA-Factory's, under torchrun), by pid, with the
    environment torchrun gave each."""
    script = (
        "for p in $(pgrep -f '[l]auncher[.]py'); do "
        'e=$(tr "\\0" "\\n" < /proc/$p/environ 2>/dev/null | grep -E '
        "'^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|OMP_NUM_THREADS)='); "
        '[ -n "$e" ] && echo "$p $(echo $e)"; done; true'
    )
    found = {}
    for line in node(host, script).stdout.splitlines():
        pid, *pairs = line.split()
        env = dict(pair.split("=", 1) for pair in pairs)
        if "LOCAL_RANK" in env:
            found[int(pid)] = env
    return found


def all_ranks(hosts: list[str]) -> dict[str, dict[int, dict[str, str]]]:
    return {host: ranks_of(host) for host in hosts}


def time_until_gone(pids: dict[str, set[int]], since: float, bound: float) -> float:
    """Seconds from `since` until none of `pids` (per node) is alive (fails past 2 x bound).
    A process counts as alive while /proc lists it in any state but a zombie's."""
    alive: dict[str, list[int]] = {}
    while time.monotonic() - since < 2 * bound:
        for host, wanted in pids.items():
            states = node(host, f"cat {' '.join(f'/proc/{p}/stat' for p in wanted)} 2>/dev/null")
            alive[host] = [
                int(line.split()[0])
                for line in states.stdout.splitlines()
                if line.strip() and line.rsplit(")", 1)[-1].split()[0] != "Z"
            ]
        if not any(alive.values()):
            return time.monotonic() - since
        time.sleep(0.5)
    pytest.fail(f"processes of the attempt still run {2 * bound:.0f} s after the fault: {alive}")


def signal_rank_at_checkpoint(host: str, checkpoint: int, sig: str) -> tuple[float, int]:
    """Send `sig` to `host`'s local rank 1 as soon as checkpoint-N is saved there (the wait and
    the signal are one shell on the node: no round trip between them); the moment, on this
    machine's monotonic clock (containers share its clock), and the process."""
    # The save counts once its marker is written (after every file was synced).
    saved = f"{RUNS}/{_run['run_id']}/output/checkpoint-{checkpoint}/llama_job_saved.json"
    script = (
        f"i=0; until [ -f {saved} ]; do i=$((i + 1)); [ $i -gt 3000 ] && exit 3; sleep 0.1; done; "
        "for p in $(pgrep -f '[l]auncher[.]py'); do "
        "tr '\\0' '\\n' < /proc/$p/environ | grep -qx LOCAL_RANK=1 && "
        f'kill -{sig} $p && echo "$p $(date +%s.%N)" && exit 0; done; exit 4'
    )
    done = node(host, script, timeout=360)
    assert done.returncode == 0, f"no {sig} on {host} (exit {done.returncode}): {done.stderr}"
    pid, stamp = done.stdout.split()
    return time.monotonic() - (time.time() - float(stamp)), int(pid)


def next_checkpoint(master: str) -> int:
    """A checkpoint a few steps ahead of rank 0's last logged step."""
    step = (master_status(master, str(_run["run_id"])).get("progress") or {}).get("current_steps")
    return ((step or 0) // SAVE_STEPS + 2) * SAVE_STEPS


def wait_for(what: str, check: object, timeout: float = 600) -> object:
    """The first true value of check() within `timeout` s; the play's end fails the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()  # type: ignore[operator]
        if found:
            return found
        play = _run.get("play")
        if play is not None and play.poll() is not None:  # type: ignore[attr-defined]
            pytest.fail(f"the play ended before {what}:\n{Path(_run['out']).read_text()[-4000:]}")
        time.sleep(1)
    pytest.fail(f"no {what} within {timeout:.0f} s")


def attempt_running(master: str, attempt: int, step: int) -> bool:
    status = master_status(master, str(_run["run_id"]))
    progress = status.get("progress") or {}
    return (
        status.get("attempt") == attempt
        and status.get("phase") == "running"
        and (progress.get("current_steps") or 0) >= step
    )


@pytest.fixture(scope="module")
def run(provisioned: Cluster, lab_hosts: list[str]) -> dict[str, object]:
    """The watched run of every fault: started once, its play followed by the tests in turn."""
    master = lab_hosts[0]
    before = set(node(master, f"ls {RUNS}").stdout.split())
    out = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    play = subprocess.Popen(
        [
            "ansible-playbook", "-i", str(DEFAULT_INVENTORY), "train.yml", "-e", "model=tiny",
            "-e", json.dumps(LONG_RUN), "-e", "max_restarts=2",
            "-e", f"job_stall_floor={STALL_FLOOR_S}",
        ],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    _run.update(play=play, out=out.name)

    def new_run() -> str | None:
        fresh = sorted(set(node(master, f"ls {RUNS}").stdout.split()) - before)
        return fresh[-1] if fresh and fresh[-1].startswith("train-") else None

    _run["run_id"] = wait_for("new run directory", new_run)
    yield _run
    if play.poll() is None:  # a test failed half-way: end the run, leave the lab free
        play.kill()
        play.wait()
        subprocess.run(
            ["ansible-playbook", "-i", str(DEFAULT_INVENTORY), "playbooks/stop.yml"],
            cwd=ROOT, capture_output=True, check=False,
        )  # fmt: skip


def test_every_process_knows_its_local_rank_and_its_share_of_the_cores(
    run: dict, lab_hosts: list[str], lab_ranks: dict[str, list[int]]
) -> None:
    wait_for("the first steps", lambda: attempt_running(lab_hosts[0], 1, 1))
    found = all_ranks(lab_hosts)
    for host in lab_hosts:
        envs = sorted(found[host].values(), key=lambda e: int(e["LOCAL_RANK"]))
        assert [int(e["RANK"]) for e in envs] == lab_ranks[host], (host, envs)
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"4"}
        assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
        cores = int(node(host, "nproc").stdout)
        assert {e["OMP_NUM_THREADS"] for e in envs} == {str(max(1, cores // 2))}
    run["lab_ranks"] = lab_ranks


def test_a_killed_local_rank_stops_every_rank_on_every_node_and_the_run_restarts(
    run: dict, lab_hosts: list[str]
) -> None:
    master, worker = lab_hosts
    pids = {host: set(found) for host, found in all_ranks(lab_hosts).items()}
    checkpoint = next_checkpoint(master)
    killed_at, victim = signal_rank_at_checkpoint(worker, checkpoint, "KILL")
    assert victim in pids[worker]
    elapsed = time_until_gone(pids, killed_at, RANK_DIES_S)
    record_fault(
        "a worker's local rank 1 killed (2 ranks per node)",
        elapsed,
        RANK_DIES_S,
        "the worker's agent sees torchrun give up (a second or two), the master ends every node's "
        "attempt: job_stop_timeout (10 s) to SIGKILL; 30 s for a loaded 2-core machine",
    )
    wait_for("attempt 2", lambda: attempt_running(master, 2, checkpoint + 1))
    restarts = master_status(master, str(run["run_id"])).get("restarts") or []
    after = restarts[0]["after"]
    assert after["node"] == worker, after
    # The failure names the rank that died, from torchrun's summary.
    assert "rank 3 (local rank 1) killed by signal 9" in after["message"], after
    # The checkpoint saved on both nodes just before the kill: the latest every node holds.
    assert restarts[0]["checkpoint"].endswith(f"checkpoint-{checkpoint}"), restarts
    run["checkpoint"] = checkpoint


def test_the_restart_resumes_all_four_ranks_from_the_checkpoint_every_node_holds(
    run: dict, lab_hosts: list[str]
) -> None:
    step = int(run["checkpoint"])
    checkpoint = f"{RUNS}/{run['run_id']}/output/checkpoint-{step}"
    # The master says attempt 2 runs once its launch began (and attempt 1 may have logged steps
    # past the checkpoint): its four processes appear a moment later.
    ranks = wait_for(
        "attempt 2's four processes",
        lambda: (
            (found := all_ranks(lab_hosts)) and all(len(f) == 2 for f in found.values()) and found
        ),
    )
    for host, found in ranks.items():  # type: ignore[union-attr]
        for pid in found:
            args = node(host, f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout
            assert f"resume_from_checkpoint={checkpoint}" in args, (host, args)
        log = node(host, f"cat {RUNS}/{run['run_id']}/logs/{host}.log").stdout
        assert f"attempt 2 resumes from checkpoint-{step}" in log, log[-3000:]
    # Rank 0's trainer log: where attempt 2 went back, it went back to the step after the
    # checkpoint (attempt 1 may have logged a step or two past it before it was stopped).
    records = node(lab_hosts[0], f"cat {RUNS}/{run['run_id']}/output/trainer_log.jsonl").stdout
    steps = [json.loads(x)["current_steps"] for x in records.splitlines() if x.strip()]
    back = [later for earlier, later in pairwise(steps) if later <= earlier]
    assert back[:1] in ([], [step + 1]), steps
    assert step + 1 in steps, steps


def test_a_frozen_local_rank_is_named_and_every_rank_stops(run: dict, lab_hosts: list[str]) -> None:
    master, worker = lab_hosts
    wait_for("attempt 2's steps", lambda: attempt_running(master, 2, int(run["checkpoint"]) + 2))
    pids = {host: set(found) for host, found in all_ranks(lab_hosts).items()}
    frozen_at, _ = signal_rank_at_checkpoint(worker, next_checkpoint(master), "STOP")
    elapsed = time_until_gone(pids, frozen_at, FROZEN_S)
    record_fault(
        "a worker's local rank 1 frozen (SIGSTOP), its siblings in a collective",
        elapsed,
        FROZEN_S,
        f"no new step for the stall floor (job_stall_floor={STALL_FLOOR_S} s for this run; "
        "10 median steps if longer) + job_stop_timeout (10 s) + 20 s for a loaded machine",
    )
    wait_for("attempt 3", lambda: attempt_running(master, 3, 1))
    after = (master_status(master, str(run["run_id"])).get("restarts") or [])[-1]["after"]
    assert after["kind"] == "stalled", after
    assert after["node"] == worker, after
    assert f"stopped processes on {worker}" in after["message"], after


def test_a_killed_node_agent_stops_every_rank_and_fails_the_run_naming_the_node(
    run: dict, lab_hosts: list[str]
) -> None:
    master, worker = lab_hosts
    wait_for("attempt 3's steps", lambda: attempt_running(master, 3, 3))
    pids = {host: set(found) for host, found in all_ranks(lab_hosts).items()}
    agent = node(worker, f"pgrep -f '[l]lama-job run --spec .*{run['run_id']}'").stdout.split()
    assert agent, "no agent found on the worker"
    node(worker, f"kill -9 {agent[0]}")
    killed_at = time.monotonic()
    elapsed = time_until_gone(pids, killed_at, RANK_DIES_S)
    record_fault(
        "a worker's agent (llama-job run) killed, 2 ranks per node",
        elapsed,
        RANK_DIES_S,
        "systemd ends the unit's other processes with its main one; the master sees the "
        "connection close at once: a rank's bound",
    )
    play = run["play"]
    play.wait(timeout=600)  # type: ignore[attr-defined]
    said = " ".join(Path(str(run["out"])).read_text().split())
    assert play.returncode != 0, said[-3000:]  # type: ignore[attr-defined]
    assert f"failed on {worker} (node rank 1, ranks 2-3)" in said, said[-3000:]
    assert "no restart left: 2 of 2 used" in said, said[-3000:]


def test_the_controller_keeps_one_log_per_rank_and_status_names_every_rank(
    run: dict, lab_hosts: list[str]
) -> None:
    logs = ROOT / "runs" / str(run["run_id"]) / "logs"
    for rank in range(4):
        text = (logs / f"rank{rank}.log").read_text()
        assert "attempt 3" in text, f"rank {rank}'s log lacks the third attempt"
        # Its lines without the prefix the node's log gives them (torch's own "[rank3]: "
        # before a traceback's lines stays).
        assert not re.search(r"^\[rank\d+\]:\[rank", text, re.M), "the node log's prefix"
    status = subprocess.run(
        ["ansible-playbook", "-i", str(DEFAULT_INVENTORY), "playbooks/status.yml",
         "-e", f"run_id={run['run_id']}"],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    said = " ".join(status.stdout.split())
    master, worker = lab_hosts
    assert f"{master} (node rank 0, ranks 0-1): failed" in said, said[-3000:]
    assert f"{worker} (node rank 1, ranks 2-3): failed" in said, said[-3000:]
