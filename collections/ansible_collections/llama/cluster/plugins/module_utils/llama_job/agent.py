"""What the master's and a worker's agent share: the node's log, the command's environment,
the state file that `status` reads, the failure records, and the run loop's frame."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import queue
import signal
import stat
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .checkpoints import NAME, resume_argument, rotate, set_aside, set_aside_dir
from .command import Command, Ended
from .launchers import current_limits
from .logs import read_env_file, rotate_log
from .messages import check_state
from .oom import describe_cause
from .procs import become_subreaper
from .protocol import Failure, FailureKind, Phase, Restart, describe_exit, iso
from .saves import clear_marks, finished, marks_dir
from .spec import JobSpec, Refused
from .untrusted import parse_json, read_untrusted, write_json
from .whole import checkpoint_problem, markers_declared
from .wire import VERSION

LOG_LOOK_S = 5.0  # seconds between two looks at the node log's size
ROTATE_S = 5.0  # seconds between two looks at the checkpoints a rotation may delete


def node_going_down() -> bool:
    """Whether this node is shutting down or rebooting (systemd says 'stopping'): a SIGTERM then
    is the node's end, not a request to stop the job (llama-job stop, systemctl stop)."""
    try:
        done = subprocess.run(
            ["systemctl", "is-system-running"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.stdout.strip() == "stopping"


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def open_log(path: str) -> BinaryIO:
    """The node's log, appended to (made 0640 where missing); a link there is refused, never
    followed: the log's directory is the job's, and whoever can write it could plant one."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as err:
        why = "it is a link: refused, never followed" if err.errno == errno.ELOOP else err.strerror
        raise Refused(f"cannot open the node's log {path}: {why}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"cannot open the node's log {path}: it is not a regular file")
    os.fchmod(fd, 0o640)
    return os.fdopen(fd, "ab", buffering=0)


class NodeAgent:
    """Runs this node's command for a job and records where it stands."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.t = spec.timeouts
        self.host = spec.host
        self.events: queue.Queue = queue.Queue()
        self.log = open_log(spec.log)
        self.marks = marks_dir(spec.state, spec.host)
        self.command = Command(spec, self.environment(), self.log, self.say)
        self.attempt = 1
        self.phase = Phase.STARTING
        self.phase_since = time.monotonic()
        self.reason: Failure | None = None
        self.restarts: list[Restart] = []
        self.stop_requested = False
        self.started_s = time.time()
        self.progress: dict[str, Any] = {}
        self.limits = current_limits()
        self.last_state_write = 0.0
        self.resume_from: str | None = None  # the checkpoint this attempt resumes from
        self.log_looked = 0.0  # when the log's size was last looked at
        self.rotated = 0.0  # when the checkpoints were last looked at for rotation
        self.warnings: list[str] = []  # what did not fail the run but is worth saying
        # The nodes of this attempt, in node rank order (a run continued on fewer nodes:
        # min_nodes), those it runs without, and what this node's command is given for it.
        self.nodes: list[str] = []
        self.left_out: list[str] = []
        self.fewer_args: list[str] = []
        self.down = False  # the node shuts down: the agent leaves without an outcome
        # A resumed run's earlier launches (their attempts, from the state file they left), and
        # why the last of them ended: status shows every attempt of the run.
        self.history: list[Restart] = []
        self.earlier: Failure | None = None
        if spec.resume:
            self.carry_history()

    def carry_history(self) -> None:
        """Take the attempts of the launch before this one from its state file (this node's,
        at the same path), before this launch writes its own; attempts count on from it. Read
        as root reads it (bounded, typed: messages.check_state); one that is no state is none."""
        text = read_untrusted(self.spec.state, (0, os.getuid()))
        try:
            before = check_state(parse_json(text)) if text else {}
        except ValueError:  # messages.Malformed is one too
            return
        if before.get("job") != self.spec.job:
            return
        attempt = before.get("attempt")
        first = [Restart(1, str(before.get("started") or "") or None)]
        self.history = [
            *([r for r in map(Restart.from_dict, before.get("history") or []) if r] or first),
            *(r for r in map(Restart.from_dict, before.get("restarts") or []) if r),
        ]
        self.earlier = Failure.from_dict(before.get("reason"))
        self.attempt = attempt if isinstance(attempt, int) and attempt > 0 else 1

    # -- plumbing -------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        """A line of the agent's own in the node's log."""
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        with contextlib.suppress(OSError):
            self.log.write(f"[llama-job {self.host} {stamp}Z] {text}\n".encode())

    def environment(self) -> dict[str, str]:
        """The command's environment: the job's env file over the user's basics."""
        text = read_untrusted(self.spec.env_file, (0, os.getuid())) or ""
        entry = pwd.getpwuid(os.getuid())
        env = {"USER": entry.pw_name, "LOGNAME": entry.pw_name, "HOME": entry.pw_dir}
        env["PATH"] = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        # Keys (tracking, API) reach the command's environment only: never the log or the job dir.
        if self.spec.secret_env_file:
            secret = read_untrusted(self.spec.secret_env_file, (os.getuid(),)) or ""
            env.update(read_env_file(secret))
        env.update(read_env_file(text))
        env.update(LLAMA_JOB_ID=self.spec.job, LLAMA_JOB_HOST=self.host, LLAMA_JOB_MARKS=self.marks)
        return env

    def peers_state(self, now: float) -> dict[str, Any]:
        """The peers as the state file reports them (the master's)."""
        return {}

    def write_state(self, force: bool = True) -> None:
        """The agent's state file: what status reports for this node."""
        now = time.monotonic()
        if not force and now - self.last_state_write < 1.0:
            return
        self.last_state_write = now
        state = {
            "version": VERSION,
            "job": self.spec.job,
            "host": self.host,
            "rank": self.spec.rank,
            "role": self.spec.role,
            "phase": self.phase.value,
            "attempt": self.attempt,
            "max_restarts": self.spec.max_restarts,
            "restarts": [r.to_dict() for r in self.restarts],
            "history": [r.to_dict() for r in self.history],
            "exit_status": self.command.exit_status,
            "reason": self.reason.to_dict() if self.reason else None,
            "progress": self.progress,
            "peers": self.peers_state(now),
            "limits": self.limits,
            "pid": os.getpid(),
            "child": self.command.pid,
            "started_s": self.started_s,
            "started": iso(self.started_s),
            "updated": iso(time.time()),
            "ended": iso(time.time()) if self.phase.is_terminal() else None,
            "warnings": self.warnings,
            "left_out": self.left_out,
        }
        with contextlib.suppress(OSError):
            write_json(Path(self.spec.state), state)

    def rotate_log(self, now: float) -> None:
        """Rotate the node's log once it is past its limit (looked at every few seconds)."""
        if now - self.log_looked < LOG_LOOK_S:
            return
        self.log_looked = now
        try:
            size = os.fstat(self.log.fileno()).st_size
            if size <= self.spec.log_max_bytes:
                return
            if rotate_log(self.spec.log, self.log.fileno(), self.spec.log_keep):
                self.command.log_rotated()
                self.say(
                    f"rotated this log at {size >> 20} MiB into {self.spec.log}.1 "
                    f"({self.spec.log_keep} kept)"
                )
        except OSError as err:
            self.say(f"cannot rotate this log: {err}")

    def rotate_checkpoints(self, now: float) -> None:
        """Delete the checkpoints the run's save_total_limit no longer keeps, once the newer
        ones are whole (checkpoints.rotation; looked at every few seconds)."""
        if not self.spec.checkpoints_dir or now - self.rotated < ROTATE_S:
            return
        self.rotated = now
        deleted = rotate(self.spec.checkpoints_dir, len(self.nodes) or self.spec.nnodes)
        if deleted:
            self.say(f"deleted {', '.join(deleted)} (save_total_limit: newer ones are whole)")

    def current_ranks(self) -> list[int]:
        """The global ranks of this node's processes in this attempt (renumbered where the
        run goes on without a node ranked before this one)."""
        ranks = list(self.spec.ranks)
        if not self.nodes or self.host not in self.nodes:
            return ranks
        first = self.nodes.index(self.host) * len(ranks)
        return list(range(first, first + len(ranks)))

    def finished_here(self) -> str:
        """'' unless every rank of this node reached the last step and the checkpoint it
        saved last is whole (saves.finished): then what says so."""
        return finished(self.marks, self.current_ranks(), self.spec.checkpoints_dir)

    def set_phase(self, phase: Phase) -> None:
        """Move to a phase and record it."""
        if phase != self.phase:
            self.phase = phase
            self.phase_since = time.monotonic()
        self.write_state()

    # -- failures -------------------------------------------------------------------------------
    def explained(self, message: str, cause: dict[str, Any] | None, node: str | None = None) -> str:
        """A failure's message with its cause first, when one is known.

        The step is the last one in rank 0's progress file, which only the master follows.
        """
        if not cause:
            return message
        step = self.progress.get("current_steps")
        return f"{describe_cause(cause, node or self.host, step)}; {message}"

    def failure(
        self,
        kind: FailureKind,
        message: str,
        node: str | None = None,
        **given: Any,  # noqa: ANN401
    ) -> Failure:
        """A failure of this attempt, of this node unless `node` names another."""
        node = node or self.host
        rank = self.spec.rank if node == self.host else given.pop("rank", None)
        return Failure.now(node, kind, message, rank=rank, attempt=self.attempt, **given)

    def reported(self, ended: Ended) -> tuple[str, Failure]:
        """The message and record of a failure the command's output reported."""
        message = f"its command reported a failure ({ended.reported})"
        if ended.code is not None:  # issue 39: which of the node's ranks, where torchrun says
            message += f": {ended.failed_rank or 'a process'} {describe_exit(ended.code)}"
        self.say(f"attempt {self.attempt}: {self.explained(message, ended.cause)}")
        reason = self.failure(
            FailureKind.EXITED,
            self.explained(message, ended.cause),
            errors=tuple(ended.errors),
            exit_status=ended.code,
            cause=ended.cause,
        )
        return message, reason

    # -- continuing from a checkpoint: a restart, or a resumed run's first attempt -----------
    def prepare_continue(self, plan: Mapping[str, Any]) -> None:
        """Before an attempt that continues from a checkpoint (the master's plan: checkpoints.
        continue_plan): move this node's checkpoints newer than the common one aside (into
        <run dir>/set-aside/<the plan's stamp>/, never deleting one) and note the checkpoint
        the command is given, and the nodes of the attempt with what this one's command is
        given for their number (min_nodes)."""
        nodes = plan.get("nodes")
        self.nodes = [str(n) for n in nodes] if isinstance(nodes, list) else []
        args = plan.get("args")
        self.fewer_args = [str(a) for a in args] if isinstance(args, list) else []
        directory = self.spec.checkpoints_dir
        if not directory:
            return
        checkpoint = plan.get("checkpoint")
        self.resume_from = checkpoint if isinstance(checkpoint, str) else None
        target = set_aside_dir(directory, plan.get("stamp"))
        names = _mapping(plan.get("set_aside")).get(self.host) or []
        marker = markers_declared(directory) is not None
        why = {
            str(n): checkpoint_problem(os.path.join(directory, str(n)), marker)
            or "not on every node"
            for n in names
            if NAME.match(str(n))
        }
        moved = set_aside(directory, list(why), target) if target else {}
        for folder in dict.fromkeys(moved.values()):
            said = ", ".join(f"{name} ({why[name]})" for name, to in moved.items() if to == folder)
            self.say(f"set aside {said} in {folder}")
        self.say(f"attempt {self.attempt} resumes from {self.resume_from or 'the beginning'}")

    def start_command(self) -> Ended | None:
        """Start this attempt's command, passing the checkpoint it resumes from, and on fewer
        nodes than the run started with, their number, this node's rank among them and what
        the plan for that many gives the command (NNODES, NODE_RANK: LLaMA-Factory's torchrun)."""
        extra = resume_argument(
            self.spec.resume_argument, self.spec.checkpoints_dir, self.resume_from
        )
        env = {}
        if self.nodes and len(self.nodes) < self.spec.nnodes and self.host in self.nodes:
            env = {"NNODES": str(len(self.nodes)), "NODE_RANK": str(self.nodes.index(self.host))}
        try:
            clear_marks(self.marks)
        except OSError as err:
            self.say(f"cannot empty {self.marks}: {err}")
        return self.command.start(self.attempt, extra + self.fewer_args, env)

    # -- the run loop -----------------------------------------------------------------------
    def go_down(self) -> bool:
        """On a stop signal: where the node itself is shutting down, end this node's command
        and leave the job as it stands (no outcome recorded, no word to the peers but the
        closed connection), so that its part rejoins when the node boots (llama-job rejoin)
        or the run ends naming it. Whether it did."""
        if not node_going_down():
            return False
        self.down = True
        self.say("this node is shutting down: its command ends; its part rejoins when it boots")
        self.command.end_now("the node is shutting down")
        return True

    def on_signal(self, signum: int, _frame: object) -> None:
        """SIGTERM/SIGINT: a stop was requested (llama-job stop, systemctl stop)."""
        self.events.put(("stop", None, {"signal": signum}))

    def drain_events(self, wait: float) -> None:
        """Handle what arrived (messages, lost connections, stop requests)."""
        deadline = time.monotonic() + wait
        while True:
            remaining = deadline - time.monotonic()
            try:
                kind, link, data = self.events.get(timeout=max(0.0, remaining))
            except queue.Empty:
                return
            self.guarded(kind, link, data)
            if remaining <= 0:
                return

    def guarded(self, kind: str, link: Any, data: dict[str, Any] | None) -> None:  # noqa: ANN401
        """One event, within its own boundary: whatever handling it raises is said in the log
        and cuts the connection it came on (its peer may connect again), never the agent."""
        try:
            self.on_event(kind, link, data)
        except Exception as err:  # one message's failure is only its own
            who = getattr(link, "host", None) or "this node"
            self.say(f"an error handling a {kind} event of {who}: {type(err).__name__}: {err}")
            if link is not None:
                link.close(f"an error handling its message ({type(err).__name__})")

    def on_event(self, kind: str, link: Any, data: dict[str, Any] | None) -> None:  # noqa: ANN401
        """One event (role-specific)."""
        raise NotImplementedError

    def on_command(self, ended: Ended) -> None:
        """The command ended or reported a failure (role-specific)."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Heartbeats and timers (role-specific)."""
        raise NotImplementedError

    def begin(self) -> bool:
        """Set up before the loop; False when the agent cannot run."""
        return True

    def finish(self) -> None:
        """After the loop (role-specific)."""

    def run(self) -> int:
        """The agent's life: a short loop over events, the command and the clocks."""
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        become_subreaper()
        self.say(
            f"job {self.spec.job} rank {self.spec.rank} ({self.spec.role}), "
            f"supervisor {os.environ.get('LLAMA_JOB_SUPERVISOR', 'none (started by hand)')}, "
            f"limits memlock={self.limits['memlock']} nofile={self.limits['nofile']}, "
            f"restarts allowed: {self.spec.max_restarts}"
        )
        self.write_state()
        try:
            if not self.begin():
                return 1
            while not self.phase.is_terminal() and not self.down:
                self.drain_events(0.2)
                ended = self.command.poll()
                if ended is not None:
                    self.on_command(ended)
                self.tick(time.monotonic())
                self.write_state(force=False)
                self.rotate_log(time.monotonic())
                self.rotate_checkpoints(time.monotonic())
            if not self.down:
                self.finish()
            return 0 if self.phase is Phase.SUCCEEDED else 1
        finally:
            self.command.signal_tree(signal.SIGKILL)
            self.write_state()
