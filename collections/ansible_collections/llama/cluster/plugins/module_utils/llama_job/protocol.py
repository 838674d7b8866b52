"""The llama-job protocol: one definition of a job's phases, its messages, its status and its
outcome, for every layer that reads a job's state.

The node's supervisor (the zipapp llama-job), the controller's module (llama_job), its filters
(filter/job.py) and the Python API (llama_runner) all import this module; none reshapes a
rank's status or a job's outcome on its own. Stdlib only, Python 3.10 (it runs on the nodes).

On the watchdog port every message is one line, `<seq> <mac> <body>`: a sequence number, the
HMAC-SHA256 (64 hex digits) under the job's secret of the job id, the sequence number and the
body as they are on the wire, and the body, the message's canonical JSON. The secret never
crosses the wire. A line is checked on its raw bytes first: one longer than MAX_LINE, not of
that shape, whose mac does not verify or whose sequence number is not above the last one
accepted on that connection is refused before any JSON is parsed; a body that verifies is
parsed only when it nests at most MAX_DEPTH deep.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import signal
import time
from collections.abc import Mapping
from enum import Enum
from typing import Any

VERSION = 1
MAX_LINE = 64 << 10  # bytes of one message on the watchdog port, newline included
HELLO_WITHIN = 5.0  # seconds a new connection has to authenticate itself
MAX_DEPTH = 32  # nesting of a message's arrays and objects (the runners' nest a few levels)


class Phase(str, Enum):
    """Where one node's part of a job stands (what `llama-job status` reports per rank)."""

    STARTING = "starting"  # the master's command is starting, the peers joining
    WAITING = "waiting"  # a worker waits for the master's start
    RUNNING = "running"
    STOPPING = "stopping"  # the master is ending an attempt on every node
    RESTARTING = "restarting"  # ... and will start the next once every node is back
    IDLE = "idle"  # a worker's command ended; it waits for the master's word
    DONE = "done"  # a worker's command succeeded; the master has not said the job did
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"

    def is_terminal(self) -> bool:
        """Whether the job has ended in this phase."""
        return self in TERMINAL_PHASES


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.STOPPED})
TERMINAL = tuple(p.value for p in (Phase.SUCCEEDED, Phase.FAILED, Phase.STOPPED))


def is_terminal(phase: object) -> bool:
    """Whether a phase (its name as JSON carries it) is one a job ends in."""
    return phase in TERMINAL


# A run as Cluster.status() reports it (llama_runner): the phases a user tells apart.
RUN_STATES = ("starting", "running", "restarting", "succeeded", "failed", "stopped")
ACTIVE_STATES = frozenset(RUN_STATES[:3])
PHASE_STATES = {
    Phase.STARTING.value: "starting",
    Phase.WAITING.value: "starting",
    Phase.RUNNING.value: "running",
    Phase.STOPPING.value: "running",
    Phase.RESTARTING.value: "restarting",
    Phase.SUCCEEDED.value: "succeeded",
    Phase.FAILED.value: "failed",
    Phase.STOPPED.value: "stopped",
}


def run_state(phase: object) -> str:
    """A job's phase as a run's state (an unknown phase: stopped, as nothing is left running)."""
    return PHASE_STATES.get(str(phase or ""), "stopped")


class Kind(str, Enum):
    """The messages on the watchdog port (worker to master: hello, beat, exit, idle)."""

    HELLO = "hello"  # a worker joins: host, rank, phase, attempt, nonce
    WELCOME = "welcome"  # the master accepts it: phase, attempt, the worker's nonce back
    REFUSED = "refused"
    BEAT = "beat"
    START = "start"
    RESTART = "restart"
    ABORT = "abort"
    FINAL = "final"
    EXIT = "exit"
    IDLE = "idle"


# Failure kinds a restart may heal (a request to stop or a failed start may not).
RESTARTABLE = ("exited", "vanished", "stalled", "lost")


# --------------------------------------------------------------------------------------------
# Framing: one authenticated message per line
# --------------------------------------------------------------------------------------------
class BadMessage(ValueError):
    """A line that is not a message of this job: too long, malformed, forged or replayed."""


FRAME = re.compile(rb"(0|[1-9][0-9]{0,17}) ([0-9a-f]{64}) (\{.*\})\n?", re.DOTALL)
JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
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
        older = line.startswith(b'{"')  # llama-job before issue 40 sent JSON frames
        raise BadMessage(
            "a frame of an older llama-job (run provision.yml on every node)"
            if older
            else "not a frame"
        )
    number, mac, text = frame.groups()
    if not hmac.compare_digest(mac, _mac(key, job, number, text)):
        raise BadMessage("bad mac")
    seq = int(number)
    if seq <= last_seq:
        raise BadMessage(f"replayed (sequence {seq}, last {last_seq})")
    if too_deep(text):
        raise BadMessage(f"nested deeper than {MAX_DEPTH}")
    try:
        body = json.loads(text.decode("ascii"))
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate cannot be written out
    except (ValueError, RecursionError) as err:  # UnicodeError is a ValueError
        raise BadMessage("no JSON in the frame") from err
    if not isinstance(body, dict) or not isinstance(body.get("t"), str):
        raise BadMessage("no message in the frame")
    return seq, body


# --------------------------------------------------------------------------------------------
# Words shared by the runners and the status
# --------------------------------------------------------------------------------------------
def iso(stamp: float | None) -> str | None:
    """UTC time as 2026-12-01T10:00:00Z."""
    return None if stamp is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))


def describe_exit(code: int | None) -> str:
    """'exit status 1' or 'killed by signal 9 (SIGKILL)'."""
    if code is None:
        return "no exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {-code} ({name})"
    return f"exit status {code}"


# --------------------------------------------------------------------------------------------
# The status of one rank (llama-job status / list / wait / stop: "ranks")
# --------------------------------------------------------------------------------------------
def lost_reason(record: Mapping[str, Any], errors: list[str]) -> dict[str, Any]:
    """The failure of a rank whose runner ended without recording an outcome."""
    return {
        "node": record["host"],
        "rank": record["rank"],
        "kind": "lost",
        "exit_status": None,
        "message": f"its supervisor ({record['unit']}) ended without recording an outcome",
        "errors": errors,
    }


def rank_status(
    record: Mapping[str, Any],
    state: Mapping[str, Any],
    alive: bool,
    left: list[int],
    errors: list[str] | None = None,
) -> dict[str, Any]:
    """What one node's part of a job is doing: root's record, the runner's state (already
    checked to be this launch's, else {}), whether the runner lives and what outlived it;
    `errors` are the log's error lines, read only for a runner that ended without an outcome."""
    phase = state.get("phase") or Phase.STARTING.value
    reason = state.get("reason")
    if not alive and not is_terminal(phase):
        if record.get("stop_requested"):
            phase = Phase.STOPPED.value
        else:
            phase, reason = Phase.FAILED.value, lost_reason(record, errors or [])
    return {
        "job": record["job"],
        "host": record["host"],
        "rank": record["rank"],
        "role": state.get("role", "master" if record["rank"] == 0 else "worker"),
        "supervisor": record["supervisor"],
        "exclusive": record.get("exclusive", True),
        "unit": record["unit"],
        "active": alive or bool(left),
        "leftover_pids": left,
        "phase": phase,
        "attempt": state.get("attempt", 1),
        "max_restarts": state.get("max_restarts", 0),
        "restarts": state.get("restarts", []),
        "exit_status": state.get("exit_status"),
        "reason": reason,
        "progress": state.get("progress") or {},
        "peers": state.get("peers") or {},
        "limits": state.get("limits") or {},
        "log": record["log"],
        "state": record["state"],
        "started": record.get("started"),
        "ended": state.get("ended"),
        "updated": state.get("updated"),
    }


def leading(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank whose view speaks for the job on one node: the master's, else the first."""
    return next((r for r in ranks if r.get("role") == "master"), ranks[0] if ranks else {})


def _record_line(record: Mapping[str, Any]) -> list[str]:
    parts = [f"step {record.get('current_steps', '?')}/{record.get('total_steps', '?')}"]
    if isinstance(record.get("percentage"), int | float):
        parts[0] += f" ({record['percentage']:.0f}%)"
    if isinstance(record.get("loss"), int | float):
        parts.append(f"loss {record['loss']:.4f}")
    if isinstance(record.get("lr"), int | float):
        parts.append(f"lr {record['lr']:.2e}")
    if record.get("throughput"):
        parts.append(f"{record['throughput']:.0f} tokens/s")
    if record.get("elapsed_time"):
        parts.append(f"elapsed {record['elapsed_time']}")
    if record.get("remaining_time"):
        parts.append(f"eta {record['remaining_time']}")
    return parts


def progress_line(rank: Mapping[str, Any]) -> str:
    """One human-readable progress line from a rank's status."""
    phase = rank.get("phase", "?")
    record = rank.get("progress") or {}
    restarts = len(rank.get("restarts") or [])
    budget = rank.get("max_restarts") or 0
    tail = f"  (restart {restarts} of {budget})" if restarts else ""
    if phase == Phase.RESTARTING.value:
        reason = rank.get("reason") or {}
        return (
            f"restarting after {reason.get('node')}: {reason.get('message')} "
            f"(restart {restarts + 1} of {budget})"
        )
    if phase in (Phase.STARTING.value, Phase.WAITING.value) and not record:
        peers = rank.get("peers") or {}
        joined = sum(1 for p in peers.values() if p.get("connected"))
        return f"starting: {joined} of {len(peers)} other nodes joined{tail}"
    if not record:
        return f"{phase}{tail}"
    parts = _record_line(record)
    if phase != Phase.RUNNING.value:
        parts.insert(0, phase)
    return "  ".join(parts) + tail


# --------------------------------------------------------------------------------------------
# The outcome of a job across the cluster, from each node's status
# --------------------------------------------------------------------------------------------
def node_ranks(result: object) -> list[dict[str, Any]]:
    """The rank statuses in one node's `llama_job status` result ([] when it did not answer)."""
    if not answered(result):
        return []
    assert isinstance(result, Mapping)
    return [r for r in result.get("ranks") or [] if isinstance(r, Mapping)]


def answered(result: object) -> bool:
    """Whether a node's registered result is an answer (not unreachable, not failed)."""
    return isinstance(result, Mapping) and not (result.get("unreachable") or result.get("failed"))


def _node_view(rank: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "phase": rank.get("phase"),
        "active": bool(rank.get("active")),
        "reachable": True,
        "rank": rank.get("rank"),
        "unit": rank.get("unit"),
        "log": rank.get("log"),
        "exit_status": rank.get("exit_status"),
        "supervisor": rank.get("supervisor"),
    }


def _views(results: Mapping[str, object]) -> tuple[dict, list, list]:
    """Per node its view, the nodes that did not answer, and every (host, rank) reported."""
    nodes: dict[str, dict[str, Any]] = {}
    unreachable: list[str] = []
    views: list[tuple[str, Mapping[str, Any]]] = []
    for host, result in sorted(results.items()):
        ranks = node_ranks(result)
        if not ranks and not answered(result):
            unreachable.append(host)
            nodes[host] = {"phase": "unknown", "active": None, "reachable": False}
        elif not ranks:
            nodes[host] = {"phase": "absent", "active": False, "reachable": True}
        for rank in ranks:
            views.append((host, rank))
            nodes[host] = _node_view(rank)
    return nodes, unreachable, views


def _lead(views: list, master: str) -> tuple[str | None, Mapping[str, Any] | None]:
    """The master's runner's view: on the master host first, else wherever one reports."""
    for wanted in (lambda h: h == master, lambda _h: True):
        for host, rank in views:
            if wanted(host) and rank.get("role") == "master":
                return host, rank
    return None, None


def _workers_verdict(views: list, unreachable: list[str], master: str) -> tuple[str, Any]:
    """Without the master's view: what the workers' own records say."""
    finals = [r for _, r in views if is_terminal(r.get("phase"))]
    failed = [r for r in finals if r.get("phase") == Phase.FAILED.value]
    source = failed[0] if failed else (finals[0] if finals else None)
    phase = source.get("phase") if source else ("unknown" if unreachable else "absent")
    reason = source.get("reason") if source else None
    if reason is None and master in unreachable:
        reason = {
            "node": master,
            "kind": "vanished",
            "message": "the master did not answer",
            "exit_status": None,
            "errors": [],
        }
        phase = Phase.FAILED.value if phase in ("unknown", "absent") else phase
    return str(phase), reason


def job_outcome(results: Mapping[str, object], master: str) -> dict[str, Any]:
    """One job's state across the cluster from each node's `llama_job status` result.

    A node without a result mapping counts as unreachable. The master's runner coordinates
    the job, so its view wins; without it, the workers' own records say what they saw
    (typically that the master vanished).
    """
    nodes, unreachable, views = _views(results)
    lead_host, lead = _lead(views, master)
    if lead is not None:
        phase, reason = str(lead.get("phase", "unknown")), lead.get("reason")
    else:
        phase, reason = _workers_verdict(views, unreachable, master)
    if phase == Phase.SUCCEEDED.value:
        reason = None
    lead, cause = lead or {}, reason or {}
    lead_result = results.get(lead_host or "")
    return {
        "phase": phase,
        "reason": reason,
        "node": cause.get("node"),
        "exit_status": cause.get("exit_status"),
        "errors": list(cause.get("errors") or []),
        "unreachable": unreachable,
        "active": sorted(h for h, n in nodes.items() if n.get("active")),
        "nodes": nodes,
        "attempt": lead.get("attempt", 1),
        "max_restarts": lead.get("max_restarts", 0),
        "restarts": list(lead.get("restarts") or []),
        "progress": dict(lead.get("progress") or {}),
        "started": lead.get("started"),
        "ended": lead.get("ended"),
        # What the last attempt's records of rank 0's trainer log say, where the master's
        # `llama_job status` was given the log (progress_file).
        "trainer_log": dict(
            (lead_result.get("trainer_log") if isinstance(lead_result, Mapping) else None) or {}
        ),
    }
