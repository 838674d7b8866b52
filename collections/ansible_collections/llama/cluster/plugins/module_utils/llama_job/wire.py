"""The llama-job wire: the messages on the watchdog port (`Kind`) and their framing.

Every message is one line, `<seq> <mac> <body>`: a sequence number, the HMAC-SHA256 (64 hex
digits) under the job's secret of its context (`context`: the job, the connection, the sender
and the receiver), the sequence number and the body as they are on the wire, and the body, the
message's canonical JSON. The secret never crosses the wire. A line is checked on its raw
bytes first: one longer than MAX_LINE, not of that shape, whose mac does not
verify or whose sequence number is not above the last one accepted on that connection is refused
before any JSON is parsed; a body that verifies is parsed only when it nests at most MAX_DEPTH
deep and holds finite numbers only (NaN, Infinity, 1e400 are refused); messages.py then checks
its fields. Only link.py and messages.py read this module. Stdlib only, Python 3.10 (it runs on
the nodes).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

VERSION = 1
MAX_LINE = 64 << 10  # bytes of one message on the watchdog port, newline included
HELLO_WITHIN = 5.0  # seconds a new connection has to authenticate itself
MAX_DEPTH = 32  # nesting of a message's arrays and objects (the agents' nest a few levels)


class Kind(str, Enum):
    """The messages on the watchdog port (worker to master: hello, beat, exit, idle)."""

    HELLO = "hello"  # a worker joins: host, rank, phase, attempt, nonce
    WELCOME = "welcome"  # the master accepts it: phase, attempt, the worker's nonce back
    REFUSED = "refused"
    BEAT = "beat"
    START = "start"
    # From a checkpoint: a restart (`after`: the failure) or a resumed run's first attempt;
    # `plan` names the checkpoint and what each node sets aside.
    CONTINUE = "continue"
    ABORT = "abort"
    FINAL = "final"
    EXIT = "exit"
    IDLE = "idle"


# --------------------------------------------------------------------------------------------
# Framing: one authenticated message per line
# --------------------------------------------------------------------------------------------
class BadMessage(ValueError):
    """A line that is not a message of this job: too long, malformed, forged or replayed."""


class Malformed(BadMessage):
    """A line that verified (its sender holds the job's key) but holds no message: too deep,
    no JSON, a number that is not finite, or a message that breaks its schema (messages.py)."""


def context(job: str, nonce: str, sender: str, receiver: str) -> str:
    """What a message's mac covers besides its number and body: the job, the connection (the
    master's challenge nonce; "" for the challenge itself), and who sends it to whom, so that a
    message reflected back to its sender, or carried to another connection, does not verify."""
    return f"{job}:{nonce}:{sender}>{receiver}"


def _no_constant(word: str) -> object:
    raise ValueError(f"{word} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ValueError(f"{text} is not a finite number")
    return value


FRAME = re.compile(rb"(0|[1-9][0-9]{0,17}) ([0-9a-f]{64}) (\{.*\})\n?", re.DOTALL)
JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# The frame of llama-job before issue 40, as its seal wrote it: only that shape is named older.
OLD_FRAME = re.compile(
    rb'\{"seq": [0-9]{1,18}, "body": "(?:[^"\\]|\\.)*", "mac": "[0-9a-f]{64}"\}\n?', re.DOTALL
)
JSON_NESTING = re.compile(rb"[\[\]{}]")


def _mac(key: bytes, job: str, seq: bytes, body: bytes) -> bytes:
    data = b"%s\n%s\n%s" % (job.encode(), seq, body)
    return hmac.new(key, data, hashlib.sha256).hexdigest().encode()


def seal(key: bytes, job: str, seq: int, body: Mapping[str, Any]) -> bytes:
    """One message as its line on the wire (ASCII: the JSON escapes every other character)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    number = b"%d" % seq
    return b"%s %s %s\n" % (number, _mac(key, job, number, text), text)


def too_deep(text: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether a JSON text's arrays and objects nest deeper than `limit` (brackets inside its
    strings left out), read before json.loads would recurse into them."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    depth = 0
    for bracket in JSON_NESTING.findall(JSON_STRING.sub(b'""', text)):
        depth += 1 if bracket in b"[{" else -1
        if depth > limit:
            return True
    return False


def unseal(key: bytes, job: str, line: bytes, last_seq: int) -> tuple[int, dict[str, Any]]:
    """The sequence number and body of a line; BadMessage unless it is this job's and new.

    Nothing but BadMessage is raised, whatever the bytes: the shape and the mac are checked on
    the raw line, and the body is parsed only once it verified and its nesting is bounded."""
    if len(line) > MAX_LINE:
        raise BadMessage(f"line of {len(line)} bytes (at most {MAX_LINE})")
    frame = FRAME.fullmatch(line)
    if frame is None:
        raise BadMessage(
            "a frame of an older llama-job (run provision.yml on every node)"
            if OLD_FRAME.fullmatch(line)
            else "not a frame (another program's bytes on the watchdog port, not llama-job's)"
        )
    number, mac, text = frame.groups()
    if not hmac.compare_digest(mac, _mac(key, job, number, text)):
        raise BadMessage("bad mac")
    seq = int(number)
    if seq <= last_seq:
        raise BadMessage(f"replayed (sequence {seq}, last {last_seq})")
    if too_deep(text):
        raise Malformed(f"nested deeper than {MAX_DEPTH}")
    try:
        body = json.loads(text.decode("ascii"), parse_constant=_no_constant, parse_float=_finite)
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate cannot be written out
    except (ValueError, RecursionError) as err:  # UnicodeError is a ValueError
        raise Malformed("no JSON in the frame") from err
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise Malformed("no message in the frame")
    return seq, body
