"""check.yml's servers against hostile bytes: the link server (llama.cluster.llama_links,
mode serve, root on each node's measured addresses during the check) and the master port's
listener (roles/preflight/files/listener.py, on the master's cluster address), each on a real
socket in this process.

The link server serves connections side by side: a line is at most LINE_MAX bytes and a
connection has HANDSHAKE_S seconds to prove it holds the check's key, at most MAX_WAITING wait
to do so (the oldest goes); anything else is answered `error <why>`, closed and counted, and the
server goes on. The figures are what the measuring
side itself received and timed. hypothesis throws thousands of hostile requests at the server
(a genuine peer is measured after each) and hostile answers at the measuring side; the probes
of issue 40 (`ping abc`, a forged byte count, 8 MiB without a newline) are explicit cases.
"""

from __future__ import annotations

import contextlib
import json
import runpy
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.modules import llama_links
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.llama_job.test_watchdog_port import fuzz, serve_each
from tests.unit.llama_job.test_watchdog_port import read_line as _line

ROOT = Path(__file__).resolve().parents[3]
LISTENER = ROOT / "roles" / "preflight" / "files" / "listener.py"
KEY = b"this check's secret"
# Hostile connections to the server, then hostile servers to the measuring side.
SERVER_EXAMPLES = 1500
CLIENT_EXAMPLES = 1000
# The old server's reply after the stream: a byte count, here the one that made 159,878 Gbit/s.
FORGED_COUNT = b"%d\n" % (159_878 * 10**9 // 8)


class Server:
    """A LinkServer on 127.0.0.1, serving in a thread until closed."""

    def __init__(self, connections: int = 10**9) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.links = llama_links.LinkServer(self.sock, KEY)
        deadline = time.monotonic() + 600
        self.thread = threading.Thread(
            target=self.links.serve, args=(connections, deadline), daemon=True
        )
        self.thread.start()

    def measure(self, key: bytes = KEY, timeout: float = 10) -> dict:
        return llama_links.measure(
            "127.0.0.1", self.port, key, seconds=0.002, pings=2, timeout=timeout
        )

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept: the server's life ends
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.sock.close()


@pytest.fixture
def server() -> Iterator[Server]:
    found = Server()
    yield found
    found.close()


def _authenticated(sock: socket.socket) -> None:
    """The client's half of the handshake, with the key."""
    theirs = _line(sock).split()[-1]
    nonce = b"c" * 32
    sock.sendall(b"hello %s %s\n" % (nonce, llama_links.proof(KEY, b"client", theirs, nonce)))
    assert _line(sock).startswith(b"welcome ")


def _answer(port: int, request: bytes, authenticate: bool = False) -> bytes:
    """What the server answers `request` with, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if authenticate:
            _authenticated(sock)
        else:
            _line(sock)  # its greeting
        sock.sendall(request)
        return _line(sock)


# -- issue 40's probes ---------------------------------------------------------------------------
def test_ping_abc_is_answered_and_the_server_keeps_measuring(server: Server) -> None:
    assert _answer(server.port, b"ping abc\n") == b"error not a hello\n"
    assert _answer(server.port, b"ping abc\n", authenticate=True) == b"error not ping <1-1000>\n"
    assert _answer(server.port, b"ping 99999\n", authenticate=True).startswith(b"error ")
    assert server.measure()["bytes"] > 0
    assert server.links.served == 1
    assert server.links.refused["not a hello"] == 1
    assert server.links.refused["not ping <1-1000>"] == 2


def test_a_line_without_its_end_is_cut_off_at_once_and_a_slow_one_in_seconds(
    server: Server,
) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        with contextlib.suppress(OSError):  # reset once the server has cut it off
            for _ in range(8):
                sock.sendall(bytes(1 << 20))  # 8 MiB, no newline
        with contextlib.suppress(OSError):
            _line(sock)  # the greeting and the error, unless the reset came first
    assert time.monotonic() - started < 2
    started = time.monotonic()
    with (
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
        contextlib.suppress(OSError),
    ):
        for _ in range(20):  # a byte every 0.5 s: within LINE_MAX, past HANDSHAKE_S
            sock.sendall(b"h")
            time.sleep(0.5)
    assert time.monotonic() - started < 15
    assert server.measure()["bytes"] > 0
    assert server.links.refused[f"a line over {llama_links.LINE_MAX} bytes"] == 1
    assert server.links.refused["too slow"] == 1


class FakeLinkServer:
    """A link server that answers every connection with `answer(conn)`, then closes."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=serve_each, args=(self.sock, answer), daemon=True).start()

    def measure(self, timeout: float = 5) -> dict:
        return llama_links.measure(
            "127.0.0.1", self.port, KEY, seconds=0.05, pings=3, timeout=timeout
        )


def _server_side(conn: socket.socket, key: bytes) -> bytes:
    """A server's handshake with `key` (the client's nonce back)."""
    nonce = b"a" * 32
    conn.sendall(b"llama-links 1 %s\n" % nonce)
    theirs = _line(conn).split()[1]
    conn.sendall(b"welcome %s\n" % llama_links.proof(key, b"server", theirs, nonce))
    return theirs


def _forger(key: bytes) -> Callable[[socket.socket], None]:
    def answer(conn: socket.socket) -> None:
        _server_side(conn, key)
        assert _line(conn) == b"ping 3\n"
        for _ in range(3):
            conn.sendall(conn.recv(1))
        _line(conn)  # stream <seconds>
        conn.sendall(FORGED_COUNT)  # what the old server answered, forged

    return answer


def test_a_forged_byte_count_never_becomes_a_figure() -> None:
    # Even a server that holds the key cannot claim a figure: the figure is the zeros that
    # arrived here, over the time measured here, and a count in their place is no stream.
    with pytest.raises(llama_links.Refused, match="it sent no stream"):
        FakeLinkServer(_forger(KEY)).measure()
    # One without the key is not measured at all.
    with pytest.raises(llama_links.Refused, match="does not prove this check's key"):
        FakeLinkServer(_forger(b"guess")).measure()


def test_a_server_of_the_old_protocol_or_an_echo_is_no_link_server() -> None:
    with pytest.raises(llama_links.Refused, match="too slow"):
        FakeLinkServer(lambda conn: time.sleep(2)).measure(timeout=0.5)  # waits for `ping N`
    with pytest.raises(llama_links.Refused, match="not a link server's greeting"):
        FakeLinkServer(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")).measure()

    def echo_another_byte(conn: socket.socket) -> None:
        _server_side(conn, KEY)
        _line(conn)
        conn.sendall(b"\x00\x01\x02")

    with pytest.raises(llama_links.Refused, match=r"echoed another byte|bytes nobody asked"):
        FakeLinkServer(echo_another_byte).measure()


def test_probes_and_strangers_are_refused_and_never_count_as_measured() -> None:
    port_holder = socket.create_server(("127.0.0.1", 0))
    port = port_holder.getsockname()[1]
    port_holder.close()
    result: list[llama_links.LinkServer] = []
    thread = threading.Thread(
        target=lambda: result.append(llama_links.serve(port, 1, 30, KEY, ["127.0.0.1"]))
    )
    thread.start()
    probes = 0
    for _ in range(200):  # until it listens, then 10 more: each a probe that sends nothing
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            probes += 1
        if probes == 10:
            break
        time.sleep(0.05 if not probes else 0)
    wrong = b"hello %s %s\n" % (b"c" * 32, b"0" * 64)
    assert _answer(port, wrong) == b"error not this check's key\n"
    found = llama_links.measure("127.0.0.1", port, KEY, seconds=0.2, pings=5, timeout=10)
    thread.join(timeout=30)
    assert result[0].served == 1  # it ended after the genuine measurement, not the probes
    assert result[0].refused["not this check's key"] == 1
    assert sum(result[0].refused.values()) == probes + 1
    assert found["tcp_gbps"] == pytest.approx(found["bytes"] * 8 / found["seconds"] / 1e9, rel=0.01)
    assert 0 < found["rtt_ms"] < 50


# -- fuzzing the server --------------------------------------------------------------------------
WORDS = st.sampled_from([b"ping", b"stream", b"hello", b"welcome", b"llama-links", b"error", b""])
ARGUMENTS = st.one_of(
    st.binary(max_size=80),
    st.integers().map(lambda n: b"%d" % n),
    st.floats(allow_nan=True).map(lambda x: repr(x).encode()),
    st.sampled_from([b"abc", b"0", b"-1", b"1e308", b"nan", b"inf", b"99", b"60.0000001"]),
    st.text().map(lambda text: text.encode("utf-8", "surrogatepass")),
)
REQUESTS = st.one_of(
    st.binary(max_size=4096),
    st.builds(lambda w, a, b: w + b" " + a + b" " + b + b"\n", WORDS, ARGUMENTS, ARGUMENTS),
    st.builds(lambda w, a: w + b" " + a + b"\n", WORDS, ARGUMENTS),
    st.integers(llama_links.LINE_MAX - 2, 1 << 16).map(lambda n: b"ping " + b"1" * n + b"\n"),
    st.binary(min_size=32, max_size=32).map(lambda b: b"hello %s %s\n" % (b[:16].hex().encode(),
                                                                           (b * 2).hex().encode())),
)  # fmt: skip


def test_no_request_stops_the_server_from_measuring_a_genuine_peer(server: Server) -> None:
    measured = 0

    @fuzz(SERVER_EXAMPLES)
    @given(requests=st.lists(REQUESTS, min_size=1, max_size=4), authenticate=st.booleans())
    def one_connection(requests: list[bytes], authenticate: bool) -> None:
        nonlocal measured
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            if authenticate:  # a peer that holds the key and then sends junk
                _authenticated(sock)
            with contextlib.suppress(OSError):  # it may cut the connection off first
                sock.sendall(b"".join(requests))
        assert server.measure()["bytes"] > 0
        measured += 1

    one_connection()
    refused = server.links.refused
    print(f"refused {sum(refused.values())}: {refused.most_common(12)}")
    assert server.links.served >= measured >= SERVER_EXAMPLES
    assert not [why for why in refused if "an error" in why], refused
    assert refused["not a hello"], refused
    assert refused["closed the connection"], refused


# -- fuzzing the measuring side ------------------------------------------------------------------
ANSWERS = st.one_of(
    st.binary(max_size=4096),
    st.builds(lambda w, a: w + b" " + a + b"\n", WORDS, ARGUMENTS),
    st.just(FORGED_COUNT),
    st.integers(0, 1 << 16).map(bytes),  # a stream of zeros, of any length
)


def test_a_hostile_server_gets_a_refusal_or_a_figure_of_what_arrived_never_an_exception() -> None:
    answers: list[tuple[str, bytes]] = []

    def answer(conn: socket.socket) -> None:
        """`data` as the greeting, as the welcome, or as the stream after a genuine handshake."""
        stage, data = answers.pop()
        nonce = b"a" * 32
        if stage != "greeting":
            conn.sendall(b"llama-links 1 %s\n" % nonce)
            theirs = _line(conn).split()[1]
            if stage == "stream":
                conn.sendall(b"welcome %s\n" % llama_links.proof(KEY, b"server", theirs, nonce))
                _line(conn)  # ping 3
                for _ in range(3):
                    conn.sendall(conn.recv(1))
                _line(conn)  # stream <seconds>
        conn.sendall(data)

    fake = FakeLinkServer(answer)

    @fuzz(CLIENT_EXAMPLES)
    @given(stage=st.sampled_from(["greeting", "welcome", "stream"]), data=ANSWERS)
    def one_server(stage: str, data: bytes) -> None:
        answers.append((stage, data))
        try:
            found = fake.measure(timeout=2)
        except (llama_links.Refused, OSError):
            return
        assert stage == "stream"  # only a server with the key is measured
        assert data == bytes(len(data))  # ... and only a stream of zeros
        assert found["bytes"] == len(data)  # what arrived, nothing it claimed

    one_server()


# -- the master port's listener -------------------------------------------------------------------
def test_strangers_never_end_the_listener_before_the_workers_came() -> None:
    listen = runpy.run_path(str(LISTENER))["listen"]  # the script's own function
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    found: list[dict] = []
    thread = threading.Thread(target=lambda: found.append(listen(sock, ["127.0.0.1"], 30)))
    thread.start()
    for junk in (b"", b"ping abc\n", bytes(1 << 16), "\ud800".encode("utf-8", "surrogatepass")):
        for _ in range(10):  # from another address than the worker's
            with (
                socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0)) as s,
                contextlib.suppress(OSError),
            ):
                s.sendall(junk)
    time.sleep(0.3)
    assert thread.is_alive()
    socket.create_connection(("127.0.0.1", port)).close()  # the worker
    thread.join(timeout=10)
    sock.close()
    assert found == [{"peers": ["127.0.0.1"], "missing": [], "others": 40}]


def test_the_listener_names_the_workers_that_did_not_come(tmp_path: Path) -> None:
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    state = tmp_path / "state"
    ran = subprocess.run(
        [sys.executable, str(LISTENER), "--address", "127.0.0.1", "--port", str(port),
         "--peers", "10.0.0.2,10.0.0.3",
         "--timeout", "0.5", "--state-file", str(state)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert state.read_text() == "ready\n"
    assert json.loads(ran.stdout) == {
        "port": port,
        "peers": [],
        "missing": ["10.0.0.2", "10.0.0.3"],
        "others": 0,
    }


# -- issue 45: several connections at once, on the given addresses only --------------------------
def test_fifty_idle_keyless_connections_never_keep_a_peer_with_the_key_out(server: Server) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(50)]
    started = time.monotonic()
    found = server.measure(timeout=5)
    took = time.monotonic() - started
    print(f"measured beside 50 idle connections in {took:.2f} s")
    assert found["bytes"] > 0
    assert took < 2.5  # one idle connection alone used to hold the server for 3 s
    for sock in idle:
        sock.close()
    assert server.links.refused["too many connections waiting to authenticate"] >= 18


def test_the_link_server_listens_on_its_addresses_only_and_names_one_it_cannot(
    tmp_path: Path,
) -> None:
    holder = socket.create_server(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    with pytest.raises(llama_links.Refused, match=rf"cannot listen on 192.0.2.1:{port}"):
        llama_links.serve(port, 1, 5, KEY, ["127.0.0.2", "192.0.2.1"])
    found: list[llama_links.LinkServer] = []
    thread = threading.Thread(
        target=lambda: found.append(llama_links.serve(port, 1, 30, KEY, ["127.0.0.2"]))
    )
    thread.start()
    time.sleep(0.5)
    with pytest.raises(ConnectionRefusedError):  # not on another address of this machine
        socket.create_connection(("127.0.0.1", port), timeout=5)
    assert llama_links.measure("127.0.0.2", port, KEY, seconds=0.05, pings=2, timeout=10)
    thread.join(timeout=30)
    assert found[0].served == 1
    ran = subprocess.run(
        [sys.executable, str(LISTENER), "--address", "192.0.2.1", "--port", str(port),
         "--timeout", "1", "--state-file", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert ran.returncode == 2
    assert (tmp_path / "state").read_text().startswith(f"error: 192.0.2.1:{port}: ")
