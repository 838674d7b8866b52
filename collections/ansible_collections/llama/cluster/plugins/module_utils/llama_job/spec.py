"""The job's specification (written by roles/job, read by `start` and by the agent), checked
once into dataclasses: nothing after load_spec looks at the raw JSON again."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .logs import DEFAULT_ROTATE
from .untrusted import read_untrusted

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NAME_RULE = "letters, digits, '.', '_' or '-' (ASCII), a letter or digit first, at most 128"
DEFAULT_TIMEOUTS = {
    "start": 300.0,  # the master's command must listen on the gate port and every peer join
    "heartbeat": 2.0,  # seconds between heartbeats
    "peer": 30.0,  # a peer silent for this long has vanished
    "stop": 10.0,  # SIGTERM, then SIGKILL after this long
    "restart": 120.0,  # how long a restart waits for every node to be back
    "settle": 2.0,  # how long other failures are collected before naming the first
    "stall_startup": 1800.0,  # no first progress record within this long: stalled
    "stall_floor": 600.0,  # the least time without a new record that counts as a stall
    "stall_factor": 10.0,  # ... or this many times the median time between records
}
DEFAULT_LIMITS = {"memlock": "infinity", "nofile": 1048576}


class Refused(Exception):
    """A request that cannot be carried out; the message says why and what to do."""


def check_name(kind: str, value: object) -> str:
    """A job id or host name safe in a unit name and a file name."""
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise Refused(f"{kind} {value!r} must be {NAME_RULE}")
    return value


@dataclass(frozen=True)
class Timeouts:
    """The job's clocks, in seconds (DEFAULT_TIMEOUTS says what each is)."""

    start: float
    heartbeat: float
    peer: float
    stop: float
    restart: float
    settle: float
    stall_startup: float
    stall_floor: float
    stall_factor: float

    @classmethod
    def from_spec(cls, path: str, given: object) -> Timeouts:
        """The spec's timeouts over the defaults; each a positive number."""
        merged = {**DEFAULT_TIMEOUTS, **(given if isinstance(given, Mapping) else {})}
        for key in DEFAULT_TIMEOUTS:
            value = merged[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise Refused(f"{path}: timeouts.{key} must be a positive number of seconds")
        return cls(**{key: float(merged[key]) for key in DEFAULT_TIMEOUTS})

    def as_dict(self) -> dict[str, float]:
        """The timeouts by name."""
        return asdict(self)


@dataclass(frozen=True)
class Master:
    """Rank 0's node: its inventory name and the address its peers reach it on."""

    host: str
    address: str


@dataclass(frozen=True)
class FewerNodes:
    """The run on fewer nodes than it started with: the arguments its command is given on
    each of them (e.g. gradient_accumulation_steps=16) and the plan's words for it."""

    args: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class JobSpec:
    """One node's part of a job."""

    job: str
    host: str
    rank: int
    nnodes: int
    role: str  # master or worker
    watchdog_port: int
    max_restarts: int
    cwd: str
    log: str
    state: str
    env_file: str
    command: tuple[str, ...]
    master: Master
    timeouts: Timeouts
    token: str = ""  # the job's secret: the key of every message on the watchdog port
    # The master's peers: each worker's inventory name and the address its agent connects from
    # (its cluster_address): the watchdog serves no other address, and each only as that node.
    peers: dict[str, str] = field(default_factory=dict)
    address: str = ""  # this node's cluster_address, the source of a worker's connection
    ports: tuple[int, ...] = ()
    gate_port: int | None = None
    master_port: int | None = None
    progress_file: str = ""
    fail_patterns: tuple[str, ...] = ()
    limits: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    exclusive: bool = True
    secret_env_file: str = ""
    # A run continues from one checkpoint on every node (checkpoints.py), after a failure (an
    # automatic restart) and, with `resume`, from its first attempt (-e resume=true): the
    # directory of this node's checkpoint-N ("" for a job without checkpoints), the argument that
    # passes the checkpoint to the command ("{checkpoint}" is its path), and whether each
    # node's checkpoint holds only its own ranks' state (the plan's `sharded`).
    checkpoints_dir: str = ""
    resume_argument: str = ""
    sharded: bool = False
    resume: bool = False
    # The node's log is rotated past log_max_bytes, log_keep rotated files kept (logs.rotate_log).
    log_max_bytes: int = DEFAULT_ROTATE["max_bytes"]
    log_keep: int = DEFAULT_ROTATE["keep"]
    # The global ranks (torchrun's RANK) of this node's processes, in local order: what status
    # names (empty for a job that is not torchrun's, such as a service).
    ranks: tuple[int, ...] = ()
    # A checkpoint's planned size on this node (bytes; 0: not planned) and the disk's write
    # speed (bytes/s; 0: measured by the master's agent): what bounds a save (saves.py).
    checkpoint_bytes: int = 0
    disk_write_bps: float = 0.0
    # The fewest nodes the run may continue on when others stay away past the restart window
    # (0: every node), and for each count below nnodes what its command is given (the
    # controller's plan for that many nodes: the same effective batch, memory checked again).
    min_nodes: int = 0
    fewer_nodes: dict[int, FewerNodes] = field(default_factory=dict)

    @property
    def is_master(self) -> bool:
        """Whether this node's agent coordinates the job."""
        return self.role == "master"

    @property
    def key(self) -> bytes:
        """The key of the job's messages."""
        return self.token.encode()

    def __getitem__(self, name: str) -> Any:  # noqa: ANN401 - one of the fields
        """A field by name, as the spec's JSON names it."""
        if name not in {f.name for f in fields(self)}:
            raise KeyError(name)
        return getattr(self, name)


def _integers(path: str, raw: Mapping[str, Any]) -> None:
    for key in ("rank", "nnodes", "watchdog_port", "max_restarts"):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise Refused(f"{path}: {key} must be a non-negative integer")


def _paths(path: str, raw: Mapping[str, Any]) -> None:
    for key in ("cwd", "log", "state", "env_file"):
        if not isinstance(raw.get(key), str) or not raw[key].startswith("/"):
            raise Refused(f"{path}: {key} must be an absolute path")
    for key in ("secret_env_file", "checkpoints_dir"):
        given = raw.get(key, "")
        if not isinstance(given, str) or (given and not given.startswith("/")):
            raise Refused(f"{path}: {key} must be an absolute path or empty")
    argument = raw.get("resume_argument", "")
    if not isinstance(argument, str) or (argument and "{checkpoint}" not in argument):
        raise Refused(f"{path}: resume_argument must hold {{checkpoint}} (or be empty)")
    if raw.get("resume") and not (raw.get("checkpoints_dir") and argument):
        raise Refused(f"{path}: resume needs checkpoints_dir and resume_argument")


def _command(path: str, raw: Mapping[str, Any]) -> tuple[str, ...]:
    command = raw.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise Refused(f"{path}: command must be a non-empty list of strings")
    return tuple(command)


def _patterns(path: str, raw: Mapping[str, Any]) -> tuple[str, ...]:
    patterns = raw.get("fail_patterns") or []
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            raise Refused(
                f"{path}: fail_patterns: {pattern!r} is not a regular expression"
            ) from err
    return tuple(patterns)


def _log_rotate(path: str, raw: Mapping[str, Any]) -> tuple[int, int]:
    """The log's rotation: (max_bytes, keep), each an integer (at least 1 KiB, at least 1)."""
    given = raw.get("log_rotate") or {}
    merged = {**DEFAULT_ROTATE, **(given if isinstance(given, Mapping) else {})}
    size, keep = merged["max_bytes"], merged["keep"]
    for key, value, least in (("max_bytes", size, 1024), ("keep", keep, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise Refused(f"{path}: log_rotate.{key} must be an integer of at least {least}")
    return size, keep


def _ranks(path: str, raw: Mapping[str, Any]) -> tuple[int, ...]:
    given = raw.get("ranks") or []
    if not isinstance(given, list) or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in given
    ):
        raise Refused(f"{path}: ranks must be a list of non-negative integers")
    return tuple(given)


def _fewer_nodes(path: str, raw: Mapping[str, Any]) -> tuple[int, dict[int, FewerNodes]]:
    """min_nodes (0: every node) and the plan of each count from it up to nnodes - 1."""
    least = raw.get("min_nodes") or 0
    nnodes = raw["nnodes"]
    if isinstance(least, bool) or not isinstance(least, int) or not 0 <= least <= nnodes:
        raise Refused(f"{path}: min_nodes must be an integer from 1 to nnodes ({nnodes}), or 0")
    given = raw.get("fewer_nodes") or {}
    plans = {}
    for count in range(least or nnodes, nnodes):
        entry = given.get(str(count)) if isinstance(given, Mapping) else None
        args = entry.get("args") if isinstance(entry, Mapping) else None
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise Refused(f"{path}: fewer_nodes.{count}.args must be a list of strings")
        plans[count] = FewerNodes(tuple(args), str(entry.get("note") or ""))
    return least, plans


def _non_negative(path: str, raw: Mapping[str, Any], key: str) -> int:
    """A number the spec may leave out (0), as an integer."""
    value = raw.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise Refused(f"{path}: {key} must be a non-negative number")
    return int(value)


def _master(raw: Mapping[str, Any]) -> Master:
    given = raw.get("master") if isinstance(raw.get("master"), Mapping) else {}
    return Master(host=str(given.get("host", raw["host"])), address=str(given.get("address", "")))


def _peers(path: str, raw: Mapping[str, Any]) -> dict[str, str]:
    """The master's peers: {host: its cluster address}, each host a name and each address an IP."""
    given = raw.get("peers") or {}
    if not isinstance(given, Mapping):
        raise Refused(
            f"{path}: peers must map each worker to its cluster_address (written by roles/job; "
            "run the play again)"
        )
    for host, address in given.items():
        check_name("peer", host)
        try:
            ipaddress.ip_address(address)
        except (TypeError, ValueError) as err:
            raise Refused(f"{path}: peers.{host} must be an IP address (got {address!r})") from err
    return {str(host): str(address) for host, address in given.items()}


def _optional_port(value: object) -> int | None:
    """A port the spec may leave out (null, 0 or "" for none; a number or its digits)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value else None


def parse_spec(path: str, raw: Mapping[str, Any]) -> JobSpec:
    """A spec's JSON object, checked; Refused names the first problem."""
    check_name("job", raw.get("job"))
    check_name("host", raw.get("host"))
    _integers(path, raw)
    _paths(path, raw)
    if raw.get("role") not in ("master", "worker"):
        raise Refused(f"{path}: role must be master or worker")
    log_max_bytes, log_keep = _log_rotate(path, raw)
    min_nodes, fewer_nodes = _fewer_nodes(path, raw)
    return JobSpec(
        job=raw["job"],
        host=raw["host"],
        rank=raw["rank"],
        nnodes=raw["nnodes"],
        role=raw["role"],
        watchdog_port=raw["watchdog_port"],
        max_restarts=raw["max_restarts"],
        cwd=raw["cwd"],
        log=raw["log"],
        state=raw["state"],
        env_file=raw["env_file"],
        command=_command(path, raw),
        master=_master(raw),
        timeouts=Timeouts.from_spec(path, raw.get("timeouts")),
        token=str(raw.get("token") or ""),
        peers=_peers(path, raw),
        address=str(raw.get("address") or ""),
        ports=tuple(int(p) for p in raw.get("ports") or []),
        gate_port=_optional_port(raw.get("gate_port")),
        master_port=_optional_port(raw.get("master_port")),
        progress_file=str(raw.get("progress_file") or ""),
        fail_patterns=_patterns(path, raw),
        limits=dict(raw.get("limits") or DEFAULT_LIMITS),
        exclusive=bool(raw.get("exclusive", True)),
        secret_env_file=str(raw.get("secret_env_file") or ""),
        checkpoints_dir=str(raw.get("checkpoints_dir") or "").rstrip("/"),
        resume_argument=str(raw.get("resume_argument") or ""),
        sharded=bool(raw.get("sharded", False)),
        resume=bool(raw.get("resume", False)),
        log_max_bytes=log_max_bytes,
        log_keep=log_keep,
        ranks=_ranks(path, raw),
        checkpoint_bytes=_non_negative(path, raw, "checkpoint_bytes"),
        disk_write_bps=float(_non_negative(path, raw, "disk_write_bps")),
        min_nodes=min_nodes,
        fewer_nodes=fewer_nodes,
    )


def load_spec(path: str, require_root: bool) -> JobSpec:
    """The job specification file, checked (root's `start` accepts only a file root owns and
    only root can write)."""
    owners = (0,) if require_root else (0, os.getuid())
    text = read_untrusted(path, owners)
    if text is None:
        raise Refused(f"{path} is not a readable regular file owned by root")
    try:
        raw = json.loads(text)
    except ValueError as err:
        raise Refused(f"{path} is not JSON: {err}") from err
    if not isinstance(raw, dict):
        raise Refused(f"{path} holds no JSON object")
    if require_root and os.stat(path).st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Refused(f"{path} is writable by others than root")
    return parse_spec(path, raw)


def unit_name(job: str, rank: int) -> str:
    """The systemd unit of one rank (also the name train_runner's tests look for)."""
    return f"llama-{job}-rank{rank}"
