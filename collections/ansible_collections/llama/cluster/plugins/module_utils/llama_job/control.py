"""Root's side of the contract: start, stop, status, list, wait, ports.

Root never trusts what the job's user can write: its own records live in a directory only
root writes, and a process is signalled only after its start time, owner and session have
been checked against that record (launchers.py).
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import stat
import sys
import time
from pathlib import Path
from typing import Any

from . import protocol, wire
from .launchers import launcher
from .logs import first_error_lines
from .messages import check_state
from .procs import boot_id, busy_ports, listeners
from .spec import JobSpec, Refused, check_name, load_spec, unit_name
from .untrusted import parse_json, read_json_untrusted, read_untrusted, tail_untrusted, write_json

RECORDS = Path(os.environ.get("LLAMA_JOB_RECORDS", "/var/lib/llama-cluster/jobs"))


def emit(data: object) -> None:
    """Print one JSON document."""
    sys.stdout.write(json.dumps(data, sort_keys=True) + "\n")
    sys.stdout.flush()


def need_root() -> None:
    """Refuse a verb that only root may run."""
    if os.geteuid() != 0:
        raise Refused("this verb needs root (it manages every user's jobs)")


def record_path(job: str, host: str) -> Path:
    """Root's record of one node's part of a job."""
    return RECORDS / f"{job}@{host}.json"


def read_records(job: str | None = None) -> list[dict[str, Any]]:
    """Root's records, of one job or of all."""
    if not RECORDS.is_dir():
        return []
    found = []
    for path in sorted(RECORDS.glob("*.json")):
        if job is not None and not path.name.startswith(f"{job}@"):
            continue
        data = read_json_untrusted(path, (0,))
        if data.get("job") and (job is None or data["job"] == job):
            found.append(data)
    return found


def agent_alive(record: dict[str, Any]) -> bool:
    """Whether the agent of a record still runs."""
    return launcher(record["supervisor"]).alive(record)


def leftovers(record: dict[str, Any]) -> list[int]:
    """Processes of the job that outlived its agent."""
    return launcher(record["supervisor"]).leftovers(record)


# What a status or list skipped of the files the job's user writes, said in its output.
WARNINGS: list[str] = []


def read_state(record: dict[str, Any]) -> dict[str, Any]:
    """The agent's state file of a record, read bounded (untrusted.MAX_READ, no link followed)
    and typed (messages.check_state); {} for none yet, or one that is not a state (skipped, with
    a warning that names it: the job's user, and the training code that runs as that user, can
    write anything there)."""
    path = str(record["state"])
    text = read_untrusted(path, (0, int(record["uid"])))
    if not text:
        return {}
    try:
        state = check_state(parse_json(text))
    except ValueError as err:  # messages.Malformed is a ValueError too
        WARNINGS.append(f"skipped {path}: it holds no agent's state ({str(err)[:200]})")
        return {}
    return state


def launch_state(record: dict[str, Any]) -> dict[str, Any]:
    """The state of the launch a record is of ({} for none yet, or an earlier launch's)."""
    state = read_state(record)
    if state.get("job") != record["job"] or state.get("started_s", 0) < record.get("started_s", 0):
        return {}
    return state


def rank_status(record: dict[str, Any]) -> protocol.RankStatus:
    """What one node's part of a job is doing (protocol.rank_status, from the files here)."""
    alive = agent_alive(record)
    left = [] if alive else leftovers(record)
    state = launch_state(record)
    lost = not alive and not protocol.Phase.of(state.get("phase")).is_terminal()
    owners = (0, int(record["uid"]))
    errors = first_error_lines(tail_untrusted(record["log"], owners)) if lost else []
    return protocol.rank_status(record, state, alive, left, errors)


def job_ranks(job: str) -> list[protocol.RankStatus]:
    """Every rank of a job on this node."""
    return [rank_status(r) for r in read_records(job)]


def with_warnings(document: dict[str, Any]) -> dict[str, Any]:
    """A document to print, with what was skipped to make it (`warnings`), where anything was."""
    if WARNINGS:
        document = {**document, "warnings": list(dict.fromkeys(WARNINGS))}
        WARNINGS.clear()
    return document


def status_document(job: str, ranks: list[protocol.RankStatus]) -> dict[str, Any]:
    """What `status` prints: the job's ranks on this node, each as the protocol's JSON."""
    return with_warnings({"job": job, "found": bool(ranks), "ranks": [r.to_dict() for r in ranks]})


def cmd_status(args: argparse.Namespace) -> int:
    """`status --job ID`."""
    need_root()
    job = check_name("job", args.job)
    emit(status_document(job, job_ranks(job)))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """`list [--active]`."""
    need_root()
    jobs = [rank_status(r) for r in read_records()]
    emit(with_warnings({"jobs": [j.to_dict() for j in jobs if j.active or not args.active]}))
    return 0


def cmd_ports(args: argparse.Namespace) -> int:
    """`ports --port P ...`: who listens on those ports, and each as `start` would refuse it."""
    found = [entry for port in args.port for entry in listeners(port)]
    emit({"free": not found, "listeners": found, "busy": busy_ports(args.port)})
    return 0


def check_secret_file(path: str, entry: pwd.struct_passwd) -> None:
    """Refuse a secret environment file that anyone but the job's user could read or replace."""
    if not path:
        return
    try:
        info = os.lstat(path)
    except OSError as err:
        raise Refused(f"the secret environment file {path} is missing: {err.strerror}") from err
    if not stat.S_ISREG(info.st_mode) or info.st_uid != entry.pw_uid or info.st_mode & 0o077:
        raise Refused(
            f"the secret environment file {path} must be a regular file of {entry.pw_name} that "
            f"only it can read (mode 0600; it is {stat.filemode(info.st_mode)}, uid {info.st_uid})"
        )


def _account(user: str, group: str) -> tuple[pwd.struct_passwd, int]:
    try:
        entry = pwd.getpwnam(user)
    except KeyError as err:
        raise Refused(f"no user {user} on this node") from err
    if not group:
        return entry, entry.pw_gid
    try:
        return entry, grp.getgrnam(group).gr_gid
    except KeyError as err:
        raise Refused(f"no group {group} on this node") from err


def _refuse_busy(spec: JobSpec) -> None:
    old = read_json_untrusted(record_path(spec.job, spec.host), (0,))
    if old and (agent_alive(old) or leftovers(old)):
        raise Refused(f"job {spec.job} already runs on {spec.host} ({old['unit']}): stop it first")
    busy = busy_ports(list(spec.ports))
    if busy:
        raise Refused(
            f"{spec.host}: {'; '.join(busy)}. The job needs these ports free before any rank "
            "starts: stop that process, or choose other ports (master_port, watchdog_port)."
        )


def new_record(
    spec: JobSpec, args: argparse.Namespace, entry: pwd.struct_passwd, gid: int, supervisor: str
) -> dict[str, Any]:
    """Root's record of a launch, before it starts."""
    now = time.time()
    return {
        "version": wire.VERSION,
        "job": spec.job,
        "host": spec.host,
        "rank": spec.rank,
        "ranks": list(spec.ranks),
        "unit": unit_name(spec.job, spec.rank),
        "supervisor": supervisor,
        "user": args.user,
        "uid": entry.pw_uid,
        "gid": gid,
        "spec": os.path.realpath(args.spec),
        "state": spec.state,
        "log": spec.log,
        "boot_id": boot_id(),
        "started_s": now,
        "started": protocol.iso(now),
        "stop_requested": False,
        "exclusive": spec.exclusive,
    }


def self_path() -> str:
    """This program's file (the zipapp), which the agent is started from."""
    return os.path.realpath(sys.argv[0])


def cmd_start(args: argparse.Namespace) -> int:
    """`start`: launch this node's agent of a job."""
    need_root()
    spec = load_spec(args.spec, require_root=True)
    entry, gid = _account(args.user, args.group)
    check_secret_file(spec.secret_env_file, entry)
    _refuse_busy(spec)
    chosen = launcher(args.supervisor)
    RECORDS.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(RECORDS, 0o700)
    record = new_record(spec, args, entry, gid, chosen.name)
    argv = [sys.executable, self_path(), "run", "--spec", record["spec"]]
    chosen.launch(record, record_path(spec.job, spec.host), spec, argv)
    started = wait_for_agent(record)
    emit(
        {
            "job": spec.job,
            "host": spec.host,
            "rank": spec.rank,
            "unit": record["unit"],
            "supervisor": chosen.name,
            **started,
        }
    )
    return 0


def rejoin_refusal(record: dict[str, Any], now: float) -> str:
    """Why a node's part of a job is not started again at boot ("" when it is): only a worker's
    whose agent died without ending it (the node lost power, was killed or rebooted), not
    stopped, with a restart left, within the window in which its master waits for it."""
    state = read_state(record)
    if agent_alive(record) or record.get("stop_requested"):
        return "its agent runs, or it was stopped"
    if state.get("job") != record["job"] or protocol.Phase.of(state.get("phase")).is_terminal():
        return "it ended"
    spec = load_spec(record["spec"], require_root=True)
    try:
        silent = now - os.stat(record["state"]).st_mtime
    except OSError:
        silent = float("inf")
    refusals = (
        (spec.is_master, "a master is not started again on its own (its peers gave it up)"),
        (
            len(state.get("restarts") or []) >= spec.max_restarts,
            f"no restart left ({spec.max_restarts} allowed)",
        ),
        (
            silent > spec.timeouts.restart,
            f"it went down {silent:.0f} s ago, past its master's restart window "
            f"({spec.timeouts.restart:.0f} s)",
        ),
    )
    return next((why for refused, why in refusals if refused), "")


def cmd_rejoin(_args: argparse.Namespace) -> int:
    """`rejoin` (at boot, llama-job-rejoin.service): start again this node's part of every job
    that it lost without ending it, so that the master's restart finds every node back."""
    need_root()
    rejoined, skipped = [], []
    for record in read_records():
        try:
            why = rejoin_refusal(record, time.time())
            if not why:
                spec = load_spec(record["spec"], require_root=True)
                entry = pwd.getpwnam(record["user"])
                _refuse_busy(spec)
                again = new_record(
                    spec,
                    argparse.Namespace(spec=record["spec"], user=record["user"]),
                    entry,
                    int(record["gid"]),
                    record["supervisor"],
                )
                argv = [sys.executable, self_path(), "run", "--spec", again["spec"]]
                launcher(record["supervisor"]).launch(
                    again, record_path(spec.job, spec.host), spec, argv
                )
                rejoined.append({"job": spec.job, "host": spec.host, **wait_for_agent(again)})
                continue
        except (Refused, KeyError, OSError, ValueError) as err:
            why = str(err)
        skipped.append({"job": record.get("job"), "host": record.get("host"), "why": why})
    emit({"rejoined": rejoined, "skipped": skipped})
    return 0


def wait_for_agent(record: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
    """Return once the agent has written its state; refuse with its log if it died first."""
    started = time.monotonic()
    while time.monotonic() < started + timeout:
        state = launch_state(record)
        if state:
            return {"phase": state.get("phase"), "pid": state.get("pid")}
        if time.monotonic() > started + 1 and not agent_alive(record):
            words = launcher(record["supervisor"]).last_words(record)
            raise Refused(
                f"the agent of {record['job']} on {record['host']} ended at once: "
                + " | ".join(words.strip().splitlines()[-8:])
            )
        time.sleep(0.1)
    return {"phase": protocol.Phase.STARTING.value, "pid": None}


def cmd_stop(args: argparse.Namespace) -> int:
    """`stop --job ID`: end this node's part of a job (the agent tells its peers)."""
    need_root()
    job = check_name("job", args.job)
    stopped = []
    for record in read_records(job):
        was_active = agent_alive(record) or bool(leftovers(record))
        if was_active:
            record["stop_requested"] = True
            write_json(record_path(record["job"], record["host"]), record, 0o600)
            stopped.append(record["host"])
        if was_active or record["supervisor"] == "process":
            launcher(record["supervisor"]).stop(record, args.timeout)
    emit({**status_document(job, job_ranks(job)), "stopped": stopped})
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """`wait --job ID --until running|ended`: status once it holds, or after the timeout."""
    need_root()
    job = check_name("job", args.job)
    deadline = time.monotonic() + args.timeout
    while True:
        ranks = job_ranks(job)
        ended = bool(ranks) and all(r.phase.is_terminal() and not r.active for r in ranks)
        running = ended or any(
            r.phase is protocol.Phase.RUNNING or r.phase.is_terminal() for r in ranks
        )
        reached = ended if args.until == "ended" else running
        if reached or time.monotonic() >= deadline:
            emit({**status_document(job, ranks), "reached": reached, "ended": ended})
            return 0
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
