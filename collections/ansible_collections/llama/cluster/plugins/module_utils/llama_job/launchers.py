"""The two ways root starts a node's agent, behind one interface: a systemd transient unit
where systemd runs the node, else a session of its own. Both apply the job's resource limits,
run it as the job's user, and tell whether it still runs and what outlived it."""

from __future__ import annotations

import contextlib
import os
import pwd
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from .procs import boot_id, proc_stat, session_members
from .spec import JobSpec, Refused
from .untrusted import tail_untrusted, write_json

LIMITS = {
    "memlock": (resource.RLIMIT_MEMLOCK, "LimitMEMLOCK"),
    "nofile": (resource.RLIMIT_NOFILE, "LimitNOFILE"),
}


def limit_value(value: object) -> int:
    """An rlimit from 'infinity' or a number."""
    if value in ("infinity", "unlimited", None):
        return resource.RLIM_INFINITY
    return int(value)  # type: ignore[call-overload]


def apply_limits(limits: dict[str, Any]) -> dict[str, str]:
    """Raise the job's limits as systemd's Limit*= does: to the value, else to the hard limit."""
    applied = {}
    for name, (which, _) in LIMITS.items():
        if name not in limits:
            continue
        want = limit_value(limits[name])
        try:
            resource.setrlimit(which, (want, want))
        except (ValueError, OSError):
            _, hard = resource.getrlimit(which)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(which, (hard, hard))
        soft, _ = resource.getrlimit(which)
        applied[name] = "infinity" if soft == resource.RLIM_INFINITY else str(soft)
    return applied


def current_limits() -> dict[str, str]:
    """This process's soft limits, as the agent reports them."""
    found = {}
    for name, (which, _) in LIMITS.items():
        soft = resource.getrlimit(which)[0]
        found[name] = "infinity" if soft == resource.RLIM_INFINITY else str(soft)
    return found


def systemd_runs() -> bool:
    """Whether systemd is this node's init system."""
    return Path("/run/systemd/system").is_dir()


def unit_properties(unit: str) -> dict[str, str]:
    """A few properties of a systemd unit."""
    done = subprocess.run(
        ["systemctl", "show", unit, "--property=LoadState,ActiveState,SubState,MainPID,Result"],
        capture_output=True,
        text=True,
        check=False,
    )
    props = {}
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key] = value
    return props


class Launcher:
    """How a node's agent is started, watched and ended (one per supervisor)."""

    name = ""

    def launch(self, record: dict[str, Any], path: Path, spec: JobSpec, argv: list[str]) -> None:
        """Start the agent `argv` as the job's user; record what identifies it (written)."""
        raise NotImplementedError

    def running(self, record: dict[str, Any]) -> bool:
        """Whether the agent of this boot's record still runs."""
        raise NotImplementedError

    def alive(self, record: dict[str, Any]) -> bool:
        """Whether the agent of a record still runs (checked against what root recorded)."""
        return record.get("boot_id") == boot_id() and self.running(record)

    def leftovers(self, record: dict[str, Any]) -> list[int]:
        """Processes of the job that outlived its agent."""
        return []

    def stop(self, record: dict[str, Any], timeout: float) -> None:
        """End the agent (it ends its command and tells its peers), then anything left."""
        raise NotImplementedError

    def last_words(self, record: dict[str, Any]) -> str:
        """What the agent said before it died (its log's end)."""
        return tail_untrusted(record["log"], (0, int(record["uid"])), 4000)


class SystemdUnit(Launcher):
    """A transient unit (systemd-run): a cgroup to kill as a whole, a state, a journal."""

    name = "systemd"

    def launch(self, record: dict[str, Any], path: Path, spec: JobSpec, argv: list[str]) -> None:
        unit = record["unit"]
        if unit_properties(unit).get("LoadState") == "loaded":
            subprocess.run(["systemctl", "reset-failed", unit], capture_output=True, check=False)
        command = [
            "systemd-run",
            f"--unit={unit}",
            f"--description=llama-cluster job {spec.job} rank {spec.rank} on {spec.host}",
            f"--uid={record['uid']}",
            f"--gid={record['gid']}",
            f"--working-directory={spec.cwd}",
            "--property=KillMode=mixed",
            f"--property=TimeoutStopSec={int(spec.timeouts.stop) + 10}",
            "--property=CollectMode=inactive-or-failed",
            # Stopped before D-Bus as the node shuts down: the agent asks systemd whether the
            # node is stopping (agent.node_going_down), so that a reboot is no stop request.
            "--property=After=dbus.service",
            *(f"--property={LIMITS[k][1]}={v}" for k, v in spec.limits.items() if k in LIMITS),
            "--setenv=PYTHONUNBUFFERED=1",
            "--setenv=LLAMA_JOB_SUPERVISOR=systemd",
            "--",
            *argv,
        ]
        write_json(path, record, 0o600)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise Refused(f"systemd-run could not start {unit}: {done.stderr.strip()}")

    def running(self, record: dict[str, Any]) -> bool:
        state = unit_properties(record["unit"]).get("ActiveState")
        return state in ("active", "activating", "deactivating", "reloading")

    def stop(self, record: dict[str, Any], timeout: float) -> None:
        subprocess.run(["systemctl", "stop", record["unit"]], capture_output=True, check=False)

    def last_words(self, record: dict[str, Any]) -> str:
        journal = subprocess.run(
            ["journalctl", "-u", record["unit"], "-n", "20", "--no-pager", "-o", "cat"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return journal or super().last_words(record)


class OwnSession(Launcher):
    """A session of its own (no systemd): root checks the pid's start time, owner and session
    before it signals anything."""

    name = "process"

    def launch(self, record: dict[str, Any], path: Path, spec: JobSpec, argv: list[str]) -> None:
        write_json(path, record, 0o600)
        pid = spawn_session(argv, pwd.getpwnam(record["user"]), int(record["gid"]), spec)
        info = proc_stat(pid) or {}
        record.update(pid=pid, pid_start=info.get("start"), sid=pid)
        write_json(path, record, 0o600)

    def running(self, record: dict[str, Any]) -> bool:
        info = proc_stat(int(record.get("pid") or 0))
        return bool(
            info
            and info["start"] == record.get("pid_start")
            and info["uid"] == record.get("uid")
            and info["session"] == record.get("sid")
            and info["state"] != "Z"
        )

    def leftovers(self, record: dict[str, Any]) -> list[int]:
        if record.get("boot_id") != boot_id() or record.get("sid") is None:
            return []
        return session_members(int(record["sid"]), int(record["uid"]), int(record["pid_start"]))

    def signal(self, record: dict[str, Any], sig: int) -> bool:
        """Signal the agent after checking it is the one root started."""
        if not self.alive(record):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(record["pid"]), sig)
            return True
        return False

    def stop(self, record: dict[str, Any], timeout: float) -> None:
        self.signal(record, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive(record):
            time.sleep(0.2)
        self.signal(record, signal.SIGKILL)
        for pid in self.leftovers(record):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


LAUNCHERS: dict[str, Launcher] = {"systemd": SystemdUnit(), "process": OwnSession()}


def launcher(name: str) -> Launcher:
    """The launcher of a supervisor's name ('auto': systemd where it runs)."""
    if name == "auto":
        name = "systemd" if systemd_runs() else "process"
    return LAUNCHERS[name]


def _child_setup(entry: pwd.struct_passwd, gid: int, spec: JobSpec, ready_write: int) -> None:
    os.setsid()  # the agent leads a session: stop finds every process it started
    apply_limits(spec.limits)
    os.initgroups(entry.pw_name, gid)
    os.setgid(gid)
    os.setuid(entry.pw_uid)
    os.chdir(spec.cwd)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    try:  # the agent's own errors go to the node's log, opened as the job's user
        log = os.open(spec.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    except OSError:
        log = null
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, ready_write)
    os.closerange(ready_write + 1, 65536)


def spawn_session(argv: list[str], entry: pwd.struct_passwd, gid: int, spec: JobSpec) -> int:
    """Start the agent in a session of its own, as the job's user, with the job's limits."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_write)
        os.read(ready_read, 1)  # the child has set up its session
        os.close(ready_read)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return pid
    try:
        os.close(ready_read)
        _child_setup(entry, gid, spec, ready_write)
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONUNBUFFERED": "1",
            "LLAMA_JOB_SUPERVISOR": "process",
        }
        os.write(ready_write, b"1")
        os.close(ready_write)
        os.execve(argv[0], argv, env)
    finally:
        os._exit(127)
