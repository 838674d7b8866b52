"""The watchdog port: authenticated connections between the master's runner and its workers.

Everything a peer sends is hostile until authenticated. The handshake (protocol.py frames):

    master -> worker   challenge {nonce: C}              context: the job id
    worker -> master   hello {host, rank, phase, attempt, nonce: W}   context: job:C
    master -> worker   welcome {phase, attempt, nonce: W}              context: job:C

and every later message on that connection is sealed under job:C with a sequence number above
the last one, so a message of another connection, or one sent again, does not verify; the
worker knows the master by its answer to W. The master reads every connection in one thread
(a selector): a line is at most wire.MAX_LINE bytes, a connection that has not said hello
within wire.HELLO_WITHIN seconds is closed, and at most max(4, 2 x peers) connections wait
for their hello at once (the oldest one goes when another comes).

Whatever a connection sends ends that connection at worst, never the reader: wire.unseal
checks a line's length, shape and mac on its raw bytes before any JSON is parsed and raises
nothing but BadMessage; anything else one connection's handling raises drops that connection
and is counted with what was refused (the master's log says it every master.REFUSALS_EVERY seconds).
The worker's reader (read_uplink) and handshake (connect) hold to the same rule against a
watchdog that is not its master.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import selectors
import socket
import threading
import time
from collections import Counter
from typing import Any

from .wire import HELLO_WITHIN, MAX_LINE, BadMessage, Kind, seal, unseal

SEND_TIMEOUT = 5.0  # a peer that does not read for this long is cut off


class Rejected(BadMessage):
    """The master's answer to a hello: this node is not one of the job's."""


class Link:
    """One TCP connection carrying sealed messages, one per line."""

    def __init__(self, sock: socket.socket, key: bytes, job: str) -> None:
        self.sock = sock
        self.key = key
        self.context = job  # job:C once the challenge C is known
        self.job = job
        self.sent = 0
        self.received = 0
        self.buffer = bytearray()
        self.lock = threading.Lock()
        self.closed = False
        self.host: str | None = None  # the peer, once the master has accepted its hello
        self.verified = False  # its hello (or the master's welcome) verified
        self.opened = time.monotonic()
        self.nonce = secrets.token_hex(16)
        self.backlog: list[bytes] = []  # lines read during the handshake, not yet handled
        self.dropped: Counter[str] = Counter()  # messages that did not verify, by why
        self.welcome: dict[str, Any] = {}
        sock.settimeout(SEND_TIMEOUT)

    def lines(self, data: bytes) -> list[bytes] | None:
        """The complete lines in what arrived; None when a line outgrows MAX_LINE."""
        self.buffer += data
        found = []
        while True:
            end = self.buffer.find(b"\n")
            if end < 0:
                break
            if end + 1 > MAX_LINE:
                return None
            found.append(bytes(self.buffer[: end + 1]))
            del self.buffer[: end + 1]
        return None if len(self.buffer) > MAX_LINE else found

    def open(self, line: bytes) -> dict[str, Any]:
        """A message of this connection (BadMessage: forged, replayed, malformed)."""
        seq, body = unseal(self.key, self.context, line, self.received)
        self.received = seq
        return body

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the connection is gone."""
        if self.closed:
            return False
        with self.lock:
            self.sent += 1
            try:
                self.sock.sendall(seal(self.key, self.context, self.sent, message))
            except OSError:
                self.close()
                return False
        return True

    def close(self) -> None:
        """End the connection (its reader sees the end and lets go of the socket)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class Hub:
    """The master's side: accepts and reads every connection in one thread; puts each verified
    message on the runner's queue as ("message", link, body), and ("eof", link, None) when an
    accepted peer's connection ends."""

    def __init__(self, server: socket.socket, key: bytes, job: str, peers: int) -> None:
        self.server = server
        self.key = key
        self.job = job
        self.events: queue.Queue = queue.Queue()
        self.waiting_cap = max(4, 2 * peers)
        self.selector = selectors.DefaultSelector()
        self.waiting: dict[Link, None] = {}  # not yet verified, oldest first
        self.refused: Counter[str] = Counter()
        self.lock = threading.Lock()
        server.setblocking(False)
        self.selector.register(server, selectors.EVENT_READ, None)

    def start(self, events: queue.Queue) -> None:
        """Read in a thread of its own, into `events`."""
        self.events = events
        threading.Thread(target=self._run, daemon=True).start()

    def take_refused(self) -> Counter[str]:
        """What was refused since the last call, by why."""
        with self.lock:
            taken, self.refused = self.refused, Counter()
        return taken

    def _refuse(self, link: Link, why: str) -> None:
        with self.lock:
            self.refused[why] += 1
        self._drop(link)

    def _drop(self, link: Link) -> None:
        self.waiting.pop(link, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.selector.unregister(link.sock)
        link.close()
        with contextlib.suppress(OSError):
            link.sock.close()
        if link.host is not None:
            self.events.put(("eof", link, None))

    def _run(self) -> None:
        while True:
            try:
                ready = self.selector.select(timeout=0.5)
            except (OSError, ValueError):
                return
            for key, _ in ready:
                if key.data is None:
                    if not self._accept():
                        return
                else:
                    self._guarded(key.data)
            self._expire()

    def _guarded(self, link: Link) -> None:
        """Read one connection; an error of its own ends it, never the reader."""
        try:
            self._read(link)
        except Exception as err:  # one connection's failure is only its own
            self._refuse(link, f"an error reading it ({type(err).__name__})")

    def _accept(self) -> bool:
        try:
            sock, _ = self.server.accept()
        except BlockingIOError:
            return True
        except OSError as err:
            if self.server.fileno() < 0:
                return False  # the server socket is closed: the runner has ended
            with self.lock:  # out of descriptors (a flood), or a connection reset at once
                self.refused[f"a connection not accepted ({err.strerror})"] += 1
            time.sleep(0.05)
            return True
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            link = Link(sock, self.key, self.job)
        except OSError:
            sock.close()  # reset before it could be set up
            return True
        if len(self.waiting) >= self.waiting_cap:
            self._refuse(next(iter(self.waiting)), "too many connections waiting for hello")
        self.waiting[link] = None
        self.selector.register(sock, selectors.EVENT_READ, link)
        link.send({"t": "challenge", "nonce": link.nonce})
        link.context = f"{self.job}:{link.nonce}"
        link.sent = 0
        return True

    def _read(self, link: Link) -> None:
        try:
            data = link.sock.recv(65536)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            data = b""
        if not data or link.closed:
            self._drop(link)
            return
        lines = link.lines(data)
        if lines is None:
            self._refuse(link, f"a line over {MAX_LINE} bytes")
            return
        for line in lines:
            self._message(link, line)
            if link.closed:
                return

    def _message(self, link: Link, line: bytes) -> None:
        try:
            body = link.open(line)
        except BadMessage as err:
            if not link.verified:
                self._refuse(link, str(err).split(" (")[0])
            else:
                with self.lock:
                    self.refused[f"{err} from {link.host}"] += 1
            return
        if not link.verified:
            if body.get("t") != Kind.HELLO.value:
                self._refuse(link, "no hello first")
                return
            link.verified = True
            self.waiting.pop(link, None)
        self.events.put(("message", link, body))

    def _expire(self) -> None:
        now = time.monotonic()
        for link in [w for w in self.waiting if now - w.opened > HELLO_WITHIN]:
            self._refuse(link, f"no hello within {HELLO_WITHIN:.0f} s")


def connect(
    address: str, port: int, key: bytes, job: str, hello: dict[str, Any]
) -> tuple[Link | None, str]:
    """A worker's authenticated connection to the master's watchdog, or None and why not.

    'refused' when nothing listens there (the master's runner has ended)."""
    try:
        sock = socket.create_connection((address, port), timeout=SEND_TIMEOUT)
    except ConnectionRefusedError:
        return None, "refused"
    except OSError as err:
        return None, str(err)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    link = Link(sock, key, job)
    try:
        challenge = _expect(link, Kind.HELLO, None)
        link.context = f"{job}:{challenge['nonce']}"
        link.received = 0
        link.send({**hello, "t": Kind.HELLO.value, "nonce": link.nonce})
        welcome = _expect(link, Kind.WELCOME, link.nonce)
    except Rejected as err:
        link.close()
        return None, f"rejected: {err}"
    except (BadMessage, OSError, KeyError, TypeError) as err:
        link.close()
        with contextlib.suppress(OSError):
            sock.close()
        return None, f"the watchdog on {address}:{port} did not authenticate: {err}"
    link.verified = True
    link.welcome = welcome
    return link, ""


def _expect(link: Link, kind: Kind, nonce: str | None) -> dict[str, Any]:
    """The next message during the handshake: the challenge (kind HELLO: before it), or the
    welcome that names `nonce`; a refusal or anything else is BadMessage. Lines that came with
    it wait in the link's backlog."""
    deadline = time.monotonic() + HELLO_WITHIN
    while not link.backlog:
        if time.monotonic() > deadline:
            raise BadMessage("no answer in time")
        link.sock.settimeout(max(0.1, deadline - time.monotonic()))
        data = link.sock.recv(65536)
        if not data:
            raise BadMessage("it closed the connection")
        found = link.lines(data)
        if found is None:
            raise BadMessage("a line too long")
        link.backlog.extend(found)
    link.sock.settimeout(SEND_TIMEOUT)
    return _check(link.open(link.backlog.pop(0)), kind, nonce)


def read_uplink(link: Link, events: queue.Queue) -> None:
    """A worker's reader of its connection to the master: verified messages onto `events`,
    then ("eof", link, None), however the connection ends. A message that does not verify is
    dropped and counted."""
    try:
        _read_lines(link, events)
    except Exception as err:  # the connection ends; the worker connects again
        link.dropped[f"an error reading it ({type(err).__name__})"] += 1
    finally:
        link.close()
        with contextlib.suppress(OSError):
            link.sock.close()
        events.put(("eof", link, None))


def _read_lines(link: Link, events: queue.Queue) -> None:
    pending = list(link.backlog)
    link.backlog.clear()
    while not link.closed:
        for line in pending:
            try:
                events.put(("message", link, link.open(line)))
            except BadMessage as err:
                link.dropped[str(err).split(" (")[0]] += 1
        try:
            data = link.sock.recv(65536)
        except TimeoutError:
            pending = []
            continue
        except OSError:
            data = b""
        found = link.lines(data) if data else None
        if found is None:
            return
        pending = found


def _check(body: dict[str, Any], kind: Kind, nonce: str | None) -> dict[str, Any]:
    if kind is Kind.HELLO:
        if body.get("t") != "challenge" or not isinstance(body.get("nonce"), str):
            raise BadMessage("no challenge")
        return body
    if body.get("t") == Kind.REFUSED.value:
        raise Rejected(str(body.get("why")))
    if body.get("t") != kind.value or body.get("nonce") != nonce:
        raise BadMessage("no welcome for this connection")
    return body
