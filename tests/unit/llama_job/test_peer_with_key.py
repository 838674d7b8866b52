"""A peer that holds the job's key, against live agents (issue 45): typed messages after the mac,
a per-message boundary, the mac's direction and sender, hellos tied to the inventory's
addresses, and genuine joins served before any flood.

Each live test runs one real agent (`llama-job run`, the zipapp) and plays its other side in this
process with the package's own link code: a fake worker that holds the key against a live
master, or a fake master against a live worker. Sealed bodies of every shape (hypothesis) are
sent on the authenticated connection: the agent lives, cuts that connection, takes the peer back
when it connects again, and the run goes on to succeed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import messages, wire
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.link import (
    Hub,
    Link,
    connect,
    read_uplink,
)
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.support.llama_job_support import TOOL, free_port

KEY = b"secret"
JOB = "t"
# The job each live agent runs: a step every 0.2 s into the trainer log, until the test releases it.
RELEASED = r"""
import json, os, socket, sys, time
progress, release = sys.argv[1], sys.argv[2]
if os.environ.get("GATE"):
    server = socket.create_server(("127.0.0.1", int(os.environ["GATE"])))
step = 0
while not os.path.exists(release):
    time.sleep(0.2)
    step += 1
    if progress:
        with open(progress, "a") as log:
            log.write(json.dumps({"current_steps": step, "total_steps": 10**6}) + "\n")
"""
EXAMPLES = 120  # sealed bodies per live agent (each cuts a connection, then one reconnects)

# The issue's probes, each sealed with the job's key: every one had raised in an agent's loop.
ISSUE_PROBES = {
    "attempt x": {"t": "exit", "attempt": "x", "exit_status": 1},
    "Infinity": {"t": "exit", "attempt": 1, "at_s": math.inf, "exit_status": 0},
    "NaN": {"t": "beat", "phase": "running", "attempt": math.nan},
    "errors 5": {"t": "exit", "attempt": 1, "exit_status": 1, "errors": 5},
    "a listing without path": {"t": "idle", "attempt": 1, "checkpoints": [{"isdir": True}]},
}
# ... and as the master would send them to a worker.
MASTER_PROBES = {
    "attempt x": {"t": "start", "attempt": "x"},
    "Infinity": {
        "t": "final",
        "phase": "failed",
        "reason": {"kind": "exited", "message": "m", "at_s": math.inf},
    },
    "NaN": {"t": "beat", "phase": "running", "attempt": math.nan},
    "errors 5": {
        "t": "abort",
        "attempt": 1,
        "reason": {"kind": "exited", "message": "m", "errors": 5},
    },
    "a plan without ok": {"t": "continue", "attempt": 2, "plan": {"checkpoint": "checkpoint-3"}},
    "a listing as set_aside": {
        "t": "continue",
        "attempt": 2,
        "plan": {"ok": True, "set_aside": {"w": [{"path": 1}]}},
    },
}


def fuzz(examples: int) -> settings:
    """`examples` cases, no example database, no deadline (a loaded 2-core machine)."""
    return settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def malformed(body: dict, *, from_master: bool) -> bool:
    """Whether the agents refuse this body once it verified (its JSON, then its schema)."""
    try:
        _seq, parsed = wire.unseal(KEY, "c", wire.seal(KEY, "c", 1, body), 0)
        messages.check(parsed, from_master=from_master)
    except wire.BadMessage:
        return True
    return False


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=40)
    | st.just("x" * 9000),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
NAMED = "attempt phase exit_status errors rank at_s message cause kind checkpoints stopped_procs"
FIELDS = st.sampled_from([*NAMED.split(), "aborted", "stopped", "reason", "after", "plan", "path"])


def bodies(kinds: list[str]) -> st.SearchStrategy[dict]:
    """Bodies of every shape: a kind (or none, or another), any fields, any values."""
    kind = st.sampled_from([*kinds, "challenge", "hello", "welcome"]) | JSON
    return st.builds(
        lambda t, fields: {**fields, "t": t},
        kind,
        st.dictionaries(FIELDS | st.text(max_size=6), JSON, max_size=5),
    )


# -- one live agent ----------------------------------------------------------------------------
class Agent:
    """A real agent of job `t` (the zipapp) on 127.0.0.1, running RELEASED until released."""

    def __init__(
        self, tmp: Path, role: str, watchdog: int, master_address: str = "127.0.0.1"
    ) -> None:
        self.tmp, self.role = tmp, role
        host = "m" if role == "master" else "w"
        gate = free_port()
        (tmp / "job.py").write_text(RELEASED)
        progress = str(tmp / "trainer_log.jsonl") if role == "master" else ""
        (tmp / "env").write_text(f'GATE="{gate}"\n' if role == "master" else "")
        spec = {
            "job": JOB, "host": host, "rank": 0 if role == "master" else 1, "nnodes": 2,
            "role": role, "master": {"host": "m", "address": master_address},
            "peers": {"w": "127.0.0.1"} if role == "master" else {}, "address": "127.0.0.1",
            "watchdog_port": watchdog, "gate_port": gate if role == "master" else None,
            "token": KEY.decode(), "env_file": str(tmp / "env"), "cwd": str(tmp),
            "command": [sys.executable, str(tmp / "job.py"), progress, str(tmp / "release")],
            "log": str(tmp / f"{host}.log"), "state": str(tmp / "state.json"),
            "progress_file": progress, "max_restarts": 0,
            "timeouts": {"start": 20, "heartbeat": 0.5, "peer": 3, "stop": 2,
                         "restart": 8, "settle": 0.5, "stall_startup": 10, "stall_floor": 5,
                         "stall_factor": 5},
        }  # fmt: skip
        (tmp / "spec.json").write_text(json.dumps(spec))
        self.log = tmp / f"{host}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(TOOL), "run", "--spec", str(tmp / "spec.json")],
            start_new_session=True,
        )

    def state(self) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.tmp / "state.json").read_text())
        return {}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def release(self) -> None:
        (self.tmp / "release").touch()

    def ended(self, timeout: float = 30) -> dict:
        self.proc.wait(timeout=timeout)
        return self.state()

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.release()  # the command, if the agent did not end it


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    made: list[Agent] = []
    yield made
    for agent in made:
        agent.close()


# -- the fake worker: w, holding the key, against a live master ------------------------------
class FakeWorker:
    """w's side in this process: joins, beats every 0.3 s, and sends what the test gives it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.link: Link | None = None
        self.events: queue.Queue = queue.Queue()
        self.cuts = 0
        self.beating = True
        self.join(timeout=20)
        threading.Thread(target=self._beat, daemon=True).start()

    def join(self, timeout: float = 10) -> None:
        """Connect (again) until the master welcomes w."""
        deadline = time.monotonic() + timeout
        hello = {"host": "w", "rank": 1, "phase": "running", "attempt": 1}
        while True:
            link, why = connect("127.0.0.1", self.port, KEY, JOB, hello, master="m")
            if link is not None:
                self.link = link
                threading.Thread(target=read_uplink, args=(link, self.events), daemon=True).start()
                return
            assert time.monotonic() < deadline, why
            time.sleep(0.1)

    def _beat(self) -> None:
        while True:
            link = self.link
            if self.beating and link is not None:
                link.send({"t": "beat", "phase": "running", "attempt": 1})
            time.sleep(0.3)

    def send_and_rejoin(self, body: dict) -> None:
        """Send one sealed body; once the master cut the connection for it, join again."""
        link = self.link
        assert link is not None
        link.send(body)
        deadline = time.monotonic() + 5
        while not link.closed:
            assert time.monotonic() < deadline, f"the master kept the connection after {body}"
            time.sleep(0.01)
        self.cuts += 1
        self.join()


def test_a_live_master_cuts_a_key_holder_sending_malformed_messages_and_the_run_goes_on(
    tmp_path: Path, agents: list[Agent]
) -> None:
    port = free_port()
    master = Agent(tmp_path, "master", port)
    agents.append(master)
    worker = FakeWorker(port)
    for name, probe in ISSUE_PROBES.items():
        worker.send_and_rejoin(probe)
        assert master.alive(), name

    @fuzz(EXAMPLES)
    @given(body=bodies(list(messages.FROM_WORKER)))
    def one_body(body: dict) -> None:
        assume(malformed(body, from_master=False))
        worker.send_and_rejoin(body)
        assert master.alive(), master.log.read_text()

    started = time.monotonic()
    one_body()
    took = time.monotonic() - started
    assert master.state()["phase"] == "running", master.log.read_text()
    worker.link.send({"t": "exit", "attempt": 1, "exit_status": 0, "rank": 1})
    master.release()
    state = master.ended()
    log = master.log.read_text()
    print(f"{worker.cuts} connections cut in {took:.1f} s of examples")
    assert (state["phase"], state["restarts"]) == ("succeeded", []), log
    assert worker.cuts >= len(ISSUE_PROBES) + 1
    for said in (
        "exit message: attempt must be an integer",
        "no JSON in the frame",
        "exit message: errors must be a list",
        "idle message: checkpoints lacks path",
    ):
        assert said in log, log
    assert "an error" not in log, log


def test_a_reflected_beat_does_not_keep_a_silent_worker_alive(
    tmp_path: Path, agents: list[Agent]
) -> None:
    port = free_port()
    master = Agent(tmp_path, "master", port)
    agents.append(master)
    mine = FakeWorker(port)
    mine.beating = False
    # The master's own beats, as they reach w, sent back to it on w's connection.
    raw = mine.link
    assert raw is not None
    beat = {"t": "beat", "phase": "running", "attempt": 1}
    deadline = time.monotonic() + 8
    for seq in range(1000, 2000):
        if not master.alive() or time.monotonic() > deadline:
            break
        with contextlib.suppress(OSError):
            raw.sock.sendall(wire.seal(KEY, raw.recv_context, seq, beat))
        time.sleep(0.3)
    state = master.ended()
    log = master.log.read_text()
    assert state["phase"] == "failed", log
    assert (state["reason"]["node"], state["reason"]["kind"]) == ("w", "vanished"), log
    assert "stopped answering" in state["reason"]["message"]
    assert "bad mac from w" in log  # each reflected beat, counted


def test_the_watchdog_listens_on_the_masters_cluster_address_or_the_job_does_not_start(
    tmp_path: Path, agents: list[Agent]
) -> None:
    port = free_port()
    master = Agent(tmp_path, "master", port, master_address="192.0.2.1")  # not this machine's
    agents.append(master)
    state = master.ended(timeout=20)
    assert (state["phase"], state["reason"]["kind"]) == ("failed", "start")
    assert state["reason"]["message"] == (
        f"the watchdog cannot listen on 192.0.2.1:{port}: 192.0.2.1 is not an address of this "
        "node: set its cluster_address"
    )


# -- the fake master: m, against a live worker ---------------------------------------------------
class FakeMaster:
    """m's side in this process (a real Hub): welcomes w, starts attempt 1, beats."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.hub = Hub(self.server, KEY, JOB, "m", {"w": "127.0.0.1"})
        self.events: queue.Queue = queue.Queue()
        self.link: Link | None = None
        self.joins = 0
        self.heard: list[dict] = []
        self.hub.start(self.events)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        last = 0.0
        while True:
            with contextlib.suppress(queue.Empty):
                kind, link, body = self.events.get(timeout=0.1)
                if kind == "message" and body["t"] == "hello":
                    link.host = "w"
                    link.send({"t": "welcome", "phase": "running", "attempt": 1,
                               "nonce": body["nonce"]})  # fmt: skip
                    if not self.joins:
                        link.send({"t": "start", "attempt": 1})
                    self.link, self.joins = link, self.joins + 1
                elif kind == "message":
                    self.heard.append(body)
            if time.monotonic() - last > 0.3 and self.link is not None:
                last = time.monotonic()
                self.link.send({"t": "beat", "phase": "running", "attempt": 1})

    def send_and_wait_rejoin(self, body: dict) -> None:
        link, joins = self.link, self.joins
        assert link is not None
        link.send(body)
        deadline = time.monotonic() + 10
        while self.joins == joins:
            assert time.monotonic() < deadline, f"w did not come back after {body}"
            time.sleep(0.01)


def test_a_live_worker_cuts_a_master_sending_malformed_messages_and_the_run_goes_on(
    tmp_path: Path, agents: list[Agent]
) -> None:
    fake = FakeMaster()
    worker = Agent(tmp_path, "worker", fake.port)
    agents.append(worker)
    deadline = time.monotonic() + 20
    while worker.state().get("phase") != "running":
        assert time.monotonic() < deadline, worker.log.read_text()
        time.sleep(0.1)
    for name, probe in MASTER_PROBES.items():
        fake.send_and_wait_rejoin(probe)
        assert worker.alive(), name

    @fuzz(EXAMPLES)
    @given(body=bodies(list(messages.FROM_MASTER)))
    def one_body(body: dict) -> None:
        assume(malformed(body, from_master=True))
        fake.send_and_wait_rejoin(body)
        assert worker.alive(), worker.log.read_text()

    one_body()
    assert worker.state()["phase"] == "running", worker.log.read_text()
    worker.release()
    deadline = time.monotonic() + 20
    while not any(b["t"] == "exit" for b in fake.heard):
        assert time.monotonic() < deadline, worker.log.read_text()
        time.sleep(0.1)
    assert fake.link is not None
    fake.link.send({"t": "final", "phase": "succeeded", "reason": None})
    state = worker.ended()
    log = worker.log.read_text()
    assert (state["phase"], state["restarts"], state["exit_status"]) == ("succeeded", [], 0), log
    assert "cut the master's connection (start message: attempt must be" in log, log
    assert "an error" not in log, log


# -- hellos and the addresses of the inventory ----------------------------------------------------
PEERS = {f"n{i}": f"127.0.0.{i + 1}" for i in range(1, 16)}  # 15 workers, 127.0.0.2 to .16


@pytest.fixture
def hub() -> Iterator[tuple[Hub, int, queue.Queue]]:
    server = socket.create_server(("127.0.0.1", 0))
    found = Hub(server, KEY, JOB, "m", PEERS)
    events: queue.Queue = queue.Queue()
    found.start(events)

    def welcome() -> None:
        while True:
            kind, link, body = events.get()
            if kind == "message" and body["t"] == "hello":
                link.host = body["host"]
                link.send({"t": "welcome", "phase": "starting", "attempt": 1,
                           "nonce": body["nonce"]})  # fmt: skip

    threading.Thread(target=welcome, daemon=True).start()
    yield found, server.getsockname()[1], events
    server.close()


def _join(port: int, host: str, as_host: str = "") -> tuple[Link | None, str]:
    """A worker's join from `host`'s address, as `as_host` (itself unless given)."""
    hello = {"host": as_host or host, "rank": 1, "phase": "waiting", "attempt": 1}
    return connect("127.0.0.1", port, KEY, JOB, hello, master="m", source=PEERS[host])


def _hello_from(port: int, source: str, sender: str, host: str) -> None:
    """A hello naming `host`, sealed as `sender`'s, from `source`: the Hub closes it."""
    with socket.create_connection(("127.0.0.1", port), 5, (source, 0)) as sock:
        line = sock.makefile("rb").readline()
        _seq, challenge = wire.unseal(KEY, wire.context(JOB, "", "m", "n1"), line, 0)
        hello = {"t": "hello", "host": host, "rank": 1, "phase": "waiting", "nonce": "0" * 32}
        sock.sendall(wire.seal(KEY, wire.context(JOB, challenge["nonce"], sender, "m"), 1, hello))
        assert sock.recv(100) == b"", "the Hub kept a connection that named another host"


def test_a_hello_is_taken_only_from_the_address_the_inventory_gives_that_host(hub) -> None:
    found, port, _events = hub
    # n2's name from n1's address: sealed as n1's (the mac holds), or as n2's (it does not).
    _hello_from(port, PEERS["n1"], "n1", "n2")
    _hello_from(port, PEERS["n1"], "n2", "n2")
    refused = found.take_refused()
    assert refused == {"a hello naming n2 from n1's address": 1, "bad mac": 1}, refused
    link, why = _join(port, "n2", as_host="n1")  # a worker that takes itself for n1, at n2's
    assert (link, "did not authenticate: bad mac" in why) == (None, True), why
    # From an address that is no node's: turned away before any challenge, and told so.
    hello = {"host": "n1", "rank": 1, "phase": "waiting", "attempt": 1}
    link, why = connect("127.0.0.1", port, KEY, JOB, hello, master="m", source="127.0.0.100")
    assert link is None
    assert why == "rejected: 127.0.0.100 is the cluster_address of no node of this job"
    link, why = _join(port, "n1")
    assert link is not None, why


def test_a_connection_flood_never_pushes_out_a_genuine_join(hub) -> None:
    _found, port, _events = hub
    stop = threading.Event()
    flooded = [0]

    def flood(source: str) -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(("127.0.0.1", port), 5, (source, 0)))
                flooded[0] += 1
            for sock in held[:-200]:
                sock.close()
            held = held[-200:]
        for sock in held:
            sock.close()

    # Idle connections from every node's own address, and a flood from addresses of no node.
    idle = [
        socket.create_connection(("127.0.0.1", port), 5, (address, 0))
        for address in PEERS.values()
        for _ in range(8)
    ]
    threads = [
        threading.Thread(target=flood, args=(source,), daemon=True)
        for source in ("127.0.0.1", "127.0.0.200")
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while flooded[0] < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    with concurrent.futures.ThreadPoolExecutor(len(PEERS)) as pool:
        joined = list(pool.map(lambda host: _join(port, host), PEERS))
    stop.set()
    for thread in threads:
        thread.join()
    for sock in idle:
        sock.close()
    missing = [host for host, (link, _why) in zip(PEERS, joined, strict=True) if link is None]
    print(f"{flooded[0]} flood connections; joins missing: {missing}")
    assert flooded[0] >= 50
    assert missing == [], [why for _link, why in joined]
