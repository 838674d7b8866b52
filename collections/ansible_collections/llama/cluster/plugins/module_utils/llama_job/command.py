"""The mechanism under an agent: this node's command, one attempt at a time.

Starts it in a process group of its own, ends it (SIGTERM, SIGKILL after the stop timeout, and
nothing of an attempt outlives it), watches its output for an engine's give-up line, and says
what it ran out of when it died of memory. The agent decides what an end means.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from .logs import expand, failed_rank, first_error_lines, reported_exit_status
from .oom import (
    cuda_oom,
    disk_full,
    host_oom_cause,
    memory_figures,
    oom_counters,
    oom_kill_evidence,
    read_kernel_log,
    reported_failures,
    unit_cgroup,
)
from .procs import all_pids, descendants, proc_stat, session_members
from .protocol import describe_exit
from .spec import JobSpec, unit_name
from .untrusted import file_size, read_from, read_text


@dataclass
class Ended:
    """How an attempt's command ended, or that its output reported a failure (`reported`:
    the command still runs and is being ended)."""

    code: int | None
    errors: list[str] = field(default_factory=list)
    cause: dict[str, Any] | None = None
    aborted: bool = False  # ended on purpose (an abort, a stop)
    reported: str = ""  # the give-up line, when the output said it first
    failed_rank: str = ""  # the process the launcher names first ("rank 3 (local rank 1)")


class Command:
    """This node's command of the current attempt."""

    def __init__(self, spec: JobSpec, env: dict[str, str], log: BinaryIO, say: Callable) -> None:
        self.spec = spec
        self.env = env
        self.log = log
        self.say = say
        self.child: subprocess.Popen | None = None
        self.group: int | None = None  # the command's process group (its first pid)
        self.patterns = [re.compile(p) for p in spec.fail_patterns]
        self.offset = 0  # where this attempt's output starts in the log
        self.scan_offset, self.scan_rest, self.scan_failed = 0, "", False
        self.kill_deadline: float | None = None
        self.aborted = False
        self.exit_status: int | None = None
        self.started_wall = time.time()
        self.attempt = 1
        # the unit's memory cgroup under systemd (None in a session of its own), and its and
        # the node's OOM kill counters when the attempt started
        self.cgroup = unit_cgroup(
            unit_name(spec.job, spec.rank), read_text(Path("/proc/self/cgroup"))
        )
        self.oom_before: dict[str, int | None] = {}

    # -- start and end ------------------------------------------------------------------------
    def start(
        self, attempt: int, extra: list[str] | None = None, env: dict[str, str] | None = None
    ) -> Ended | None:
        """Start the command (with `extra` arguments, and `env` over the job's environment);
        an Ended when it cannot be started."""
        self.attempt = attempt
        self.kill_leftovers(within=1.0)  # an earlier attempt's process never meets this one
        self.offset = file_size(self.spec.log)
        self.scan_offset, self.scan_rest, self.scan_failed = self.offset, "", False
        environment = {**self.env, **(env or {})}
        argv = [expand(arg, environment) for arg in self.spec.command] + list(extra or [])
        self.say(f"attempt {attempt}: starting {' '.join(shlex.quote(a) for a in argv)}")
        self.aborted, self.kill_deadline, self.exit_status = False, None, None
        self.oom_before = oom_counters(self.cgroup)
        self.started_wall = time.time()
        kwargs: dict[str, Any] = {}
        if sys.version_info >= (3, 11):
            kwargs["process_group"] = 0
        else:  # Python 3.10 (Ubuntu 22.04)
            kwargs["preexec_fn"] = os.setpgrp  # setpgrp only, before exec
        try:
            self.child = subprocess.Popen(
                argv,
                cwd=self.spec.cwd,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=self.log,
                stderr=self.log,
                **kwargs,
            )
        except OSError as err:
            self.child = None
            self.say(f"cannot start the command: {err}")
            self.exit_status = 127
            return Ended(127, [f"cannot start {argv[0]}: {err}"])
        self.group = self.child.pid
        return None

    def log_rotated(self) -> None:
        """The log was rotated (emptied): this attempt's output starts again at its beginning."""
        self.offset, self.scan_offset, self.scan_rest = 0, 0, ""

    def running(self) -> bool:
        """Whether the command still runs."""
        return self.child is not None and self.child.poll() is None

    @property
    def pid(self) -> int | None:
        """The command's pid while it runs."""
        return self.child.pid if self.running() and self.child else None

    def end(self, why: str) -> None:
        """Ask the command to end: SIGTERM now, SIGKILL after the stop timeout."""
        if not self.running() or self.kill_deadline is not None:
            return
        self.say(f"stopping the command ({why})")
        self.aborted = True
        self.signal_tree(signal.SIGTERM)
        self.kill_deadline = time.monotonic() + self.spec.timeouts.stop

    def end_now(self, why: str) -> None:
        """End the command and wait for it (a worker leaving the job)."""
        if not self.running():
            return
        self.end(why)
        deadline = time.monotonic() + self.spec.timeouts.stop + 5
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
            if self.kill_deadline is not None and time.monotonic() > self.kill_deadline:
                self.signal_tree(signal.SIGKILL)
        self.kill_leftovers()

    def processes(self) -> list[int]:
        """The job's processes on this node: the agent's session (it leads one under both
        supervisors), or only the command's process group when started by hand; and everything
        the agent started, whatever session it moved to (torch's elastic agent starts every
        rank in a session of its own; the agent is their subreaper once their parent dies)."""
        me = os.getpid()
        if os.getsid(0) == me:
            members = [pid for pid in session_members(me, os.getuid()) if pid != me]
        elif self.group is None:
            return []
        else:
            members = [p for p in all_pids() if (proc_stat(p) or {}).get("pgrp") == self.group]
        return members + [pid for pid in descendants([me], os.getuid()) if pid not in members]

    def signal_tree(self, sig: int) -> None:
        """Signal the command's process group and anything else it left in this session."""
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, sig)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill_leftovers(self, within: float = 2.0) -> None:
        """SIGKILL what the ended command left (a rank its launcher did not end: a frozen one
        ignores SIGTERM), again until a look finds nothing or `within` seconds passed: a rank
        whose launcher was dying as /proc was read is found by the next look."""
        deadline = time.monotonic() + within
        while True:
            self.signal_tree(signal.SIGKILL)
            if not self.processes() or time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def frozen(self) -> bool:
        """Whether a process of the command is stopped (SIGSTOP): a frozen rank."""
        if not self.running():
            return False
        return any((proc_stat(pid) or {}).get("state") in ("T", "t") for pid in self.processes())

    # -- watching -------------------------------------------------------------------------------
    def poll(self) -> Ended | None:
        """The command's end, or its output's report of a failure; None while neither."""
        if self.child is None:
            return None
        if self.kill_deadline is not None and time.monotonic() > self.kill_deadline:
            if self.child.poll() is None:
                self.say("the command did not stop in time: SIGKILL")
            self.signal_tree(signal.SIGKILL)
            self.kill_deadline = time.monotonic() + 5
        code = self.child.poll()
        if code is None:
            return self.scan()
        self.child, self.kill_deadline = None, None
        self.kill_leftovers()  # nothing of this attempt outlives it
        self.exit_status = code
        errors = [] if code == 0 else first_error_lines(read_from(self.spec.log, self.offset))
        self.say(f"attempt {self.attempt}: the command ended, {describe_exit(code)}")
        cause = None if code == 0 or self.aborted else self.failure_cause(code)
        return Ended(code, errors, cause, aborted=self.aborted)

    def scan(self) -> Ended | None:
        """A give-up line in the new output (the spec's `fail_patterns`, such as torchrun's
        ChildFailedError once a rank died: LLaMA-Factory's launcher around torchrun may take
        many more seconds to exit than the rank took to die)."""
        if not self.patterns or self.aborted or self.scan_failed:
            return None
        size = file_size(self.spec.log)
        if size <= self.scan_offset:
            return None
        chunk = self.scan_rest + read_from(self.spec.log, self.scan_offset, 1 << 20)
        self.scan_offset = min(size, self.scan_offset + (1 << 20))
        lines = chunk.split("\n")
        self.scan_rest = lines.pop()
        hit = next((x for x in lines if any(p.search(x) for p in self.patterns)), None)
        if hit is None:
            return None
        self.scan_failed = True
        text = read_from(self.spec.log, self.offset)
        # The command is ended now, so its own exit status would only say that; the status of
        # the process that failed is what the output reports (a rank killed: signal 9).
        return Ended(
            reported_exit_status(text), first_error_lines(text), self.failure_cause(None), False,
            hit.strip()[:160], failed_rank(text),
        )  # fmt: skip

    def failure_cause(self, code: int | None) -> dict[str, Any] | None:
        """What this attempt ran out of: host memory (the OOM killer), the checkpoints' disk,
        or a GPU's memory.

        `code` is the command's own exit status, None while it still runs. An OOM kill is looked
        for only when a process died by SIGKILL: the command itself, or one its launcher names.
        """
        start = max(self.offset, file_size(self.spec.log) - (256 << 10))
        text = read_from(self.spec.log, start)  # the end: where a launcher sums up
        failures = reported_failures(text)
        killed = {f["pid"] for f in failures if f["exit_status"] == -signal.SIGKILL}
        if code == -signal.SIGKILL and self.group is not None:
            killed.add(self.group)
        if killed:
            evidence = oom_kill_evidence(
                self.oom_before,
                oom_counters(self.cgroup),
                lambda: read_kernel_log(self.started_wall - 1),
                killed,
                os.getuid(),
            )
            if evidence:
                # the ranks run in this process's cgroup: its limit, or a parent's, is theirs
                memory = memory_figures(self.cgroup, read_text(Path("/proc/self/cgroup")))
                return host_oom_cause(evidence, failures, memory)
        return disk_full(text, self.spec.checkpoints_dir) or cuda_oom(text, failures)
