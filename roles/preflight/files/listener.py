#!/usr/bin/env python3
"""A TCP listener for the preflight: accepts connections on the master port of the master's
cluster address (never every interface), records who came.

Writes "ready" (or "error: ...") to the state file once bound, then accepts until every expected
peer address has connected or the timeout passed, and prints one JSON line: the expected peers
seen, and how many connections came from other addresses. It reads nothing from a connection
(each is closed at once), and a connection from an address it does not expect (a port scan, a
process on another machine) never ends it early: only the workers' own connections count.
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import sys
import time
from collections.abc import Iterable


def listen(server: socket.socket, expected: Iterable[str], timeout: float) -> dict[str, object]:
    """Accept on `server` until every `expected` address connected or `timeout` passed."""
    waiting = set(expected)
    seen: set[str] = set()
    others = 0
    deadline = time.monotonic() + timeout
    while waiting and (remaining := deadline - time.monotonic()) > 0:
        server.settimeout(remaining)
        try:
            conn, peer = server.accept()
        except TimeoutError:
            break
        except OSError as err:
            if server.fileno() < 0 or err.errno == errno.EINVAL:
                break  # closed or shut down
            time.sleep(0.05)  # out of descriptors, or a connection reset before it was taken
            continue
        conn.close()
        if peer[0] in waiting:
            waiting.discard(peer[0])
            seen.add(peer[0])
        elif peer[0] not in seen:
            others += 1
    return {"peers": sorted(seen), "missing": sorted(waiting), "others": others}


def main() -> int:
    """Listen, record peers, report as JSON; exit 2 when the address and port cannot be bound."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True, help="the master's cluster address")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--peers", default="", help="the addresses to wait for, comma-separated")
    parser.add_argument("--timeout", type=float, required=True, help="seconds to listen at most")
    parser.add_argument("--state-file", required=True)
    args = parser.parse_args()

    family = socket.AF_INET6 if ":" in args.address else socket.AF_INET
    server = socket.socket(family, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        # The cluster address only, where the workers connect to: never every interface.
        server.bind((args.address, args.port))
        server.listen(64)
    except OSError as err:
        with open(args.state_file, "w", encoding="utf-8") as state:
            state.write(f"error: {args.address}:{args.port}: {err.strerror}\n")
        print(json.dumps({"port": args.port, "address": args.address, "error": err.strerror}))
        server.close()
        return 2
    with open(args.state_file, "w", encoding="utf-8") as state:
        state.write("ready\n")
    with server:
        found = listen(server, [a for a in args.peers.split(",") if a], args.timeout)
    print(json.dumps({"port": args.port, **found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
