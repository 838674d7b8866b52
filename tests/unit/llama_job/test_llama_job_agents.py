"""llama-job's agents (agent.py, master.py, worker.py): the master's choice of the failure that
explains the others, and real agent pairs (tests/support/llama_job_support.py) broken the way the
lab
breaks a node."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    master,
    protocol,
)

from tests.support.llama_job_support import TOOL, Pair


def _failure(node: str, kind: protocol.FailureKind, at_s: float, *errors: str) -> protocol.Failure:
    return protocol.Failure(node, kind, "it failed", at_s=at_s, errors=errors)


def _arrived(*failures: protocol.Failure) -> list[master.Arrival]:
    """The failures as they reached the master, one second apart, in this order."""
    return [master.Arrival(float(at), failure) for at, failure in enumerate(failures)]


def test_the_culprit_is_the_node_whose_failure_is_its_own():
    kinds = protocol.FailureKind
    echo = _failure("m", kinds.EXITED, 1.0, "Connection closed by peer")
    cause = _failure("w", kinds.EXITED, 2.0, "Signal 9 (SIGKILL) received")
    assert master.choose_culprit(_arrived(echo, cause)) == cause
    gone = _failure("w", kinds.VANISHED, 3.0)
    assert master.choose_culprit(_arrived(echo, gone)) == gone
    stop = _failure("m", kinds.STOPPED, 9.0)
    assert master.choose_culprit(_arrived(cause, stop)) == stop
    assert master.choose_culprit([]) is None


@pytest.mark.parametrize(
    "late_clock", [-3600.0, float("nan"), float("inf")], ids=["an-hour-behind", "nan", "inf"]
)
def test_the_culprit_is_the_failure_that_reached_the_master_first_whatever_the_workers_clocks(
    late_clock: float,
):
    # w1's rank died first and its word reached the master first; w2's came a second later,
    # stamped by a clock an hour behind (or not a number). By the workers' clocks (Failure.at_s,
    # what the master once ordered by) w2 came first; by the master's, w1 did.
    kinds = protocol.FailureKind
    first = _failure("w1", kinds.EXITED, 1000.0, "Signal 9 (SIGKILL) received")
    second = _failure("w2", kinds.EXITED, 1000.0 + late_clock, "exit status 1")
    arrivals = [master.Arrival(6.0, second), master.Arrival(5.0, first)]
    assert master.choose_culprit(arrivals) == first
    assert master.choose_culprit(list(reversed(arrivals))) == first


# ---------------------------------------------------------------------------------------------
# Agents
# ---------------------------------------------------------------------------------------------
def test_both_nodes_finish_and_say_so(pair_factory):
    pair = pair_factory(steps=10)
    pair.wait_ended(timeout=40)
    assert pair.state("m")["phase"] == "succeeded", pair.logs()
    assert pair.state("w")["phase"] == "succeeded", pair.logs()
    assert pair.state("m")["progress"]["current_steps"] == 10
    assert pair.leftovers() == []


def test_a_killed_command_stops_the_other_node(pair_factory):
    pair = pair_factory()
    pair.wait_running()
    pair.wait_step(3)
    os.kill(pair.command_pid("w"), signal.SIGKILL)
    elapsed = pair.wait_ended(timeout=30)
    reason = pair.state("m")["reason"]
    assert pair.state("m")["phase"] == "failed"
    assert (reason["node"], reason["kind"], reason["exit_status"]) == ("w", "exited", -9)
    # killed, but not by the kernel's OOM killer: it is not called one
    assert (reason["message"], reason["cause"]) == (
        "its command ended, killed by signal 9 (SIGKILL)",
        None,
    )
    assert pair.state("w")["reason"]["node"] == "w"  # every node records the same verdict
    assert elapsed < 10, f"{elapsed:.1f} s to stop every rank"
    assert pair.leftovers() == []


def test_a_command_that_says_it_failed_is_ended_without_waiting_for_it_to_exit(pair_factory):
    pair = pair_factory(give_up_at=3)
    elapsed = pair.wait_ended(timeout=30)
    reason = pair.state("m")["reason"]
    assert (reason["node"], reason["kind"]) == ("w", "exited"), pair.logs()
    assert reason["message"] == "its command reported a failure (ChildFailedError: rank 1 died)"
    assert elapsed < 10
    assert pair.leftovers() == []


def test_a_rank_out_of_gpu_memory_is_named_with_its_node_step_and_figures(pair_factory):
    pair = pair_factory(worker_env={"OOM_AT": "6"})
    pair.wait_ended(timeout=30)
    reason = pair.state("m")["reason"]
    assert (reason["node"], reason["exit_status"], reason["cause"]["kind"]) == ("w", 1, "gpu_oom")
    assert re.fullmatch(
        r"rank 1 on w ran out of GPU memory after step \d+: tried to allocate 2\.3 GiB, 0\.4 of "
        r"79\.1 GiB free; its command ended, exit status 1",
        reason["message"],
    ), reason["message"]


@pytest.fixture
def memory_cgroup(tmp_path: Path):
    """A memory cgroup of 64 MiB on this machine (cgroup v1 or v2), for a real OOM kill."""
    for parent, limit in (
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
        ("/sys/fs/cgroup", "memory.max"),
    ):
        path = Path(parent) / f"llama-job-test-{os.getpid()}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / limit).write_text(str(64 << 20))
        except OSError:
            path.rmdir()
            continue
        yield path
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                path.rmdir()
                break
            except OSError:  # its last process is still being reaped
                time.sleep(0.2)
        return
    pytest.skip("no memory cgroup can be made here (needs root and a memory controller)")


def test_a_rank_killed_by_the_oom_killer_is_said_to_be(pair_factory, memory_cgroup: Path):
    pair = pair_factory(worker_env={"OOM_AT": "4", "OOM_CGROUP": str(memory_cgroup)})
    pair.wait_ended(timeout=30)
    reason = pair.state("m")["reason"]
    assert (reason["node"], reason["exit_status"]) == ("w", -9), pair.logs()
    cause = reason["cause"]
    assert (cause["kind"], cause["source"], cause["limit"]) == ("host_oom", "kernel log", "host")
    assert re.fullmatch(
        rf"the kernel killed pid {cause['pid']} \(python[\d.]*\) on w for host memory: it held "
        r"0\.\d of [\d.]+ GiB \(OOM killer\); its command ended, killed by signal 9 \(SIGKILL\)",
        reason["message"],
    ), reason["message"]
    assert pair.leftovers() == []


def test_a_vanished_node_stops_the_job(pair_factory):
    pair = pair_factory()
    pair.wait_running()
    command = pair.command_pid("w")
    os.killpg(pair.procs["w"].pid, signal.SIGKILL)  # the node's agent and command at once
    elapsed = pair.wait_ended(("m",), timeout=30)
    reason = pair.state("m")["reason"]
    assert (reason["node"], reason["kind"]) == ("w", "vanished"), pair.logs()
    assert reason["silent"] is False  # its connection closed: the machine answers, it is asked
    assert elapsed < 10
    assert command is not None


def test_a_frozen_node_is_given_up_and_ends_itself_when_it_thaws(pair_factory):
    pair = pair_factory()
    pair.wait_running()
    os.killpg(pair.procs["w"].pid, signal.SIGSTOP)
    elapsed = pair.wait_ended(("m",), timeout=30)
    reason = pair.state("m")["reason"]
    assert (reason["node"], reason["kind"]) == ("w", "vanished"), pair.logs()
    assert "no heartbeat" in reason["message"]
    assert reason["silent"] is True  # the plays ask it no more (job_gone)
    assert 3 <= elapsed < 12
    os.killpg(pair.procs["w"].pid, signal.SIGCONT)
    thawed = pair.wait_ended(("w",), timeout=30)
    assert thawed < 10, f"the thawed node took {thawed:.1f} s to end"
    assert pair.state("w")["phase"] == "failed"
    assert "frozen" in pair.state("w")["reason"]["message"]
    assert pair.leftovers() == []


def test_a_stalled_run_is_ended(pair_factory):
    pair = pair_factory(STALL_AT="5")
    pair.wait_running()
    elapsed = pair.wait_ended(timeout=40)
    reason = pair.state("m")["reason"]
    assert reason["kind"] == "stalled", pair.logs()
    assert reason["message"].startswith("no new step in trainer_log.jsonl for ")
    assert elapsed < 30
    assert pair.leftovers() == []


def test_a_stopped_rank_in_a_session_of_its_own_is_named_and_ended(pair_factory, tmp_path: Path):
    """SIGSTOP on a worker's rank that its launcher started in a session of its own, as torch's
    elastic agent starts every rank: the stall is blamed on that node, not on rank 0's, and the
    rank is ended with the rest (it was in neither the agent's session nor the command's group)."""
    pid_file = tmp_path / "rank.pid"
    pair = pair_factory(STALL_AT="8", worker_env={"RANK_PID_FILE": str(pid_file)})
    pair.wait_running()
    deadline = time.monotonic() + 10
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    rank = int(pid_file.read_text())
    assert os.getsid(rank) != os.getsid(pair.procs["w"].pid)  # a session of its own
    os.kill(rank, signal.SIGSTOP)
    pair.wait_ended(timeout=40)
    reason = pair.state("m")["reason"]
    assert (reason["node"], reason["kind"]) == ("w", "stalled"), pair.logs()
    assert reason["message"].endswith("; stopped processes on w"), reason["message"]
    assert pair.leftovers() == []


def test_a_restart_starts_every_node_again_and_finishes(pair_factory):
    pair = pair_factory(restarts=1, steps=20)
    pair.wait_running()
    pair.wait_step(3)
    os.kill(pair.command_pid("w"), signal.SIGKILL)
    pair.wait_ended(timeout=60)
    master = pair.state("m")
    assert master["phase"] == "succeeded", pair.logs()
    assert master["attempt"] == 2
    assert [r["after"]["node"] for r in master["restarts"]] == ["w"]
    assert pair.state("w")["phase"] == "succeeded"
    assert "restart 1 of 1: attempt 2" in (pair.tmp / "m.log").read_text()


def test_a_stop_request_stops_every_node_without_restarting(pair_factory):
    pair = pair_factory(restarts=2)
    pair.wait_running()
    os.kill(pair.procs["w"].pid, signal.SIGTERM)  # what llama-job stop / systemctl stop send
    pair.wait_ended(timeout=30)
    assert pair.state("m")["phase"] == "stopped", pair.logs()
    assert pair.state("m")["restarts"] == []
    assert pair.leftovers() == []


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_an_agent_refuses_a_log_that_is_a_link_and_writes_nothing_through_it(
    tmp_path: Path, planted: str
):
    # The node's log sits in the run's logs/, the job's own directory: a link planted there
    # once made the agent append to, and chmod, whatever it pointed at.
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    victim.chmod(0o600)
    log = tmp_path / "m.log"
    if planted == "link":
        log.symlink_to(victim)
    else:
        os.mkfifo(log)
    spec = {
        "job": "t",
        "host": "m",
        "rank": 0,
        "nnodes": 1,
        "role": "master",
        "watchdog_port": 0,
        "max_restarts": 0,
        "cwd": str(tmp_path),
        "log": str(log),
        "state": str(tmp_path / "m.state.json"),
        "env_file": str(tmp_path / "m.env"),
        "command": [sys.executable, "-c", "pass"],
    }
    (tmp_path / "m.json").write_text(json.dumps(spec))
    done = subprocess.run(
        [sys.executable, str(TOOL), "run", "--spec", str(tmp_path / "m.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    said = json.loads(done.stdout)["error"]
    assert said.startswith(f"cannot open the node's log {log}: "), said  # a fifo: never waited on
    if planted == "link":
        assert said.endswith("it is a link: refused, never followed"), said
    assert victim.read_text() == "keep me\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not (tmp_path / "m.state.json").exists(), "the agent ran"


def test_a_chatty_command_s_node_log_is_rotated_and_the_run_goes_on(tmp_path: Path):
    # 80 steps of 2 KB of output (160 KB in 16 s) against a log rotated past 16 KiB with 2 kept
    # (looked at every 5 s): the oldest output is gone, each file stays bounded, and the run ends
    # as it would have.
    rotate = {"log_rotate": {"max_bytes": 16 << 10, "keep": 2}}
    pair = Pair(tmp_path, steps=80, CHATTER="2000", spec_extra={"m": rotate, "w": rotate})
    try:
        pair.wait_ended(timeout=120)
        assert pair.state("m")["phase"] == "succeeded", pair.logs()
        for host in ("m", "w"):
            files = sorted(tmp_path.glob(f"{host}.log*"))
            assert [p.name for p in files] == [f"{host}.log", f"{host}.log.1", f"{host}.log.2"]
            text = "".join(p.read_text() for p in files)
            assert "step 80 x" in text
            assert "step 1 x" not in text, "nothing was dropped: the log grew without bound"
            assert "rotated this log at" in text
            # At most 5 s of output (25 steps x 2 KB) past the limit before a look rotates it.
            assert max(p.stat().st_size for p in files) < (16 << 10) + 25 * 2010
    finally:
        pair.close()
