"""The llama-job status: the one definition of a job's phases, failure kinds and status, for
every layer that reads a job's state.

`Phase` and `FailureKind` are closed enums (a phase or a kind is one of their members, nothing
else); the typed objects are built from them: `Failure` (why an attempt ended), `Restart`,
`RankStatus` (one node's part of a job: what `llama-job status` prints), `NodeStatus` and
`JobStatus` (a job across the cluster: what the play, status.yml, the API and the CLI report),
`Resume` and `RunSummary` (what an ended run came to).

Each object is carried unchanged from the node to the user: `to_dict` is its JSON (enums as their
values) and `from_dict` reads it back, so the node's supervisor (the zipapp llama-job), the
controller's module (llama_job), its filters (filter/job.py, with the controller's cluster view,
module_utils/job_view.py), playbooks/status.yml and the Python API (llama_runner) share one
shape. The messages on the wire are wire.py's. Stdlib only, Python 3.10 (it runs on the nodes).
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any


class Phase(str, Enum):
    """Where a job stands: on one node (a rank's phase), or across the cluster (a job's)."""

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
    ABSENT = "absent"  # no such job on a node that answered (or a peer the master lost)
    UNKNOWN = "unknown"  # nothing known: the node (or every node) did not answer

    def is_terminal(self) -> bool:
        """Whether the job has ended in this phase."""
        return self in TERMINAL_PHASES

    def in_progress(self) -> bool:
        """Whether the job is coming up, running or restarting (not ended, and known)."""
        return not self.is_terminal() and self not in (Phase.ABSENT, Phase.UNKNOWN)

    def resumable(self) -> bool:
        """Whether a job that ended in this phase can be continued from a checkpoint."""
        return self in (Phase.FAILED, Phase.STOPPED)

    @classmethod
    def of(cls, value: object, default: Phase | None = None) -> Phase:
        """The phase a JSON value names; `default` (UNKNOWN) for anything else."""
        try:
            return cls(value)
        except ValueError:
            return default or cls.UNKNOWN


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED, Phase.STOPPED})


class FailureKind(str, Enum):
    """Why an attempt of a job ended badly (`Failure.kind`)."""

    EXITED = "exited"  # a command ended badly, or its output reported a failure
    VANISHED = "vanished"  # a node's agent closed its connection or fell silent
    STALLED = "stalled"  # no progress in rank 0's trainer log for too long
    START = "start"  # the job never got going (a port, the firewall, no checkpoint to resume)
    STOPPED = "stopped"  # a request to stop (llama-job stop)
    LOST = "lost"  # an agent ended without recording an outcome (its node rebooted, a kill)

    def restartable(self) -> bool:
        """Whether starting again from the last checkpoint may heal this failure."""
        return self in RESTARTABLE

    @classmethod
    def of(cls, value: object) -> FailureKind:
        """The kind a JSON value names (EXITED for anything else: a command that failed)."""
        try:
            return cls(value)
        except ValueError:
            return cls.EXITED


RESTARTABLE = frozenset(
    {FailureKind.EXITED, FailureKind.VANISHED, FailureKind.STALLED, FailureKind.LOST}
)


# --------------------------------------------------------------------------------------------
# Words shared by the agents and the status
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


def _plain(value: object) -> Any:  # noqa: ANN401 - JSON
    """A status object as JSON: dataclasses as objects, enums as their values."""
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    """A JSON number as a float (None for anything else, or an integer past a float's range)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _strings(value: object) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()


def _ranks(value: object) -> tuple[int, ...]:
    found = value if isinstance(value, list | tuple) else ()
    return tuple(r for r in found if _int(r) is not None)


def ranks_text(ranks: Iterable[int]) -> str:
    """'rank 3', 'ranks 2-3', 'ranks 0, 2, 5' (a node's processes, as status names them)."""
    found = list(ranks)
    if len(found) == 1:
        return f"rank {found[0]}"
    if found and found == list(range(found[0], found[0] + len(found))):
        return f"ranks {found[0]}-{found[-1]}"
    return "ranks " + ", ".join(str(r) for r in found)


def _mapping(value: object) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


# A trainer log record's figures, as every reader shows them (the training code writes the log:
# each figure is kept only with its type, finite, and a text only short; the rest is left out).
PROGRESS_COUNTS = ("current_steps", "total_steps")
PROGRESS_NUMBERS = ("loss", "lr", "epoch", "percentage", "throughput", "total_tokens")
PROGRESS_TEXTS = ("elapsed_time", "remaining_time")


def progress_record(value: object) -> dict[str, Any]:
    """A trainer log record (or a status's `progress`) as its figures: counts whole and not
    negative, numbers finite, texts at most 32 characters; anything else left out."""
    given = _mapping(value)
    found: dict[str, Any] = {}
    for key in PROGRESS_COUNTS:
        count = _int(given.get(key))
        if count is not None and count >= 0:
            found[key] = count
    for key in PROGRESS_NUMBERS:
        number = _number(given.get(key))
        if number is not None and math.isfinite(number):
            found[key] = number if isinstance(given[key], float) else given[key]
    for key in PROGRESS_TEXTS:
        text = _text(given.get(key))
        if text is not None and len(text) <= 32:
            found[key] = text
    return found


def _peers(value: object) -> dict[str, Any]:
    """A master's view of its peers: host -> {phase, connected, silent_s}, each of its type."""
    return {
        str(host)[:128]: {
            "phase": Phase.of(_mapping(peer).get("phase")).value,
            "connected": _mapping(peer).get("connected") is True,
            "silent_s": _number(_mapping(peer).get("silent_s")),
        }
        for host, peer in list(_mapping(value).items())[:4096]
    }


# --------------------------------------------------------------------------------------------
# Why an attempt ended, and the restarts that followed
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """Why an attempt of a job ended badly: the node that explains it, the kind, the message
    (with its cause first, when one is known), the exit status and the node's first error
    lines. `cause` says what ran out of memory (oom.py), else None."""

    node: str | None
    kind: FailureKind
    message: str
    rank: int | None = None
    exit_status: int | None = None
    errors: tuple[str, ...] = ()
    cause: Mapping[str, Any] | None = None
    at: str | None = None
    at_s: float | None = None
    attempt: int | None = None
    away: tuple[str, ...] = ()  # the nodes that did not come back for a restart
    # The node fell silent (no heartbeat, or no end of its command): its machine may be gone.
    # An agent that closed its connection was ended on a machine that still answers.
    silent: bool = False

    @classmethod
    def now(cls, node: str | None, kind: FailureKind, message: str, **given: Any) -> Failure:  # noqa: ANN401
        """A failure that happens now."""
        stamp = time.time()
        return cls(node=node, kind=kind, message=message, at=iso(stamp), at_s=stamp, **given)

    def said(self, more: str) -> Failure:
        """The same failure, its message followed by `more`."""
        return replace(self, message=self.message + more)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: object) -> Failure | None:
        """A failure from its JSON (None for anything that is not one)."""
        if not isinstance(data, Mapping) or not data:
            return None
        cause = data.get("cause")
        return cls(
            node=_text(data.get("node")),
            kind=FailureKind.of(data.get("kind")),
            message=str(data.get("message") or "it failed"),
            rank=_int(data.get("rank")),
            exit_status=_int(data.get("exit_status")),
            errors=_strings(data.get("errors")),
            cause=dict(cause) if isinstance(cause, Mapping) else None,
            at=_text(data.get("at")),
            at_s=_number(data.get("at_s")),
            attempt=_int(data.get("attempt")),
            away=_strings(data.get("away")),
            silent=data.get("silent") is True,
        )


@dataclass(frozen=True)
class Restart:
    """One restart of the whole job: the attempt it started, when, after which failure, and the
    checkpoint every node continued from (None: from the beginning); `resumed`: asked by hand
    (train.yml -e resume=true) after the launch before it ended, not one of max_restarts.
    A launch's `history` starts with the run's first attempt (attempt 1, `after` None)."""

    attempt: int
    at: str | None = None
    after: Failure | None = None
    checkpoint: str | None = None
    # The nodes it continued without (min_nodes: gone past the restart window), and the plan of
    # the run on the nodes that remained (the spec's fewer_nodes note).
    left_out: tuple[str, ...] = ()
    note: str = ""
    resumed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Its JSON."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: object) -> Restart | None:
        """A restart from its JSON (None for anything that is not one)."""
        if not isinstance(data, Mapping):
            return None
        return cls(
            attempt=_int(data.get("attempt")) or 0,
            at=_text(data.get("at")),
            after=Failure.from_dict(data.get("after")),
            checkpoint=_text(data.get("checkpoint")),
            left_out=_strings(data.get("left_out")),
            note=str(data.get("note") or ""),
            resumed=data.get("resumed") is True,
        )


def _restarts(value: object) -> tuple[Restart, ...]:
    found = (Restart.from_dict(item) for item in value) if isinstance(value, list | tuple) else ()
    return tuple(r for r in found if r is not None)


# --------------------------------------------------------------------------------------------
# One node's part of a job (llama-job status / list / wait / stop: "ranks")
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankStatus:
    """What one node's part of a job is doing: root's record of it and its agent's state.

    `progress` (rank 0's last trainer log record) and `peers` are the master's; `active` is true
    while the agent or anything it started still runs."""

    job: str
    host: str
    rank: int  # the node's rank
    role: str  # master or worker
    phase: Phase
    # The global ranks (torchrun's RANK) of the node's processes, in local order (LOCAL_RANK
    # 0, 1, ...); empty where the job does not say (a service, a job of an older llama-job).
    ranks: tuple[int, ...] = ()
    supervisor: str = ""
    unit: str = ""
    log: str = ""
    state: str = ""  # the agent's state file
    exclusive: bool = True
    active: bool = False
    leftover_pids: tuple[int, ...] = ()
    attempt: int = 1
    max_restarts: int = 0
    restarts: tuple[Restart, ...] = ()
    # The attempts of the launches before this one (a resumed run's), and how this one began.
    history: tuple[Restart, ...] = ()
    exit_status: int | None = None
    reason: Failure | None = None
    progress: Mapping[str, Any] = field(default_factory=dict)
    peers: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, Any] = field(default_factory=dict)
    started: str | None = None
    ended: str | None = None
    updated: str | None = None
    # What did not fail the run but is worth saying (a failure in teardown after every rank
    # reached the last step), and the nodes the current attempt runs without (min_nodes).
    warnings: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Its JSON (what llama-job prints)."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankStatus:
        """A rank's status from its JSON."""
        return cls(
            job=str(data.get("job") or ""),
            host=str(data.get("host") or ""),
            rank=_int(data.get("rank")) or 0,
            role=str(data.get("role") or ("master" if data.get("rank") == 0 else "worker")),
            phase=Phase.of(data.get("phase")),
            ranks=_ranks(data.get("ranks")),
            supervisor=str(data.get("supervisor") or ""),
            unit=str(data.get("unit") or ""),
            log=str(data.get("log") or ""),
            state=str(data.get("state") or ""),
            exclusive=data.get("exclusive") is not False,
            active=bool(data.get("active")),
            leftover_pids=tuple(p for p in data.get("leftover_pids") or () if _int(p) is not None),
            attempt=_int(data.get("attempt")) or 1,
            max_restarts=_int(data.get("max_restarts")) or 0,
            restarts=_restarts(data.get("restarts")),
            history=_restarts(data.get("history")),
            exit_status=_int(data.get("exit_status")),
            reason=Failure.from_dict(data.get("reason")),
            progress=progress_record(data.get("progress")),
            peers=_peers(data.get("peers")),
            limits=_mapping(data.get("limits")),
            started=_text(data.get("started")),
            ended=_text(data.get("ended")),
            updated=_text(data.get("updated")),
            warnings=_strings(data.get("warnings")),
            left_out=_strings(data.get("left_out")),
        )

    def given_up(self) -> tuple[str, ...]:
        """The nodes this rank's agent gave up (a master's verdict): the one that fell silent (not
        one whose agent closed its connection: that machine still answers), those that did not
        come back for a restart, and those the run went on without (min_nodes). The plays ask
        them no more."""
        reason = self.reason
        if reason is None:
            return tuple(h for h in self.left_out if h != self.host)
        silent = reason.kind is FailureKind.VANISHED and reason.silent
        lost = [reason.node] if silent and reason.node else []
        away = [*lost, *reason.away, *self.left_out]
        return tuple(h for h in dict.fromkeys(away) if h != self.host)

    def progress_line(self) -> str:
        """One human-readable progress line."""
        record = self.progress
        used, budget = len(self.restarts), self.max_restarts
        tail = f"  (restart {used} of {budget})" if used else ""
        if self.phase is Phase.RESTARTING:
            reason = self.reason
            after = f"{reason.node}: {reason.message}" if reason else "a failure"
            return f"restarting after {after} (restart {used + 1} of {budget})"
        if self.phase in (Phase.STARTING, Phase.WAITING) and not record:
            joined = sum(1 for p in self.peers.values() if _mapping(p).get("connected"))
            return f"starting: {joined} of {len(self.peers)} other nodes joined{tail}"
        if not record:
            return f"{self.phase.value}{tail}"
        parts = record_line(record)
        if self.phase is not Phase.RUNNING:
            parts.insert(0, self.phase.value)
        if self.left_out:
            parts.append(f"without {', '.join(self.left_out)}")
        return "  ".join(parts) + tail


def record_line(record: Mapping[str, Any]) -> list[str]:
    """A trainer log record's figures, as the progress line says them."""
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


def lost_failure(record: Mapping[str, Any], errors: Iterable[str]) -> Failure:
    """The failure of a rank whose agent ended without recording an outcome."""
    return Failure(
        node=str(record["host"]),
        rank=_int(record.get("rank")),
        kind=FailureKind.LOST,
        message=f"its supervisor ({record['unit']}) ended without recording an outcome",
        errors=tuple(errors),
    )


def rank_status(
    record: Mapping[str, Any],
    state: Mapping[str, Any],
    alive: bool,
    left: list[int],
    errors: list[str] | None = None,
) -> RankStatus:
    """What one node's part of a job is doing: root's record, the agent's state (already
    checked to be this launch's, else {}), whether the agent lives and what outlived it;
    `errors` are the log's error lines, read only for an agent that ended without an outcome."""
    phase = Phase.of(state.get("phase"), Phase.STARTING)
    reason = Failure.from_dict(state.get("reason"))
    if not alive and not phase.is_terminal():
        if record.get("stop_requested"):
            phase = Phase.STOPPED
        else:
            phase, reason = Phase.FAILED, lost_failure(record, errors or [])
    rank = int(record["rank"])
    return RankStatus(
        job=str(record["job"]),
        host=str(record["host"]),
        rank=rank,
        role=str(state.get("role") or ("master" if rank == 0 else "worker")),
        phase=phase,
        ranks=_ranks(record.get("ranks")),
        supervisor=str(record["supervisor"]),
        unit=str(record["unit"]),
        log=str(record["log"]),
        state=str(record["state"]),
        exclusive=record.get("exclusive", True) is not False,
        active=alive or bool(left),
        leftover_pids=tuple(left),
        attempt=_int(state.get("attempt")) or 1,
        max_restarts=_int(state.get("max_restarts")) or 0,
        restarts=_restarts(state.get("restarts")),
        history=_restarts(state.get("history")),
        exit_status=_int(state.get("exit_status")),
        reason=reason,
        progress=progress_record(state.get("progress")),
        peers=_peers(state.get("peers")),
        limits=_mapping(state.get("limits")),
        started=_text(record.get("started")),
        ended=_text(state.get("ended")),
        updated=_text(state.get("updated")),
        warnings=_strings(state.get("warnings")),
        left_out=_strings(state.get("left_out")),
    )


def leading(ranks: list[RankStatus]) -> RankStatus | None:
    """The rank whose view speaks for the job on one node: the master's, else the first."""
    return next((r for r in ranks if r.role == "master"), ranks[0] if ranks else None)


def got_going(lead: RankStatus | None) -> bool:
    """Whether a job started: it is known here and did not fail or stop before running."""
    return lead is not None and lead.phase not in (Phase.FAILED, Phase.STOPPED, Phase.UNKNOWN)


# --------------------------------------------------------------------------------------------
# A job across the cluster, from each node's status
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeStatus:
    """One node in a job's status: its rank's phase, or that it did not answer."""

    phase: Phase
    reachable: bool = True
    active: bool | None = False  # None: not known (it did not answer)
    rank: int | None = None
    unit: str | None = None
    log: str | None = None
    exit_status: int | None = None
    supervisor: str | None = None
    ranks: tuple[int, ...] = ()  # the global ranks of its processes (RankStatus.ranks)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON."""
        return _plain(self)

    @classmethod
    def of(cls, rank: RankStatus) -> NodeStatus:
        """A node's view from its rank's status."""
        return cls(
            phase=rank.phase,
            active=rank.active,
            rank=rank.rank,
            ranks=rank.ranks,
            unit=rank.unit,
            log=rank.log,
            exit_status=rank.exit_status,
            supervisor=rank.supervisor,
        )

    @classmethod
    def from_dict(cls, data: object) -> NodeStatus:
        """A node's view from its JSON."""
        given = _mapping(data)
        active = given.get("active")
        return cls(
            phase=Phase.of(given.get("phase")),
            reachable=given.get("reachable") is not False,
            active=active if isinstance(active, bool) or active is None else bool(active),
            rank=_int(given.get("rank")),
            unit=_text(given.get("unit")),
            log=_text(given.get("log")),
            exit_status=_int(given.get("exit_status")),
            supervisor=_text(given.get("supervisor")),
            ranks=_ranks(given.get("ranks")),
        )


@dataclass(frozen=True)
class Resume:
    """How a failed or stopped run can be continued: the checkpoint every node would continue
    from (the rule of `-e resume=true` and of an automatic restart) and the command, or why not
    (checkpoint and command None)."""

    checkpoint: str | None
    command: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        """Its JSON."""
        return _plain(self)


@dataclass(frozen=True)
class RunSummary:
    """What an ended run came to: its last step, final loss (the last attempt's last logged
    loss), time (`time_from`: llama-job's start to end, else the trainer log's elapsed time),
    restarts (`restarted_after`: the node that failed before each), and for a failed or stopped
    run how to continue it."""

    step: int | None = None
    total_steps: int | None = None
    final_loss: float | None = None
    time_s: float | None = None
    time_from: str = ""
    restarts: int = 0
    max_restarts: int = 0
    restarted_after: tuple[str, ...] = ()
    resume: Resume | None = None

    def to_dict(self) -> dict[str, Any]:
        """Its JSON."""
        return _plain(self)

    @classmethod
    def from_dict(cls, data: object) -> RunSummary | None:
        """A summary from its JSON (None for anything that is not one)."""
        if not isinstance(data, Mapping) or not data:
            return None
        resume = data.get("resume")
        return cls(
            step=_int(data.get("step")),
            total_steps=_int(data.get("total_steps")),
            final_loss=_number(data.get("final_loss")),
            time_s=_number(data.get("time_s")),
            time_from=str(data.get("time_from") or ""),
            restarts=_int(data.get("restarts")) or 0,
            max_restarts=_int(data.get("max_restarts")) or 0,
            restarted_after=_strings(data.get("restarted_after")),
            resume=(
                Resume(
                    checkpoint=_text(resume.get("checkpoint")),
                    command=_text(resume.get("command")),
                    message=str(resume.get("message") or ""),
                )
                if isinstance(resume, Mapping)
                else None
            ),
        )


@dataclass(frozen=True)
class JobStatus:
    """A job across the cluster: the master's agent's view (the workers' own records when the
    master did not answer), every node's phase, the restarts and rank 0's progress; for an ended
    run the summary (`RunSummary`, which status.yml adds).

    What the play sets as `job_status`, status.yml hands to ansible-runner as `llama_status`, and
    Cluster.status() returns; `to_dict` adds `in_progress`, `succeeded` and `resumable`, the
    phase's tests, for the playbooks' conditions."""

    job: str
    phase: Phase
    reason: Failure | None = None
    unreachable: tuple[str, ...] = ()  # the nodes that did not answer
    active: tuple[str, ...] = ()  # the nodes where something of the job still runs
    nodes: Mapping[str, NodeStatus] = field(default_factory=dict)
    attempt: int = 1
    max_restarts: int = 0
    restarts: tuple[Restart, ...] = ()
    history: tuple[Restart, ...] = ()  # before this launch: a resumed run's earlier attempts
    progress: Mapping[str, Any] = field(default_factory=dict)  # rank 0's last trainer log record
    started: str | None = None
    ended: str | None = None
    # What the last attempt's records of rank 0's trainer log say (trainer_log.log_figures),
    # where the master's status was given the log.
    trainer_log: Mapping[str, Any] = field(default_factory=dict)
    summary: RunSummary | None = None
    warnings: tuple[str, ...] = ()  # the master's (RankStatus.warnings)
    left_out: tuple[str, ...] = ()  # the nodes the last attempt ran without (min_nodes)

    @property
    def node(self) -> str | None:
        """The node that explains a failure or a stop."""
        return self.reason.node if self.reason else None

    @property
    def exit_status(self) -> int | None:
        """The failed process's exit status, where one is known."""
        return self.reason.exit_status if self.reason else None

    @property
    def step(self) -> int | None:
        """The run's last step: an ended run's summary, else rank 0's last record."""
        if self.summary and self.summary.step is not None:
            return self.summary.step
        return _int(self.progress.get("current_steps"))

    @property
    def total_steps(self) -> int | None:
        """The run's steps in all, as the trainer log says."""
        if self.summary and self.summary.total_steps:
            return self.summary.total_steps
        return _int(self.progress.get("total_steps"))

    def to_dict(self) -> dict[str, Any]:
        """Its JSON, with the phase's tests."""
        return {
            **_plain(self),
            "in_progress": self.phase.in_progress(),
            "succeeded": self.phase is Phase.SUCCEEDED,
            "resumable": self.phase.resumable(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobStatus:
        """A job's status from its JSON."""
        return cls(
            job=str(data.get("job") or ""),
            phase=Phase.of(data.get("phase")),
            reason=Failure.from_dict(data.get("reason")),
            unreachable=_strings(data.get("unreachable")),
            active=_strings(data.get("active")),
            nodes={str(h): NodeStatus.from_dict(n) for h, n in _mapping(data.get("nodes")).items()},
            attempt=_int(data.get("attempt")) or 1,
            max_restarts=_int(data.get("max_restarts")) or 0,
            restarts=_restarts(data.get("restarts")),
            history=_restarts(data.get("history")),
            progress=progress_record(data.get("progress")),
            started=_text(data.get("started")),
            ended=_text(data.get("ended")),
            trainer_log=_mapping(data.get("trainer_log")),
            summary=RunSummary.from_dict(data.get("summary")),
            warnings=_strings(data.get("warnings")),
            left_out=_strings(data.get("left_out")),
        )
