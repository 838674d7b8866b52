"""The typed schemas of what an agent or root reads from another party: every message on the
watchdog port (`check`, applied right after the mac) and an agent's state file (`check_state`).

A peer that holds the job's key is still not trusted with the agents' types: each message kind
has its fields, each field its type, range and size (integers are not booleans, numbers are
finite, texts and lists are bounded), and each direction its kinds (a worker never sends a start,
the master never a hello). A message that breaks its schema raises Malformed, which ends the
connection it came on (link.py), never the agent. Fields the schema does not name are dropped:
a handler only ever sees what was checked. A new field is added here before any handler reads
it. The state file is the job's user's (so is the training code that runs as that user): root's
`status` and `list` read it through `check_state`. Stdlib only, Python 3.10 (it runs on the
nodes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from .protocol import FailureKind, Phase
from .wire import Kind, Malformed

Check = Callable[[object], object]

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a host, as spec.check_name allows
HEX = re.compile(r"[0-9a-f]{16,64}")


def _integer(low: int, high: int) -> Check:
    def check(value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise Malformed(f"must be an integer from {low} to {high}")
        return value

    return check


def _number(low: float, high: float) -> Check:
    def check(value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise Malformed("must be a number")
        if not low <= value <= high or not math.isfinite(value):  # range first: 10**400
            raise Malformed(f"must be a finite number from {low:g} to {high:g}")
        return value

    return check


def _text(limit: int, pattern: re.Pattern[str] | None = None) -> Check:
    def check(value: object) -> object:
        if not isinstance(value, str) or len(value) > limit:
            raise Malformed(f"must be a text of at most {limit} characters")
        if pattern is not None and not pattern.fullmatch(value):
            raise Malformed(f"must be a text of the form {pattern.pattern}")
        return value

    return check


def _flag(value: object) -> object:
    if not isinstance(value, bool):
        raise Malformed("must be true or false")
    return value


def _one_of(*values: str) -> Check:
    def check(value: object) -> object:
        if value not in values:
            raise Malformed(f"must be one of {', '.join(values)}")
        return value

    return check


def _optional(inner: Check) -> Check:
    def check(value: object) -> object:
        return None if value is None else inner(value)

    return check


def _list(inner: Check, limit: int) -> Check:
    def check(value: object) -> object:
        if not isinstance(value, list) or len(value) > limit:
            raise Malformed(f"must be a list of at most {limit} items")
        return [inner(item) for item in value]

    return check


def _mapping(inner: Check, limit: int) -> Check:
    def check(value: object) -> object:
        if not isinstance(value, Mapping) or len(value) > limit:
            raise Malformed(f"must be an object of at most {limit} entries")
        return {_text(128)(key): inner(item) for key, item in value.items()}

    return check


def _record(fields: Mapping[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object of these fields (each checked; `required` ones present), others dropped."""

    def check(value: object) -> object:
        if not isinstance(value, Mapping):
            raise Malformed("must be an object")
        missing = [name for name in required if name not in value]
        if missing:
            raise Malformed(f"lacks {', '.join(missing)}")
        found = {}
        for name, inner in fields.items():
            if name in value:
                try:
                    found[name] = inner(value[name])
                except Malformed as err:
                    said = str(err)
                    joint = " " if said.startswith(("must", "lacks")) else "."
                    raise Malformed(f"{name}{joint}{said}") from None
        return found

    return check


def _scalar(value: object) -> object:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(1024)(value)
    return _number(-1e15, 1e15)(value)


HOST = _text(128, NAME)
ATTEMPT = _integer(1, 1_000_000)
RANK = _integer(0, 1_000_000)
PHASE = _one_of(*(phase.value for phase in Phase))
# What a worker's agent says of itself (worker.py sets no other phase).
WORKER_PHASES = (Phase.WAITING, Phase.RUNNING, Phase.IDLE, Phase.DONE, Phase.FAILED, Phase.STOPPED)
WORKER_PHASE = _one_of(*(p.value for p in (*WORKER_PHASES, Phase.SUCCEEDED)))
NONCE = _text(64, HEX)
MESSAGE = _text(8192)
ERRORS = _list(_text(1024), 64)
EXIT_STATUS = _optional(_integer(-255, 255))
SECONDS = _optional(_number(0, 1e11))
CAUSE = _optional(_mapping(_scalar, 32))
FAILURE = _record(
    {
        "node": _optional(HOST),
        "kind": _one_of(*(kind.value for kind in FailureKind)),
        "message": MESSAGE,
        "rank": _optional(RANK),
        "exit_status": EXIT_STATUS,
        "errors": ERRORS,
        "cause": CAUSE,
        "at": _optional(_text(32)),
        "at_s": SECONDS,
        "attempt": _optional(ATTEMPT),
        "away": _list(HOST, 1024),
        "silent": _flag,
    },
    required=("kind", "message"),
)
# A node's checkpoints (checkpoints.listing: two entries per checkpoint at most).
CHECKPOINTS = _list(
    _record(
        {"path": _text(4096), "isdir": _flag, "problem": _text(512)},
        required=("path",),
    ),
    400,
)
CHECKPOINT_NAME = _text(64)
HOSTS = _list(HOST, 1024)
PLAN = _record(
    {
        "ok": _flag,
        "checkpoint": _optional(CHECKPOINT_NAME),
        "set_aside": _mapping(_list(CHECKPOINT_NAME, 400), 1024),
        "stamp": _text(64),
        "message": MESSAGE,
        # The nodes of the attempt in node rank order, and what each command is given for
        # that many (a run on fewer nodes: min_nodes).
        "nodes": HOSTS,
        "args": _list(_text(1024), 64),
        "note": MESSAGE,
    },
    required=("ok",),
)

# Every kind and its fields, by who sends it.
FROM_WORKER: dict[str, Check] = {
    Kind.HELLO.value: _record(
        {"host": HOST, "rank": RANK, "phase": WORKER_PHASE, "attempt": ATTEMPT, "nonce": NONCE},
        required=("host", "nonce"),
    ),
    Kind.BEAT.value: _record(
        {
            "phase": WORKER_PHASE,
            "attempt": ATTEMPT,
            "stopped_procs": _flag,
            "checkpoints": CHECKPOINTS,
        },
        required=("phase",),
    ),
    Kind.EXIT.value: _record(
        {
            "attempt": ATTEMPT,
            "exit_status": EXIT_STATUS,
            "aborted": _flag,
            "stopped": _flag,
            "errors": ERRORS,
            "rank": _optional(RANK),
            "at_s": SECONDS,
            "message": MESSAGE,
            "cause": CAUSE,
            "kind": _one_of(*(kind.value for kind in FailureKind)),
            "checkpoints": CHECKPOINTS,
            # Why a command that failed had every rank finished (saves.finished), or "".
            "finished": MESSAGE,
        },
        required=("attempt",),
    ),
    Kind.IDLE.value: _record({"attempt": ATTEMPT, "checkpoints": CHECKPOINTS}, ("attempt",)),
}
FROM_MASTER: dict[str, Check] = {
    "challenge": _record({"nonce": NONCE}, required=("nonce",)),
    Kind.WELCOME.value: _record(
        {"phase": PHASE, "attempt": ATTEMPT, "nonce": NONCE}, required=("nonce",)
    ),
    Kind.REFUSED.value: _record({"why": MESSAGE}),
    Kind.BEAT.value: _record({"phase": PHASE, "attempt": ATTEMPT}, required=("phase",)),
    Kind.START.value: _record({"attempt": ATTEMPT}, required=("attempt",)),
    Kind.CONTINUE.value: _record(
        {"attempt": ATTEMPT, "after": _optional(FAILURE), "plan": PLAN},
        required=("attempt", "plan"),
    ),
    Kind.ABORT.value: _record({"attempt": ATTEMPT, "reason": _optional(FAILURE)}),
    Kind.FINAL.value: _record({"phase": PHASE, "reason": _optional(FAILURE)}, ("phase",)),
}


def check(body: Mapping[str, Any], *, from_master: bool) -> dict[str, Any]:
    """The message as its schema reads it (`t` and the fields it names); Malformed, naming the
    kind and the field, for anything else."""
    kind = body.get("t")
    schemas = FROM_MASTER if from_master else FROM_WORKER
    if kind not in schemas:
        sender = "the master" if from_master else "a worker"
        raise Malformed(f"no message {sender} sends ({str(kind)[:32]!r})")
    try:
        found = schemas[str(kind)](body)
    except Malformed as err:
        raise Malformed(f"{kind} message: {err}".replace(": lacks", " lacks")) from None
    assert isinstance(found, dict)
    return {**found, "t": kind}


# One restart of the job (protocol.py's Restart), or an attempt of an earlier launch.
RESTART = _record(
    {
        "attempt": ATTEMPT,
        "at": _optional(_text(32)),
        "after": _optional(FAILURE),
        "checkpoint": _optional(_text(4096)),
        "left_out": HOSTS,
        "note": MESSAGE,
        "resumed": _flag,
    }
)
# An agent's state file (agent.py's write_state), as root reads it.
STATE = _record(
    {
        "version": _integer(0, 1000),
        "job": HOST,
        "host": HOST,
        "rank": RANK,
        "role": _one_of("master", "worker"),
        "phase": PHASE,
        "attempt": ATTEMPT,
        "max_restarts": _integer(0, 1_000_000),
        "restarts": _list(RESTART, 10_000),
        # A resumed run's earlier launches' attempts (agent.py's carry_history).
        "history": _list(RESTART, 10_000),
        "exit_status": EXIT_STATUS,
        "reason": _optional(FAILURE),
        "progress": _mapping(_scalar, 64),
        "peers": _mapping(
            _record({"phase": PHASE, "connected": _flag, "silent_s": _optional(_number(0, 1e11))}),
            4096,
        ),
        "limits": _mapping(_scalar, 16),
        "pid": _optional(_integer(1, 1 << 22)),
        "child": _optional(_integer(1, 1 << 22)),
        "started_s": _number(0, 1e11),
        "started": _optional(_text(32)),
        "updated": _optional(_text(32)),
        "ended": _optional(_text(32)),
        "warnings": _list(MESSAGE, 1000),
        "left_out": HOSTS,
    }
)


def check_state(data: object) -> dict[str, Any]:
    """An agent's state file's JSON as its schema reads it; Malformed naming the field."""
    found = STATE(data)
    assert isinstance(found, dict)
    return found
