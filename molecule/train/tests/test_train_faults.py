"""train.yml on the 2-node molecule lab, the faults of a node's whole machine: a power cut, a
dying worker with nobody watching and no systemd, a killed worker node that boots again; then
the summary of every fault's measured stop (this module runs after test_train.py's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from scenario import (
    LONG_RUN,
    MASTER,
    NODE_KILLED_S,
    NODES,
    PLAY_AFTER_VERDICT_S,
    POWER_LOSS_SLACK_S,
    RANK_DIES_BOUND,
    RANK_DIES_S,
    ROOT,
    RUNS,
    WORKER,
    Play,
    _address,
    _assert_failure_reported,
    _assert_nothing_active,
    _children,
    _jobs,
    _kill_training_process,
    _node,
    _playbook,
    _record,
    _run_id,
    _runs,
    _said,
    _state,
    _time_until_stopped,
    _timeouts,
    _timings,
    _training_pids,
    _training_processes,
    _wait_for_new_run,
)

# A power cut as the network sees it: every packet in and out of the node dropped (its
# loopback spared), no socket closed, no reset sent. Inserted first in INPUT and OUTPUT, deleted
# by the same rule afterwards (ufw's own rules stay as they are).
CUT_RULES = ("INPUT ! -i lo -j DROP", "OUTPUT ! -o lo -j DROP")


def _cut_power(node: str) -> float:
    """Drop all of `node`'s traffic; the moment of the cut on this machine's monotonic clock."""
    rules = " && ".join(f"iptables -I {rule.replace(' ', ' 1 ', 1)}" for rule in CUT_RULES)
    done = subprocess.run(
        ["docker", "exec", node, "sh", "-c", f"{rules} && date +%s.%N"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, f"cannot cut {node}'s traffic: {done.stderr}"
    return time.monotonic() - (time.time() - float(done.stdout.split()[-1]))


def _restore_power(node: str) -> None:
    for rule in CUT_RULES:
        _node(node, f"while iptables -D {rule} 2>/dev/null; do :; done")


@pytest.mark.parametrize("watched", [False, True], ids=["detached", "watched"])
def test_a_worker_that_loses_power_mid_run_stops_every_rank_and_is_named(watched: bool) -> None:
    """The worker's traffic cut without closing a socket (what a power loss or a dead switch
    looks like from the other side), with nobody watching and under a watching play: every rank
    on both nodes stops within job_peer_timeout + job_stop_timeout (+ slack), and the verdict
    (status.yml's, or the play's) names the worker."""
    before = _runs()
    play = None
    run = ["train.yml", "-e", "model=tiny", "-e", json.dumps(LONG_RUN)]
    if watched:
        play = Play(*run)
    else:
        started = _playbook(*run, "-e", "detach=true")
        assert started.returncode == 0, started.stdout[-4000:]
    run_id = _wait_for_new_run(play, before)
    clocks = _timeouts(run_id)
    bound = clocks["peer"] + clocks["stop"] + POWER_LOSS_SLACK_S
    cut_at = _cut_power(WORKER)
    try:
        elapsed = _time_until_stopped(cut_at, NODES, bound)
        if play is not None:  # the worker still cut off while the play reports
            done = play.wait(timeout=300)
            play_ended = time.time()
    finally:
        _restore_power(WORKER)
    _record(
        f"worker loses power, {'a play watching' if watched else 'nobody watching'} "
        "(its traffic dropped)",
        elapsed,
        bound,
        f"job_peer_timeout ({clocks['peer']:.0f} s) + job_stop_timeout ({clocks['stop']:.0f} s) "
        f"from the run's spec + {POWER_LOSS_SLACK_S} s for a loaded 2-core machine",
    )
    gone = f"stopped answering (no heartbeat for {clocks['peer']:.0f} s)"
    if play is not None:
        said = _assert_failure_reported(done, WORKER, run_id)
        assert gone in said, said[-3000:]
        (master,) = _jobs(MASTER, "status", "--job", run_id)["ranks"]
        after = play_ended - master["reason"]["at_s"]
        print(f"the watching play ended {after:.1f} s after the master's verdict")
        assert after <= PLAY_AFTER_VERDICT_S, (
            f"the play ended {after:.1f} s after the verdict (bound {PLAY_AFTER_VERDICT_S} s): "
            f"a later task waited on the dead node\n{done.stdout[-4000:]}"
        )
    # Its network back, the worker finds the master's agent gone and ends its own part.
    deadline = time.monotonic() + 60
    while _jobs(WORKER, "list", "--active")["jobs"] and time.monotonic() < deadline:
        time.sleep(1)
    status = _playbook("playbooks/status.yml", "-e", f"run_id={run_id}")
    said = _said(status.stdout)
    assert f"Run {run_id}: failed on {WORKER}" in said, status.stdout[-3000:]
    assert gone in said, said[-3000:]
    _assert_nothing_active()


def test_with_nobody_watching_and_no_systemd_a_dying_worker_still_stops_every_rank() -> None:
    """The controller's play is SIGKILLed, then a worker's training process dies: the cluster
    stops every rank by itself. Supervised without systemd (job_supervisor=process)."""
    before = _runs()
    play = Play(
        "train.yml", "-e", "model=tiny", "-e", json.dumps(LONG_RUN), "-e", "job_supervisor=process"
    )
    run_id = _wait_for_new_run(play, before)
    forks = _children(play.proc.pid)
    play.proc.send_signal(signal.SIGKILL)
    play.proc.wait()
    for pid in forks:  # its workers would poll on, unheard: they are this test's to end
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(2)  # nobody is watching now
    assert _training_pids(MASTER), "the run did not survive its play"
    killed_at = _kill_training_process(WORKER, run_id)
    elapsed = _time_until_stopped(killed_at, NODES, RANK_DIES_S)
    _record(
        "controller killed, then the worker's training process",
        elapsed,
        RANK_DIES_S,
        RANK_DIES_BOUND,
    )
    log = _node(MASTER, f"cat {RUNS}/{run_id}/logs/{MASTER}.log")
    assert "supervisor process" in log
    # The ranks are gone; the agents record the outcome a moment later (status.yml asked in
    # between says "stopping", as it should).
    deadline = time.monotonic() + 60
    while any(_jobs(n, "list", "--active")["jobs"] for n in NODES) and time.monotonic() < deadline:
        time.sleep(1)
    status = _playbook("playbooks/status.yml", "-e", f"run_id={run_id}")
    said = _said(status.stdout)
    assert f"Run {run_id}: failed on {WORKER}" in said, status.stdout[-3000:]
    assert "killed by signal 9" in said or "exit status" in said, said[-3000:]
    _assert_nothing_active()


def test_detached_run_is_followed_logged_and_stopped_without_systemd() -> None:
    started = _playbook(
        "train.yml",
        "-e",
        "model=tiny",
        "-e",
        "detach=true",
        "-e",
        "job_supervisor=process",
        "-e",
        json.dumps(LONG_RUN),
    )
    assert started.returncode == 0, started.stdout[-4000:]
    run_id = _run_id(started.stdout)
    assert "Follow it: ansible-playbook playbooks/attach.yml" in _said(started.stdout)
    refused = _playbook("train.yml", "-e", "model=tiny")
    assert refused.returncode != 0
    assert "is running another job" in _said(refused.stdout)
    assert "One job at a time" in _said(refused.stdout)
    status = _playbook("playbooks/status.yml")
    assert status.returncode == 0
    assert f"Run {run_id}: running" in _said(status.stdout), status.stdout[-3000:]
    logs = _playbook("playbooks/logs.yml")
    assert logs.returncode == 0
    assert (ROOT / "runs" / run_id / "logs" / f"{WORKER}.log").is_file()
    stopped = _playbook("playbooks/stop.yml")
    assert stopped.returncode == 0, stopped.stdout[-4000:]
    assert f"Run {run_id} (stopped): no rank of it runs on" in _said(stopped.stdout)
    assert _training_processes() == {}
    _assert_nothing_active()
    assert "adapter" not in _node(MASTER, f"ls {RUNS}/{run_id}/output"), "it finished too soon"


# The last fault: a node killed outright, twice in one watched run with one restart allowed.
# Started again, it rejoins (llama-job-rejoin.service at boot) and the run restarts; killed
# again, no restart is left and the play reports without it. The container is started again
# afterwards (and its ephemeral port range restored), so that tests after this one find both.
def test_a_killed_worker_node_stops_every_rank_rejoins_when_it_boots_then_is_reported() -> None:
    before = _runs()
    _state[f"address-{WORKER}"] = _address(WORKER)
    play = Play("train.yml", "-e", "model=tiny", "-e", json.dumps(LONG_RUN), "-e", "max_restarts=1")
    run_id = _wait_for_new_run(play, before)
    subprocess.run(["docker", "kill", WORKER], check=True, capture_output=True)
    killed_at = time.monotonic()
    try:
        elapsed = _time_until_stopped(killed_at, (MASTER,), NODE_KILLED_S)
    finally:
        _revive(WORKER)
    _wait_for_attempt(run_id, 2, play)
    rejoined_s = time.monotonic() - killed_at
    print(f"{WORKER} killed, started again: attempt 2 ran {rejoined_s:.0f} s after the kill")
    _record(
        "worker node killed (docker kill)",
        elapsed,
        NODE_KILLED_S,
        "its connections close at once, so a rank's bound (a second or two + job_stop_timeout); "
        "60 s leaves room for the container's end on a loaded 2-core machine",
    )
    worker_log = _node(WORKER, f"cat {RUNS}/{run_id}/logs/{WORKER}.log")
    assert worker_log.count(f"job {run_id} rank 1 (worker)") == 2, "its agent did not rejoin"
    assert "restart: attempt 2" in worker_log
    subprocess.run(["docker", "kill", WORKER], check=True, capture_output=True)
    try:
        done = play.wait(timeout=300)
    finally:
        _revive(WORKER)
    said = _assert_failure_reported(done, WORKER, run_id)
    assert "did not answer" in said
    assert "no restart left: 1 of 1 used" in said, said[-3000:]
    # Booted again with no restart left, it does not rejoin.
    assert _jobs(WORKER, "list", "--active")["jobs"] == []
    _assert_nothing_active()


def _wait_for_attempt(run_id: str, attempt: int, play: Play) -> float:
    """Seconds until the master runs `attempt` with every node (fails after 180 s)."""
    started = time.monotonic()
    while time.monotonic() - started < 180:
        ranks = _jobs(MASTER, "status", "--job", run_id).get("ranks") or [{}]
        if ranks[0].get("attempt") == attempt and ranks[0].get("phase") == "running":
            return time.monotonic() - started
        if play.proc.poll() is not None:
            pytest.fail(f"the play ended before attempt {attempt}:\n{play.output()[-4000:]}")
        time.sleep(1)
    log = _node(MASTER, f"tail -c 3000 {RUNS}/{run_id}/logs/{MASTER}.log")
    pytest.fail(f"attempt {attempt} did not run within 180 s:\n{log}")


def _revive(node: str) -> None:
    """Start a killed lab node again, as it was (address, ephemeral port range)."""
    address = _state.setdefault(f"address-{node}", _address(node))
    subprocess.run(["docker", "start", node], check=False, capture_output=True)
    assert _address(node) == address, f"{node} came back with another address"
    # At once, before its agent rejoins a job (a real node applies its sysctl.d at boot).
    with contextlib.suppress(subprocess.SubprocessError):
        _node(node, "sysctl -w net.ipv4.ip_local_port_range='40000 40999' >/dev/null")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = _node(node, "systemctl is-system-running 2>/dev/null || true")
        if state.strip() in ("running", "degraded"):
            break
        time.sleep(1)
    with contextlib.suppress(subprocess.SubprocessError):
        _node(node, "sysctl -w net.ipv4.ip_local_port_range='40000 40999' >/dev/null")


def test_fault_timings_summary() -> None:
    """Prints every fault's measured stop time (the table in the report)."""
    for name, seconds in _timings.items():
        print(f"  {seconds:6.1f} s  {name}")
