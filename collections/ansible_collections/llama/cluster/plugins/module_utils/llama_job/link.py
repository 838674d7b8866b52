"""The watchdog port: authenticated connections between the master's runner and its workers.

Everything a peer sends is hostile until authenticated. The handshake (wire.py frames; every
mac covers the job, the connection, the sender and the receiver: wire.context):

    master -> worker   challenge {nonce: C}                             master>worker, no C yet
    worker -> master   hello {host, rank, phase, attempt, nonce: W}     worker>master under C
    master -> worker   welcome {phase, attempt, nonce: W}               master>worker under C

and every later message on that connection is sealed under C, its direction and its sender, with
a sequence number above the last one, so a message of another connection, one sent again, or one
reflected back to its sender does not verify; the worker knows the master by its answer to W.

The master serves only its peers' addresses (the inventory's cluster_address of each node, in
the job's spec): a connection from any other address is refused at once, before a challenge;
one from a peer's address is challenged for that peer alone, and a hello naming another host is
refused. It reads every connection in one thread (a selector), the authenticated ones first: a
line is at most wire.MAX_LINE bytes, a connection that has not said hello within
wire.HELLO_WITHIN seconds is closed, and at most WAITING_PER_ADDRESS connections of one address
wait for their hello at once (the oldest of that address goes when another comes), so no
number of connections from elsewhere, or from one node, keeps another node out.

Whatever a connection sends ends that connection at worst, never the reader: wire.unseal
checks a line's length, shape and mac on its raw bytes before any JSON is parsed, and
messages.check types what verified; a message that verifies but breaks its schema (a peer that
holds the key) is counted and its connection cut (`Link.cut` says why: the agents wait for the
peer to connect again, and its silence counts as usual). Anything else one connection's handling
raises drops that connection and is counted with what was refused (the master's log says it
every master.REFUSALS_EVERY seconds). The worker's reader (read_uplink) and handshake (connect)
hold to the same rule against a watchdog that is not its master.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import queue
import secrets
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from .messages import check
from .wire import HELLO_WITHIN, MAX_LINE, BadMessage, Kind, Malformed, context, seal, unseal

SEND_TIMEOUT = 5.0  # a peer that does not read for this long is cut off
WAITING_PER_ADDRESS = 4  # connections of one address that may wait for their hello at once
ANYONE = "*"  # the receiver of the refusal an address that is no peer's gets


def same_address(address: str) -> str:
    """An address as one spelling (an IPv4 address mapped into IPv6 as itself)."""
    try:
        found = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    mapped = getattr(found, "ipv4_mapped", None)
    return str(mapped or found)


class Rejected(BadMessage):
    """The master's answer to a hello: this node is not one of the job's."""


class Link:
    """One TCP connection carrying sealed messages, one per line."""

    def __init__(self, sock: socket.socket, key: bytes, job: str, *, from_master: bool) -> None:
        self.sock = sock
        self.key = key
        self.job = job
        self.from_master = from_master  # what arrives here is the master's (a worker's link)
        self.send_context = ""  # wire.context of what this side sends, once the nonce is known
        self.recv_context = ""  # ... and of what it receives
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
        self.cut = ""  # why this side ended the connection of a peer that holds the key
        self.address = ""  # the peer's address (the master's side)
        self.expected: str | None = None  # the peer its address makes it (the master's side)
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
        """A message of this connection, as its schema reads it (BadMessage: forged, replayed;
        Malformed: it verified, but is no message its sender sends)."""
        seq, body = unseal(self.key, self.recv_context, line, self.received)
        self.received = seq
        return check(body, from_master=self.from_master)

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the connection is gone."""
        if self.closed:
            return False
        with self.lock:
            self.sent += 1
            try:
                self.sock.sendall(seal(self.key, self.send_context, self.sent, message))
            except OSError:
                self.close()
                return False
        return True

    def close(self, cut: str = "") -> None:
        """End the connection (its reader sees the end and lets go of the socket); `cut` says
        why this side ended a peer's connection that the peer may open again."""
        self.cut = self.cut or cut
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class Hub:
    """The master's side: accepts and reads every connection in one thread; puts each verified
    message on the runner's queue as ("message", link, body), and ("eof", link, None) when an
    accepted peer's connection ends (`link.cut` says why, when the Hub cut it)."""

    def __init__(
        self, server: socket.socket, key: bytes, job: str, master: str, peers: Mapping[str, str]
    ) -> None:
        self.server = server
        self.key = key
        self.job = job
        self.master = master
        self.by_address = {same_address(address): host for host, address in peers.items()}
        self.events: queue.Queue = queue.Queue()
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

    def _count(self, why: str) -> None:
        with self.lock:
            self.refused[why] += 1

    def _refuse(self, link: Link, why: str) -> None:
        if link.verified:  # a peer holding the key: it may connect again
            link.cut = link.cut or why
        self._count(why)
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
            # Authenticated peers first, then the connections still to say hello, then new ones.
            ready.sort(
                key=lambda item: 2 if item[0].data is None else 0 if item[0].data.verified else 1
            )
            for key, _ in ready:
                if key.data is None:
                    if not self._accept():
                        return
                elif not key.data.closed:
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
            sock, source = self.server.accept()
        except BlockingIOError:
            return True
        except OSError as err:
            if self.server.fileno() < 0:
                return False  # the server socket is closed: the runner has ended
            # out of descriptors (a flood), or a connection reset at once
            self._count(f"a connection not accepted ({err.strerror})")
            time.sleep(0.05)
            return True
        address = same_address(str(source[0]))
        host = self.by_address.get(address)
        try:
            if host is None:
                self._turn_away(sock, address)
                return True
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            link = Link(sock, self.key, self.job, from_master=False)
        except OSError:
            sock.close()  # reset before it could be set up
            return True
        link.address, link.expected = address, host
        same = [w for w in self.waiting if w.address == address]
        if len(same) >= WAITING_PER_ADDRESS:
            self._refuse(same[0], f"too many connections from {address} waiting for hello")
        self.waiting[link] = None
        self.selector.register(sock, selectors.EVENT_READ, link)
        link.send_context = context(self.job, "", self.master, host)
        link.send({"t": "challenge", "nonce": link.nonce})
        link.send_context = context(self.job, link.nonce, self.master, host)
        link.recv_context = context(self.job, link.nonce, host, self.master)
        link.sent = 0
        return True

    def _turn_away(self, sock: socket.socket, address: str) -> None:
        """A connection from an address that is no peer's: a sealed refusal, then closed."""
        self._count("a connection from an address that is no node of this job")
        why = f"{address} is the cluster_address of no node of this job"
        line = seal(
            self.key, context(self.job, "", self.master, ANYONE), 1, {"t": "refused", "why": why}
        )
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(line)
        sock.close()

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
        except Malformed as err:  # it holds the key: its connection is cut, and counted
            self._refuse(link, f"{str(err).split(' (')[0]} from {link.host or link.expected}")
            return
        except BadMessage as err:
            if not link.verified:
                self._refuse(link, str(err).split(" (")[0])
            else:
                self._count(f"{str(err).split(' (')[0]} from {link.host}")
            return
        if not link.verified:
            if body["t"] != Kind.HELLO.value:
                self._refuse(link, "no hello first")
                return
            if body["host"] != link.expected:
                self._refuse(link, f"a hello naming {body['host']} from {link.expected}'s address")
                return
            link.verified = True
            self.waiting.pop(link, None)
        self.events.put(("message", link, body))

    def _expire(self) -> None:
        now = time.monotonic()
        for link in [w for w in self.waiting if now - w.opened > HELLO_WITHIN]:
            self._refuse(link, f"no hello within {HELLO_WITHIN:.0f} s")


def _open_socket(address: str, port: int, source: str) -> socket.socket:
    """A TCP connection to the master, from this node's own cluster address where it has one
    (the master serves only that address): another source where it is not this machine's."""
    if source:
        try:
            return socket.create_connection(
                (address, port), timeout=SEND_TIMEOUT, source_address=(source, 0)
            )
        except OSError as err:
            if err.errno != errno.EADDRNOTAVAIL:
                raise
    return socket.create_connection((address, port), timeout=SEND_TIMEOUT)


def connect(
    address: str,
    port: int,
    key: bytes,
    job: str,
    hello: dict[str, Any],
    *,
    master: str,
    source: str = "",
) -> tuple[Link | None, str]:
    """A worker's authenticated connection to the master's watchdog (the master's node is named
    `master`; `hello` names this one), from `source`, or None and why not.

    'refused' when nothing listens there (the master's runner has ended)."""
    me = str(hello["host"])
    try:
        sock = _open_socket(address, port, source)
    except ConnectionRefusedError:
        return None, "refused"
    except OSError as err:
        return None, str(err)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    link = Link(sock, key, job, from_master=True)
    try:
        challenge = _challenge(link, master, me)
        link.send_context = context(job, challenge["nonce"], me, master)
        link.recv_context = context(job, challenge["nonce"], master, me)
        link.received = 0
        link.send({**hello, "t": Kind.HELLO.value, "nonce": link.nonce})
        welcome = _check(_next_message(link), Kind.WELCOME, link.nonce)
    except Rejected as err:
        link.close()
        return None, f"rejected: {err}"
    except (BadMessage, OSError) as err:
        link.close()
        with contextlib.suppress(OSError):
            sock.close()
        return None, f"the watchdog on {address}:{port} did not authenticate: {err}"
    link.verified = True
    link.welcome = welcome
    return link, ""


def _next_line(link: Link) -> bytes:
    """The next line during the handshake (those that came with it wait in the backlog)."""
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
    return link.backlog.pop(0)


def _next_message(link: Link) -> dict[str, Any]:
    return link.open(_next_line(link))


def _challenge(link: Link, master: str, me: str) -> dict[str, Any]:
    """The master's challenge to this node, or Rejected: the master's refusal of this address."""
    line = _next_line(link)
    link.recv_context = context(link.job, "", master, me)
    try:
        body = link.open(line)
    except BadMessage as err:
        link.recv_context = context(link.job, "", master, ANYONE)
        try:
            refusal = link.open(line)
        except BadMessage:
            raise err from None
        raise Rejected(str(refusal.get("why"))) from None
    if body["t"] != "challenge":
        raise BadMessage("no challenge")
    return body


def read_uplink(link: Link, events: queue.Queue) -> None:
    """A worker's reader of its connection to the master: verified messages onto `events`,
    then ("eof", link, None), however the connection ends. A message that does not verify is
    dropped and counted; one that verifies but breaks its schema cuts the connection
    (`link.cut`), and the worker connects again."""
    try:
        _read_lines(link, events)
    except Exception as err:  # the connection ends; the worker connects again
        link.cut = f"an error reading it ({type(err).__name__})"
        link.dropped[link.cut] += 1
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
            except Malformed as err:  # it holds the key: the connection is cut
                link.cut = str(err).split(" (")[0]
                link.dropped[link.cut] += 1
                return
            except BadMessage as err:
                link.dropped[str(err).split(" (")[0]] += 1
        try:
            data = link.sock.recv(65536)
        except TimeoutError:
            pending = []
            continue
        except OSError:
            data = b""
        if not data:
            return
        found = link.lines(data)
        if found is None:
            link.cut = f"a line over {MAX_LINE} bytes"
            link.dropped[link.cut] += 1
            return
        pending = found


def _check(body: dict[str, Any], kind: Kind, nonce: str | None) -> dict[str, Any]:
    if body.get("t") == Kind.REFUSED.value:
        raise Rejected(str(body.get("why")))
    if body.get("t") != kind.value or body.get("nonce") != nonce:
        raise BadMessage("no welcome for this connection")
    return body
