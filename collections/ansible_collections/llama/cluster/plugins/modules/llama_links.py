#!/usr/bin/python
"""Ansible module: a node's network interfaces, and the links between nodes measured over TCP."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import statistics
import struct
import time
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
  - O(mode=serve) listens on O(port) and answers O(connections) measurements (round trips, then
    a stream whose bytes it counts) or stops after O(timeout) seconds; started with async.
  - O(mode=measure) connects to a serving node at O(address), times O(pings) one-byte round trips
    and then sends for O(seconds); the stream's figure is the bytes the peer received over the
    time until it acknowledged them, in gigabits per second.
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
    description: How many round trips are timed; the median is reported (measure).
    type: int
    default: 20
"""

EXAMPLES = r"""
- name: List this node's interfaces
  llama.cluster.llama_links:
    mode: interfaces
  register: links

- name: Serve two measurements on port 29510 (in the background)
  llama.cluster.llama_links:
    mode: serve
    port: 29510
    connections: 2
  async: 120
  poll: 0

- name: Measure the stream and round trip to a peer
  llama.cluster.llama_links:
    mode: measure
    address: 10.0.0.12
    port: 29510
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
"""

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


def _line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            break
        data += byte
    return data


def answer(conn: socket.socket) -> bool:
    """One measurement: `ping N` (echo N single bytes), then `stream` (count bytes until EOF,
    reply the count). False for a connection that sent no request (a port probe)."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    words = _line(conn).split()
    if not words:
        return False
    if words[0] == b"ping":
        for _ in range(int(words[1])):
            byte = conn.recv(1)
            if not byte:
                return True
            conn.sendall(byte)
        words = _line(conn).split()
    if words[:1] == [b"stream"]:
        received = 0
        while chunk := conn.recv(CHUNK):
            received += len(chunk)
        conn.sendall(b"%d\n" % received)
    return True


def serve(port: int, connections: int, timeout: float) -> int:
    """Answer measurements on port until `connections` were served or `timeout` passed."""
    deadline = time.monotonic() + timeout
    served = 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen(8)
        while served < connections and (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            with conn:
                conn.settimeout(max(deadline - time.monotonic(), 1.0))
                with contextlib.suppress(OSError):
                    served += answer(conn)
    return served


def measure(address: str, port: int, seconds: float, pings: int, timeout: float) -> dict[str, Any]:
    """Round trips (median, ms) and a stream's throughput (Gbit/s) to a serving peer."""
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        conn.sendall(b"ping %d\n" % pings)
        trips = []
        for _ in range(pings):
            start = time.perf_counter()
            conn.sendall(b"p")
            if not conn.recv(1):
                raise OSError(f"{address}:{port} closed the connection during the round trips")
            trips.append(time.perf_counter() - start)
        conn.sendall(b"stream\n")
        payload = bytes(CHUNK)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        reply = _line(conn)
        elapsed = time.perf_counter() - start
    received = int(reply.strip() or 0)
    if received <= 0:
        raise OSError(f"{address}:{port} acknowledged no bytes of the stream")
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
            "timeout": {"type": "float", "default": 60.0},
            "address": {"type": "str"},
            "seconds": {"type": "float", "default": 1.0},
            "pings": {"type": "int", "default": 20},
        },
        required_if=[("mode", "measure", ["address"])],
        supports_check_mode=True,
    )
    p = module.params
    if p["mode"] == "interfaces":
        module.exit_json(changed=False, interfaces=interfaces())
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg="no measurement in check mode")
    try:
        if p["mode"] == "serve":
            module.exit_json(changed=False, served=serve(p["port"], p["connections"], p["timeout"]))
        found = measure(p["address"], p["port"], p["seconds"], p["pings"], p["timeout"])
    except OSError as err:
        module.fail_json(msg=f"llama_links: {p['mode']} on port {p['port']}: {err}")
    module.exit_json(changed=False, **found)


if __name__ == "__main__":
    main()
