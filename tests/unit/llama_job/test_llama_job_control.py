"""llama-job's control.py (and spec.py, untrusted.py): root's side of the contract, start, status,
list, wait, stop, ports and rejoin, without systemd (job_supervisor: process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    procs,
    untrusted,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import spec as job_spec

from tests.support.llama_job_support import TOOL, Pair


def test_the_ports_verb_says_who_holds_a_port_as_start_would_refuse_it(tmp_path: Path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        held = _verb(tmp_path, "ports", "--port", str(port))
    assert held["free"] is False
    holder = procs.describe_listener(held["listeners"][0])
    assert held["busy"] == [f"port {port} is in use by {holder}"]
    free = _verb(tmp_path, "ports", "--port", str(port))
    assert free == {"free": True, "listeners": [], "busy": []}


def test_a_spec_the_job_user_could_rewrite_is_refused(tmp_path: Path):
    spec = tmp_path / "s.json"
    spec.write_text("{}")
    spec.chmod(0o666)
    with pytest.raises(job_spec.Refused):
        job_spec.load_spec(str(spec), require_root=True)


# ---------------------------------------------------------------------------------------------
# The root side: start, status, list, wait, stop, without systemd (job_supervisor: process)
# ---------------------------------------------------------------------------------------------
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="start and stop manage jobs as root")


def _verb(records: Path, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(TOOL), *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LLAMA_JOB_RECORDS": str(records)},
        timeout=120,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _specs(tmp_path: Path, **kwargs: object) -> Pair:
    """The specs and files of a pair, without starting its agents."""
    pair = Pair.__new__(Pair)
    Pair.__init__(pair, tmp_path, **kwargs)  # writes the specs and starts agents by hand ...
    pair.close()  # ... which this test does not want: it starts them through `start`
    for name in ("m.state.json", "w.state.json", "m.log", "w.log", "trainer_log.jsonl"):
        (tmp_path / name).unlink(missing_ok=True)
    return pair


@needs_root
def test_start_status_and_stop_through_the_contract_without_systemd(tmp_path: Path):
    records = tmp_path / "records"
    pair = _specs(tmp_path, steps=200)
    try:
        for host in ("m", "w"):
            started = _verb(
                records, "start", "--spec", str(tmp_path / f"{host}.json"), "--user", "root",
                "--supervisor", "process",
            )  # fmt: skip
            assert started["supervisor"] == "process", started
            assert started["unit"] == f"llama-t-rank{0 if host == 'm' else 1}"
        assert oct(records.stat().st_mode & 0o777) == "0o700"
        ready = _verb(records, "wait", "--job", "t", "--until", "running", "--timeout", "30")
        assert ready["reached"], ready
        active = _verb(records, "list", "--active")["jobs"]
        assert sorted(j["host"] for j in active) == ["m", "w"], _verb(records, "list")
        again = _verb(records, "start", "--spec", str(tmp_path / "m.json"), "--user", "root")
        assert "already runs" in again["error"]
        stopped = _verb(records, "stop", "--job", "t", "--timeout", "20")
        assert "m" in stopped["stopped"]  # the worker may have ended already: the master told it
        assert {r["phase"] for r in stopped["ranks"]} == {"stopped"}
        assert _verb(records, "list", "--active")["jobs"] == []
        assert pair.leftovers() == []
    finally:
        _verb(records, "stop", "--job", "t", "--timeout", "5")
        pair.close()


@needs_root
def test_a_worker_that_lost_its_agent_rejoins_and_the_restart_finishes_the_job(tmp_path: Path):
    """The worker's whole session SIGKILLed (what a node killed and started again leaves:
    root's record, a state that never ended): `rejoin`, as the node runs it at boot, starts its
    part again within the master's restart window, and the job restarts and finishes. The
    master's part, whose agent lives, is left alone; a second rejoin starts nothing."""
    records = tmp_path / "records"
    pair = _specs(tmp_path, restarts=1, steps=40)
    try:
        for host in ("m", "w"):
            _verb(
                records, "start", "--spec", str(tmp_path / f"{host}.json"), "--user", "root",
                "--supervisor", "process",
            )  # fmt: skip
        pair.wait_running()
        pair.wait_step(3)
        agent = pair.state("w")["pid"]
        for pid in procs.session_members(agent):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while pair.state("m").get("phase") != "restarting" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pair.state("m").get("phase") == "restarting", pair.logs()
        rejoined = _verb(records, "rejoin")
        assert [(r["job"], r["host"]) for r in rejoined["rejoined"]] == [("t", "w")], rejoined
        assert [(r["host"], r["why"]) for r in rejoined["skipped"]] == [
            ("m", "its agent runs, or it was stopped")
        ]
        again = _verb(records, "rejoin")
        assert again["rejoined"] == [], again
        ended = _verb(records, "wait", "--job", "t", "--until", "ended", "--timeout", "60")
        assert ended["ended"], pair.logs()
        master = pair.state("m")
        assert master["phase"] == "succeeded", pair.logs()
        assert [(r["after"]["node"], r["after"]["kind"]) for r in master["restarts"]] == [
            ("w", "vanished")
        ]
        assert pair.state("w")["phase"] == "succeeded"
        assert pair.leftovers() == []
    finally:
        _verb(records, "stop", "--job", "t", "--timeout", "5")
        pair.close()


@needs_root
def test_start_refuses_a_taken_master_port_naming_the_process(tmp_path: Path):
    records = tmp_path / "records"
    pair = _specs(tmp_path)
    stray = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(pair.gate), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not procs.listeners(pair.gate) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = _verb(records, "start", "--spec", str(tmp_path / "m.json"), "--user", "root")
        assert f"port {pair.gate} is in use by pid {stray.pid}" in refused["error"], refused
        assert "http.server" in refused["error"]
        assert _verb(records, "status", "--job", "t")["found"] is False
    finally:
        stray.kill()
        stray.wait()


def test_root_never_reads_a_state_file_through_a_link(tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_text('{"phase": "succeeded"}')
    link = tmp_path / "state.json"
    link.symlink_to(secret)
    assert untrusted.read_json_untrusted(link, (os.getuid(),)) == {}
    assert untrusted.read_json_untrusted(secret, (os.getuid(),)) == {"phase": "succeeded"}
    assert (
        untrusted.read_json_untrusted(secret, (os.getuid() + 1,)) == {}
    )  # not the job user's file
