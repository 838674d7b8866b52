#!/usr/bin/env python3
"""A TCP listener for the preflight: accepts connections on the master port, records who came.

Writes "ready" (or "error: ...") to the state file once bound, then accepts until the expected
number of peers connected or the timeout passed, and prints one JSON line with the peers seen.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time


def main() -> int:
    """Listen, record peers, report as JSON; exit 2 when the port cannot be bound."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--expect", type=int, required=True, help="connections to wait for")
    parser.add_argument("--timeout", type=float, required=True, help="seconds to listen at most")
    parser.add_argument("--state-file", required=True)
    args = parser.parse_args()

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("0.0.0.0", args.port))  # every interface, as torchrun binds its store
        server.listen(64)
    except OSError as err:
        with open(args.state_file, "w", encoding="utf-8") as state:
            state.write(f"error: port {args.port}: {err.strerror}\n")
        print(json.dumps({"port": args.port, "error": err.strerror}))
        return 2
    with open(args.state_file, "w", encoding="utf-8") as state:
        state.write("ready\n")

    peers: list[str] = []
    deadline = time.monotonic() + args.timeout
    while len(peers) < args.expect:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        server.settimeout(remaining)
        try:
            conn, (address, _port) = server.accept()
        except TimeoutError:
            break
        conn.close()
        peers.append(address)
    server.close()
    print(json.dumps({"port": args.port, "peers": sorted(set(peers))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
