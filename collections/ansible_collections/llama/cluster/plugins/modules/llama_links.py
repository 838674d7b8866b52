#!/usr/bin/python
"""Ansible module: a node's network interfaces, and the links between nodes measured over TCP."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import ipaddress
import re
import secrets
import selectors
import socket
import statistics
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_links
short_description: List a node's interfaces; serve or measure a TCP stream and round trips
description:
  - O(mode=interfaces) lists the node's interfaces from /sys/class/net (no iproute2 needed) with
    their kind (C(infiniband), C(roce) for an Ethernet port with an RDMA device, C(ethernet),
    C(bridge), C(other)), link speed, MTU and IPv4 address and prefix.
  - O(mode=serve) listens on O(port) of each of O(addresses) (never every interface; an address
    that does not bind fails the module, naming it) and answers O(connections) measurements
    (echoes the round trips, then sends a stream) or stops after O(timeout) seconds; started
    with async. Only a peer that proves it holds O(key) is measured or counted; any other
    connection, whatever it sends, is answered C(error <why>), closed and counted in
    RV(refused), and the server goes on. Connections are served side by side, each in a thread
    of its own; a line is at most 256 bytes, a connection has 3 seconds to authenticate, at most
    32 wait to do so (the oldest is closed when another comes, so whatever else is connected a
    peer with the key gets through), and measurements run one at a time.
  - O(mode=measure) connects to a serving node at O(address), checks that it holds O(key), times
    O(pings) one-byte round trips (each a random byte that must come back) and then receives the
    stream the server sends for O(seconds); the figure is the bytes received here over the time
    measured here, in gigabits per second (nothing the peer claims is used).
options:
  mode:
    description: What to do.
    type: str
    choices: [interfaces, serve, measure]
    default: interfaces
  port:
    description: The TCP port served or measured against.
    type: int
    default: 29500
  addresses:
    description: The node's addresses to listen on, one per network measured (serve).
    type: list
    elements: str
    default: []
  connections:
    description: How many measurements the server answers before it exits (serve).
    type: int
    default: 1
  timeout:
    description: Seconds the server waits in all, or the client for its peer.
    type: float
    default: 60
  address:
    description: The peer's address on the network measured (measure).
    type: str
  seconds:
    description: How long the stream sends (measure).
    type: float
    default: 1.0
  pings:
    description: How many round trips are timed, 1 to 1000; the median is reported (measure).
    type: int
    default: 20
  key:
    description:
      - The check's secret, the same on every node (drawn on the controller for each check).
        Server and client each prove they hold it (HMAC-SHA256 over both sides' nonces) before
        anything is measured. Required for serve and measure.
    type: str
"""

EXAMPLES = r"""
- name: List this node's interfaces
  llama.cluster.llama_links:
    mode: interfaces
  register: links

- name: Serve two measurements on port 29510 (in the background)
  llama.cluster.llama_links:
    mode: serve
    addresses: [10.0.0.11]
    port: 29510
    connections: 2
    key: "{{ links_key }}"
  async: 120
  poll: 0

- name: Measure the stream and round trip to a peer
  llama.cluster.llama_links:
    mode: measure
    address: 10.0.0.12
    port: 29510
    key: "{{ links_key }}"
# tcp_gbps: 9.41; rtt_ms: 0.12
"""

RETURN = r"""
interfaces:
  description: "ifname: {kind, speed_mbps (null when the driver does not say), mtu, address,
    prefix, operstate}; loopback left out (interfaces)."
  type: dict
  returned: mode=interfaces
tcp_gbps:
  description: The stream's throughput in Gbit/s (measure).
  type: float
  returned: mode=measure
rtt_ms:
  description: The median round trip in milliseconds (measure).
  type: float
  returned: mode=measure
served:
  description: Measurements answered (serve).
  type: int
  returned: mode=serve
refused:
  description: "Connections refused, by why: {why: count} (serve)."
  type: dict
  returned: mode=serve
"""

MAX_WAITING = 32  # connections that may wait to authenticate at once
# One name per line: ansible-doc reads a module's top-level assignments, and not a tuple's.
SIOCGIFADDR = 0x8915  # linux/sockios.h
SIOCGIFNETMASK = 0x891B
ARPHRD_ETHER = 1  # linux/if_arp.h
ARPHRD_INFINIBAND = 32
CHUNK = 1 << 16
# The sender's buffer is capped so that what is still queued when the stream stops drains within
# a fraction of a second even on a 10 Mbit/s link (the kernel doubles it: 1 MiB in flight).
SEND_BUFFER = 1 << 19


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # EINVAL: a virtual device without a speed
        return None


def _ioctl_ipv4(sock: socket.socket, name: str, request: int) -> str | None:
    try:
        reply = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(reply[20:24])


def interface_kind(net: Path) -> str:
    """infiniband, roce (Ethernet with an RDMA device), bridge, ethernet or other."""
    kind = _read(net / "type")
    if kind == str(ARPHRD_INFINIBAND):
        return "infiniband"
    if (net / "bridge").is_dir():
        return "bridge"
    if kind == str(ARPHRD_ETHER):
        return "roce" if (net / "device" / "infiniband").is_dir() else "ethernet"
    return "other"


def interfaces(root: Path = Path("/sys/class/net")) -> dict[str, dict[str, Any]]:
    """Every interface but loopback: kind, speed, MTU, operstate and its IPv4 address/prefix."""
    found: dict[str, dict[str, Any]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for net in sorted(root.iterdir()):
            if _read(net / "type") == "772":  # ARPHRD_LOOPBACK
                continue
            speed = _read(net / "speed")
            mtu = _read(net / "mtu")
            address = _ioctl_ipv4(sock, net.name, SIOCGIFADDR)
            mask = _ioctl_ipv4(sock, net.name, SIOCGIFNETMASK)
            prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen if mask else None
            found[net.name] = {
                "kind": interface_kind(net),
                "speed_mbps": int(speed)
                if speed and speed.lstrip("-").isdigit() and int(speed) > 0
                else None,
                "mtu": int(mtu) if mtu and mtu.isdigit() else None,
                "address": address,
                "prefix": prefix,
                "operstate": _read(net / "operstate"),
            }
    return found


# The measurement's conversation, one line each (every line at most LINE_MAX bytes):
#   server: llama-links 1 <S>                  S: 32 hex digits drawn for this connection
#   client: hello <C> <hmac(key, "client", S, C)>
#   server: welcome <hmac(key, "server", C, S)>   (or: error <why>, and it closes)
#   client: ping <n>, then n single random bytes, each echoed before the next is sent
#   client: stream <seconds>; the server sends zeros for that long, then closes its side
#           (the client counts the zeros that arrive: anything else is refused)
# The key is the check's secret (drawn on the controller for this run), so each side knows the
# other is one of the run's nodes; the figures are what the client itself timed and received.
LINE_MAX = 256
HANDSHAKE_S = 3.0  # seconds a connection gets to authenticate and make its first request
MAX_PINGS = 1000
MAX_STREAM_S = 60.0
GREETING = re.compile(rb"llama-links 1 ([0-9a-f]{32})")
HELLO = re.compile(rb"hello ([0-9a-f]{32}) ([0-9a-f]{64})")
WELCOME = re.compile(rb"welcome ([0-9a-f]{64})")
PING = re.compile(rb"ping ([1-9][0-9]{0,3})")
STREAM = re.compile(rb"stream ([0-9]{1,2}(?:\.[0-9]{1,6})?)")


class Refused(Exception):
    """The peer said something this side does not accept: the connection ends."""


def proof(key: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 (hex) of one side's part of the handshake."""
    said = b"llama-links %s %s %s" % (side, first, second)
    return hmac.new(key, said, "sha256").hexdigest().encode()


class Reader:
    """Lines and bytes from a socket, buffered, each line bounded, every read before a deadline."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.buffer = b""

    def _more(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Refused("too slow")
        self.conn.settimeout(left)
        try:
            data = self.conn.recv(4096)
        except TimeoutError:
            raise Refused("too slow") from None
        if not data:
            raise Refused("closed the connection")
        self.buffer += data

    def line(self) -> bytes:
        """The next line without its newline; Refused when it outgrows LINE_MAX."""
        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) >= LINE_MAX:
                raise Refused(f"a line over {LINE_MAX} bytes")
            self._more()
        if end >= LINE_MAX:
            raise Refused(f"a line over {LINE_MAX} bytes")
        line, self.buffer = self.buffer[:end], self.buffer[end + 1 :]
        return line

    def byte(self) -> bytes:
        """The next byte."""
        if not self.buffer:
            self._more()
        byte, self.buffer = self.buffer[:1], self.buffer[1:]
        return byte


def expect(
    reader: Reader, pattern: re.Pattern[bytes], what: str, server: bool = False
) -> re.Match[bytes]:
    """The next line, when it matches `pattern`; Refused naming `what` was expected (from a
    `server`, with the `error <why>` it answered)."""
    line = reader.line()
    found = pattern.fullmatch(line)
    if found is not None:
        return found
    if server and line.startswith(b"error "):
        raise Refused(f"it refused: {line[6:].decode('ascii', 'replace')}")
    raise Refused(f"not {what}")


class LinkServer:
    """Answers measurements on listening sockets, each connection in a thread of its own; only
    a peer that proves it holds the key is measured, one measurement at a time. A connection
    that sends anything else is answered `error <why>` and closed, and counted in `refused`;
    at most MAX_WAITING connections wait to authenticate (the oldest goes when another comes),
    so no number of idle or hostile connections keeps a peer with the key out."""

    def __init__(self, server: socket.socket | list[socket.socket], key: bytes) -> None:
        self.servers = server if isinstance(server, list) else [server]
        self.key = key
        self.served = 0
        self.refused: Counter[str] = Counter()
        self.lock = threading.Lock()  # served, refused and waiting
        self.measuring = threading.Lock()  # one measurement at a time
        self.waiting: dict[socket.socket, None] = {}  # not yet authenticated, oldest first
        self.done = threading.Event()

    def serve(self, connections: int, deadline: float) -> int:
        """Answer until `connections` peers were measured, the deadline passed, or the sockets
        were closed; the number measured."""
        selector = selectors.DefaultSelector()
        for server in self.servers:
            server.setblocking(False)
            selector.register(server, selectors.EVENT_READ)
        try:
            while self.served < connections and (left := deadline - time.monotonic()) > 0:
                if self.done.is_set():
                    break
                for key, _ in selector.select(timeout=min(left, 0.2)):
                    if not self._accept(key.fileobj, connections, deadline):  # type: ignore[arg-type]
                        return self.served
        except (OSError, ValueError):  # a socket closed under the selector: the server's end
            pass
        finally:
            selector.close()
        return self.served

    def _accept(self, server: socket.socket, connections: int, deadline: float) -> bool:
        """Take one connection into a thread of its own (False: the server's life has ended)."""
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return True
        except OSError as err:
            if server.fileno() < 0 or err.errno == errno.EINVAL:
                return False  # closed or shut down
            self._count(f"not accepted ({err.strerror})")
            time.sleep(0.05)
            return True
        conn.setblocking(True)
        with self.lock:
            if len(self.waiting) >= MAX_WAITING:
                oldest = next(iter(self.waiting))
                self.waiting.pop(oldest)
                self.refused["too many connections waiting to authenticate"] += 1
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self.waiting[conn] = None
        threading.Thread(
            target=self._serve_one, args=(conn, connections, deadline), daemon=True
        ).start()
        return True

    def _count(self, why: str) -> None:
        with self.lock:
            self.refused[why] += 1

    def _serve_one(self, conn: socket.socket, connections: int, deadline: float) -> None:
        with conn:
            self.answer(conn, deadline)
        with self.lock:
            self.waiting.pop(conn, None)
            if self.served >= connections:
                self.done.set()

    def answer(self, conn: socket.socket, deadline: float) -> None:
        """One connection: measured, or refused and counted (whatever it sent)."""
        try:
            self.measured(conn, deadline)
        except Refused as err:
            self._count(str(err))
            with contextlib.suppress(OSError):
                conn.sendall(b"error %s\n" % str(err).encode())
        except OSError as err:
            self._count(f"connection error ({err.strerror or type(err).__name__})")
        except Exception as err:  # one connection's failure is only its own
            self._count(f"an error serving it ({type(err).__name__})")

    def measured(self, conn: socket.socket, deadline: float) -> None:
        """The conversation with one peer (Refused or OSError when it goes wrong)."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_hex(16).encode()
        conn.settimeout(HANDSHAKE_S)
        conn.sendall(b"llama-links 1 %s\n" % nonce)
        reader = Reader(conn, min(deadline, time.monotonic() + HANDSHAKE_S))
        theirs, mac = expect(reader, HELLO, "a hello").groups()
        if not hmac.compare_digest(mac, proof(self.key, b"client", nonce, theirs)):
            raise Refused("not this check's key")
        with self.lock:  # a peer of this run: never closed to make room
            self.waiting.pop(conn, None)
        conn.sendall(b"welcome %s\n" % proof(self.key, b"server", theirs, nonce))
        reader.deadline = deadline  # a peer of this run: it has until the server's end
        pings = int(expect(reader, PING, f"ping <1-{MAX_PINGS}>")[1])
        if pings > MAX_PINGS:
            raise Refused(f"not ping <1-{MAX_PINGS}>")
        with self.measuring:
            self._measure(conn, reader, pings, deadline)
        with self.lock:
            self.served += 1

    @staticmethod
    def _measure(conn: socket.socket, reader: Reader, pings: int, deadline: float) -> None:
        """The round trips, then the stream the peer asks for."""
        for _ in range(pings):
            conn.sendall(reader.byte())
        seconds = float(expect(reader, STREAM, "stream <seconds>")[1])
        if not 0 < seconds <= MAX_STREAM_S:
            raise Refused(f"not stream <seconds> (above 0, at most {MAX_STREAM_S:g})")
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        payload = bytes(CHUNK)
        ends = time.perf_counter() + seconds
        while time.perf_counter() < ends:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)


def listeners(addresses: list[str], port: int) -> list[socket.socket]:
    """A listening socket on `port` of each address; Refused naming one that does not bind."""
    found: list[socket.socket] = []
    try:
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            server = socket.socket(family, socket.SOCK_STREAM)
            found.append(server)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind((address, port))
            except OSError as err:
                raise Refused(f"cannot listen on {address}:{port}: {err.strerror}") from err
            server.listen(64)
    except BaseException:
        for server in found:
            server.close()
        raise
    return found


def serve(
    port: int, connections: int, timeout: float, key: bytes, addresses: list[str]
) -> LinkServer:
    """Answer measurements on `port` of each address until `connections` were measured or
    `timeout` passed."""
    servers = listeners(addresses, port)
    try:
        found = LinkServer(servers, key)
        found.serve(connections, time.monotonic() + timeout)
    finally:
        for server in servers:
            server.close()
    return found


def measure(
    address: str, port: int, key: bytes, *, seconds: float, pings: int, timeout: float
) -> dict[str, Any]:
    """Round trips (median, ms) and the throughput (Gbit/s) of a stream from a serving peer,
    both timed here and from bytes received here; the peer must prove it holds the key."""
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = Reader(conn, time.monotonic() + timeout)
        theirs = expect(reader, GREETING, "a link server's greeting", server=True)[1]
        nonce = secrets.token_hex(16).encode()
        conn.sendall(b"hello %s %s\n" % (nonce, proof(key, b"client", theirs, nonce)))
        mac = expect(reader, WELCOME, "a welcome", server=True)[1]
        if not hmac.compare_digest(mac, proof(key, b"server", nonce, theirs)):
            raise Refused("its welcome does not prove this check's key")
        conn.sendall(b"ping %d\n" % pings)
        trips = []
        for _ in range(pings):
            sent = secrets.token_bytes(1)
            start = time.perf_counter()
            conn.sendall(sent)
            if reader.byte() != sent:
                raise Refused("it echoed another byte")
            trips.append(time.perf_counter() - start)
        if reader.buffer:
            raise Refused("it sent bytes nobody asked for")
        conn.sendall(b"stream %.3f\n" % seconds)
        received, start = 0, time.perf_counter()
        conn.settimeout(timeout)
        while chunk := conn.recv(CHUNK):
            if chunk.count(0) != len(chunk):  # the stream is zeros: anything else is no stream
                said = chunk.split(b"\n")[0][:LINE_MAX].decode("ascii", "replace")
                refused = received == 0 and chunk.startswith(b"error ")
                raise Refused(f"it refused: {said[6:]}" if refused else "it sent no stream")
            received += len(chunk)
            if time.perf_counter() - start > seconds + timeout:
                raise Refused(f"it streamed past {seconds + timeout:g} s")
        elapsed = time.perf_counter() - start
    if received <= 0:
        raise Refused("it sent no bytes of the stream")
    return {
        "tcp_gbps": round(received * 8 / elapsed / 1e9, 4),
        "rtt_ms": round(statistics.median(trips) * 1e3, 3),
        "bytes": received,
        "seconds": round(elapsed, 3),
    }


def main() -> None:
    """Run the module."""
    module = AnsibleModule(
        argument_spec={
            "mode": {
                "type": "str",
                "choices": ["interfaces", "serve", "measure"],
                "default": "interfaces",
            },
            "port": {"type": "int", "default": 29500},
            "connections": {"type": "int", "default": 1},
            "addresses": {"type": "list", "elements": "str", "default": []},
            "timeout": {"type": "float", "default": 60.0},
            "address": {"type": "str"},
            "seconds": {"type": "float", "default": 1.0},
            "pings": {"type": "int", "default": 20},
            "key": {"type": "str", "no_log": True},
        },
        required_if=[
            ("mode", "serve", ["key", "addresses"]),
            ("mode", "measure", ["address", "key"]),
        ],
        supports_check_mode=True,
    )
    p = module.params
    if p["mode"] == "interfaces":
        module.exit_json(changed=False, interfaces=interfaces())
    if p["mode"] == "measure" and not (
        0.001 <= p["seconds"] <= MAX_STREAM_S and 1 <= p["pings"] <= MAX_PINGS
    ):
        module.fail_json(
            msg=f"llama_links: seconds must be 0.001 to {MAX_STREAM_S:g} (got "
            f"{p['seconds']:g}), pings 1 to {MAX_PINGS} (got {p['pings']})"
        )
    if len(p["key"]) < 16:
        module.fail_json(msg="llama_links: the key must hold at least 16 characters")
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg="no measurement in check mode")
    key = p["key"].encode()
    try:
        if p["mode"] == "serve":
            server = serve(p["port"], p["connections"], p["timeout"], key, p["addresses"])
            module.exit_json(changed=False, served=server.served, refused=dict(server.refused))
        found = measure(
            p["address"],
            p["port"],
            key,
            seconds=p["seconds"],
            pings=p["pings"],
            timeout=p["timeout"],
        )
    except OSError as err:
        module.fail_json(msg=f"llama_links: {p['mode']} on port {p['port']}: {err}")
    except Refused as err:
        if p["mode"] == "serve":
            module.fail_json(msg=f"llama_links: the link server {err}")
        module.fail_json(msg=f"llama_links: the link server on {p['address']}:{p['port']}: {err}")
    module.exit_json(changed=False, **found)


if __name__ == "__main__":
    main()
