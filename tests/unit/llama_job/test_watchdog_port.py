"""The watchdog port (llama-job's link.py and wire.py) against hostile bytes, in
this process: a real Hub on a real socket (the master's side) and the worker's handshake and
reader, thrown thousands of hostile frames by hypothesis.

What is proved, example by example: whatever a connection sends (arbitrary bytes, deep
nesting, bad encodings, frames of the older JSON format, frames sealed with another key, and
frames sealed with the job's own key around bodies that are no message), the Hub drops that
connection and counts why, never raises, and a genuine worker completes its handshake right
after; the worker's side returns a refusal (never an exception) from a watchdog that is not
its master and keeps reading its master's messages around lines that do not verify. The
issue's three probes (issue 40) are kept as explicit cases, on both sides.
tests/unit/llama_job/test_llama_job_link.py sends them to real agent processes while a job runs.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import wire
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.link import (
    Hub,
    Link,
    connect,
    read_uplink,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.llama_job.test_llama_job_link import ISSUE_PROBES

KEY = b"the job's secret"
JOB = "train-20261205-120000-tiny"
FIRST = wire.context(JOB, "", "m", "w")  # the master's challenge to w
HELLO = {"host": "w", "rank": 1, "phase": "waiting", "attempt": 1}
# Examples per property (each is one hostile connection, then one genuine handshake).
HUB_EXAMPLES = 2000
WORKER_EXAMPLES = 1000
FRAME_EXAMPLES = 5000


def fuzz(examples: int) -> settings:
    """Hypothesis's settings here: `examples` cases; no example database (a failure prints its
    case, nothing is replayed from an earlier run); no deadline (socket round trips on a
    loaded 2-core machine)."""
    return settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def read_line(sock: socket.socket) -> bytes:
    """One line, read a byte at a time (what follows it stays in the socket); less at the end."""
    data = b""
    while not data.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            break
        data += byte
    return data


def serve_each(server: socket.socket, answer: Callable[[socket.socket], None]) -> None:
    """Accept on `server` until it is closed, answering each connection in turn: whatever an
    answer raises (the peer went away, or sent what it did not expect) ends that one only."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn, contextlib.suppress(Exception):
            conn.settimeout(5)
            answer(conn)


def raw_frame(key: bytes, context: str, seq: bytes, body: bytes) -> bytes:
    """A line of the wire's shape around any body, with the mac that key gives it."""
    return b"%s %s %s\n" % (seq, wire._mac(key, context, seq, body), body)


# -- hostile input ------------------------------------------------------------------------------
def _old_frame(fields: dict) -> bytes:
    return json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"


NESTED = st.builds(
    lambda opener, depth, tail: opener * depth + tail,
    st.sampled_from([b"[", b"{", b'{"a":', b'[{"t":']),
    st.integers(1, 20000),
    st.sampled_from([b"", b"\n", b"]" * 3 + b"\n"]),
)
SURROGATE_TEXT = st.text(
    alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters()
)
OLD_FRAMES = st.fixed_dictionaries(
    {
        "seq": st.one_of(st.integers(), st.text(max_size=8), st.none()),
        "body": st.one_of(SURROGATE_TEXT, st.just("\ud800"), st.integers()),
        "mac": st.one_of(SURROGATE_TEXT, st.just("\u00e9"), st.binary().map(bytes.hex)),
    }
).map(_old_frame) | st.builds(  # the older llama-job's own frames
    lambda seq, body, mac: json.dumps({"seq": seq, "body": body, "mac": mac}).encode() + b"\n",
    st.integers(0, 10**6),
    st.text(max_size=40),
    st.binary(min_size=32, max_size=32).map(bytes.hex),
)
WIRE_SEQ = st.one_of(st.integers(0, 10**18).map(lambda n: b"%d" % n), st.binary(max_size=20))
# Bodies a peer holding the key could seal: deep, badly encoded, not an object, not a message.
BODIES = st.one_of(
    NESTED.map(lambda b: b.rstrip(b"\n")),
    st.just(b'{"t":"\\ud800"}'),
    st.just(b'{"t":"beat","x":"\\udfff\\ud800"}'),
    st.binary(max_size=300).map(lambda b: b"{" + b.replace(b"\n", b"") + b"}"),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=20,
    ).map(lambda v: json.dumps(v).encode()),
)


def hostile_lines(context: str, keyed: bool = True) -> st.SearchStrategy[bytes]:
    """What one hostile connection sends (`context`: its connection's job:nonce); `keyed`:
    some frames sealed with the job's own key too (a peer that holds it, sending junk)."""
    keys = st.sampled_from([b"guess", KEY] if keyed else [b"guess"])
    hex_mac = st.binary(min_size=32, max_size=32).map(lambda b: b.hex().encode())
    return st.one_of(
        st.binary(max_size=4096),
        NESTED,
        SURROGATE_TEXT.map(lambda text: text.encode("utf-8", "surrogatepass") + b"\n"),
        OLD_FRAMES,
        # the wire's shape, any mac
        st.builds(
            lambda seq, mac, body: b"%s %s %s\n" % (seq, mac, body),
            WIRE_SEQ,
            st.binary(max_size=70) | hex_mac,
            BODIES,
        ),
        # a hello sealed for another connection or job, or with another key
        st.builds(
            lambda key, other, seq: wire.seal(key, other, seq, {**HELLO, "t": "hello"}),
            keys,
            st.sampled_from([context, f"{JOB}:other", "another-job"]),
            st.integers(0, 5),
        ),
        # sealed with the right key or not, around a body that is no message
        st.builds(
            lambda key, seq, body: raw_frame(key, context, seq, body), keys, WIRE_SEQ, BODIES
        ),
    )


# -- the master's side: a Hub on a real socket ---------------------------------------------------
class Master:
    """A Hub on 127.0.0.1 with a stand-in for the master's agent that welcomes every hello
    (as MasterAgent.peer_hello does), in threads of this process."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.hub = Hub(self.server, KEY, JOB, "m", {"w": "127.0.0.1"})
        self.events: queue.Queue = queue.Queue()
        self.hub.start(self.events)
        self.refused: Counter[str] = Counter()
        self.hellos = 0
        threading.Thread(target=self._welcome, daemon=True).start()

    def _welcome(self) -> None:
        while True:
            kind, link, body = self.events.get()
            if kind == "message" and body.get("t") == "hello":
                self.hellos += 1
                link.host = body.get("host")
                link.send({"t": "welcome", "phase": "running", "attempt": 1,
                           "nonce": body.get("nonce")})  # fmt: skip

    def genuine_worker_joins(self) -> bool:
        link, why = connect("127.0.0.1", self.port, KEY, JOB, HELLO, master="m")
        assert link is not None, why
        link.close()
        link.sock.close()
        return True

    def take_refused(self) -> Counter[str]:
        self.refused.update(self.hub.take_refused())
        return self.refused

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def master() -> Iterator[Master]:
    found = Master()
    yield found
    found.close()


def _challenge(sock: socket.socket) -> str:
    """The master's challenge nonce on a new connection (its first line)."""
    return wire.unseal(KEY, FIRST, read_line(sock), 0)[1]["nonce"]


def _send(port: int, data: bytes, read_challenge: bool) -> None:
    """One hostile connection: send, then close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if read_challenge:
            _challenge(sock)
        with contextlib.suppress(OSError):  # the master may cut it off first
            sock.sendall(data)


@pytest.mark.parametrize("probe", ISSUE_PROBES.values(), ids=ISSUE_PROBES.keys())
def test_the_issue_probes_leave_the_hub_serving(master: Master, probe: bytes) -> None:
    for read_challenge in (False, True):
        _send(master.port, probe, read_challenge)
        assert master.genuine_worker_joins()
    refused = master.take_refused()
    assert not [why for why in refused if "an error" in why], refused


def test_no_bytes_stop_the_hub_from_welcoming_a_genuine_worker(master: Master) -> None:
    @fuzz(HUB_EXAMPLES)
    @given(data=st.data(), read_challenge=st.booleans())
    def one_connection(data: st.DataObject, read_challenge: bool) -> None:
        with socket.create_connection(("127.0.0.1", master.port), timeout=5) as sock:
            context = FIRST
            if read_challenge:
                context = wire.context(JOB, _challenge(sock), "w", "m")
            lines = data.draw(st.lists(hostile_lines(context), min_size=1, max_size=4))
            with contextlib.suppress(OSError):  # the master may cut it off first
                sock.sendall(b"".join(lines))
        assert master.genuine_worker_joins()

    one_connection()
    # Every hostile connection was refused for a reason the framing names; none needed the
    # last-resort guard (wire.unseal raised nothing but BadMessage).
    refused = master.take_refused()
    print(f"refused {sum(refused.values())}: {refused.most_common(12)}")
    assert master.hellos >= HUB_EXAMPLES  # every genuine worker was welcomed
    assert not [why for why in refused if "an error" in why], refused
    for why in ("not a frame", "bad mac", "a frame of an older llama-job"):
        assert refused[why], refused


# -- the framing itself -------------------------------------------------------------------------
@fuzz(FRAME_EXAMPLES)
@given(line=st.one_of(st.binary(max_size=2048), NESTED, OLD_FRAMES, hostile_lines(JOB)))
def test_unseal_raises_nothing_but_bad_message(line: bytes) -> None:
    with contextlib.suppress(wire.BadMessage):
        _seq, body = wire.unseal(KEY, JOB, line, 0)
        assert isinstance(body, dict)
        assert isinstance(body["t"], str)
        json.dumps(body, ensure_ascii=False).encode()  # writable: no lone surrogate


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"t":"beat","x":' + b"[" * 5000 + b"]" * 5000 + b"}", "nested deeper than 32"),
        (b'{"t":' + b"[" * 40 + b"]" * 40 + b"}", "nested deeper than 32"),
        (b'{"t":"\\ud800"}', "no JSON in the frame"),
        (b'{"t":"beat","x":"\xe9"}', "no JSON in the frame"),  # not ASCII
        (b"{not json}", "no JSON in the frame"),
        (b'{"t":1}', "no message in the frame"),
    ],
)
def test_a_frame_sealed_with_the_key_around_no_message_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(wire.BadMessage, match=why):
        wire.unseal(KEY, JOB, raw_frame(KEY, JOB, b"1", body), 0)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    body = {"t": "exit", "errors": ["[rank0]: " + "[" * 200]}
    assert wire.unseal(KEY, JOB, wire.seal(KEY, JOB, 1, body), 0) == (1, body)


def test_the_mac_is_checked_before_the_body_is_parsed() -> None:
    # The same deep body: without the key's mac it is refused as forged, unparsed.
    line = raw_frame(b"guess", JOB, b"1", b'{"t":' + b"[" * 5000 + b"}")
    with pytest.raises(wire.BadMessage, match="bad mac"):
        wire.unseal(KEY, JOB, line, 0)


# -- the worker's side: a watchdog that is not its master, and its master's line ----------------
class FakeWatchdog:
    """A server that answers each connection with what the test gives it, then closes."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=serve_each, args=(self.server, self._answer), daemon=True).start()

    def _answer(self, sock: socket.socket) -> None:
        first, then = self.replies.get()
        sock.sendall(first)
        if then and sock.recv(65536):  # the worker's hello
            sock.sendall(then)


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeWatchdog]:
    found = FakeWatchdog()
    yield found
    found.server.close()


@pytest.mark.parametrize("probe", ISSUE_PROBES.values(), ids=ISSUE_PROBES.keys())
def test_the_issue_probes_from_a_fake_master_are_a_refusal(
    fake: FakeWatchdog, probe: bytes
) -> None:
    challenge = wire.seal(KEY, FIRST, 1, {"t": "challenge", "nonce": "c" * 32})
    for first, then in ((probe, b""), (challenge, probe)):
        fake.replies.put((first, then))
        link, why = connect("127.0.0.1", fake.port, KEY, JOB, HELLO, master="m")
        assert link is None
        assert "did not authenticate" in why


@fuzz(WORKER_EXAMPLES)
@given(data=st.data(), after_challenge=st.booleans())
def test_a_watchdog_that_is_not_the_master_gets_a_refusal_never_an_exception(
    fake: FakeWatchdog, data: st.DataObject, after_challenge: bool
) -> None:
    context = wire.context(JOB, "c" * 32, "m", "w")
    hostile = b"".join(data.draw(st.lists(hostile_lines(context), max_size=3)))
    if after_challenge:
        challenge = wire.seal(KEY, FIRST, 1, {"t": "challenge", "nonce": "c" * 32})
        fake.replies.put((challenge, hostile or b"\n"))
    else:
        fake.replies.put((hostile or b"\n", b""))
    link, why = connect("127.0.0.1", fake.port, KEY, JOB, HELLO, master="m")
    assert link is None, "a watchdog without the job's welcome was taken for the master"
    assert why


@fuzz(WORKER_EXAMPLES)
@given(data=st.data())
def test_the_workers_reader_keeps_its_masters_messages_around_hostile_lines(
    data: st.DataObject,
) -> None:
    context = wire.context(JOB, "c", "m", "w")
    mine, theirs = socket.socketpair()
    master = Link(mine, KEY, JOB, from_master=False)
    worker = Link(theirs, KEY, JOB, from_master=True)
    master.send_context = worker.recv_context = context
    hostile = data.draw(st.lists(hostile_lines(context, keyed=False), max_size=4))
    hostile = [line if line.endswith(b"\n") else line + b"\n" for line in hostile]
    hostile = [line for line in hostile if len(line) <= wire.MAX_LINE]
    events: queue.Queue = queue.Queue()
    reader = threading.Thread(target=read_uplink, args=(worker, events))
    reader.start()
    master.send({"t": "beat", "phase": "running", "attempt": 1})
    mine.sendall(b"".join(hostile))
    master.send({"t": "start", "attempt": 1})
    mine.shutdown(socket.SHUT_WR)
    reader.join(timeout=10)
    got = []
    while not events.empty():
        got.append(events.get())
    kinds = [(kind, (body or {}).get("t")) for kind, _link, body in got]
    assert kinds == [("message", "beat"), ("message", "start"), ("eof", None)], kinds
    assert not [why for why in worker.dropped if "an error" in why], worker.dropped
    mine.close()


def test_a_worker_reader_ends_with_eof_even_when_its_handling_fails() -> None:
    mine, theirs = socket.socketpair()
    worker = Link(theirs, KEY, JOB, from_master=True)
    worker.recv_context = JOB

    class Broken(queue.Queue):
        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            if item[0] == "message":
                raise RuntimeError("a handler's bug")
            super().put(item, block, timeout)

    events = Broken()
    mine.sendall(wire.seal(KEY, JOB, 1, {"t": "beat", "phase": "running"}))
    started = time.monotonic()
    read_uplink(worker, events)
    assert time.monotonic() - started < 5
    assert events.get_nowait()[0] == "eof"
    assert worker.dropped == Counter({"an error reading it (RuntimeError)": 1})
    mine.close()
