"""A worker's agent: follows the master. Keeps one authenticated connection to the master's
watchdog, starts, ends and restarts this node's command when the master says, tells it how the
command ended, and ends the command on its own when the master goes away."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from .agent import NodeAgent
from .checkpoints import listing
from .command import Ended
from .link import Link, connect, read_uplink
from .protocol import Failure, FailureKind, Phase, Restart, describe_exit, iso
from .wire import Kind


def reachable(address: str, port: int, within: float = 15.0) -> bool:
    """Whether a TCP port answers (retrying for a while: rank 0 may still be binding)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection((address, port), timeout=3):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def final_phase(phase: object) -> Phase:
    """The phase the master's final message names (failed for anything but an end)."""
    named = Phase.of(phase)
    return named if named.is_terminal() else Phase.FAILED


class WorkerAgent(NodeAgent):
    """Follow the master: start, abort, restart and finish when it says."""

    def __init__(self, spec: Any) -> None:  # noqa: ANN401 - a JobSpec
        super().__init__(spec)
        self.uplink: Link | None = None
        self.master_host = spec.master.host
        self.master_seen: float | None = None
        self.master_lost_at: float | None = None
        self.master_refused = False
        self.last_beat = 0.0
        self.last_tick = time.monotonic()
        self.frozen = 0.0  # seconds this node went without CPU time, when it did
        self.connect_deadline = time.monotonic() + self.t.start
        self.unauthenticated = ""  # why the last watchdog that answered was not the master

    def begin(self) -> bool:
        self.set_phase(Phase.WAITING)
        self.connect_deadline = time.monotonic() + self.t.start
        threading.Thread(target=self.uplink_loop, daemon=True).start()
        return True

    def uplink_loop(self) -> None:
        """Keep one connection to the master's watchdog, reconnecting while it may come back."""
        address, port = self.spec.master.address, self.spec.watchdog_port
        while not self.phase.is_terminal():
            if self.uplink is not None and not self.uplink.closed:
                time.sleep(0.2)
                continue
            hello = {"host": self.host, "rank": self.spec.rank, "phase": self.phase.value}
            link, why = connect(
                address,
                port,
                self.spec.key,
                self.spec.job,
                {**hello, "attempt": self.attempt},
                master=self.master_host,
                source=self.spec.address,
            )
            if link is None:
                kind = "rejected" if why.startswith("rejected: ") else "unreached"
                self.events.put(
                    (
                        "refused" if why == "refused" else kind,
                        None,
                        {"why": why.removeprefix("rejected: ")},
                    )
                )
                time.sleep(1)
                continue
            self.events.put(("connected", link, link.welcome))
            read_uplink(link, self.events)  # returns once the connection ends

    def send_master(self, message: dict[str, Any]) -> None:
        """Send to the master when connected; with this node's checkpoints while its command
        does not run (what a restart picks its checkpoint from)."""
        if self.uplink is None:
            return
        if self.spec.checkpoints_dir and not self.command.running():
            message = {**message, "checkpoints": listing(self.spec.checkpoints_dir)}
        self.uplink.send(message)

    # -- events -------------------------------------------------------------------------------
    def on_event(self, kind: str, link: Link | None, data: dict[str, Any] | None) -> None:
        if kind == "stop":
            self.stop()
        elif kind == "connected":
            self.uplink = link
            self.heard_master()
        elif kind == "refused":
            self.master_refused = self.master_seen is not None
        elif kind == "rejected":
            why = f"the master refused this node: {(data or {}).get('why')}"
            self.leave(Phase.FAILED, self.failure(FailureKind.START, why))
        elif kind == "unreached":
            self.note_unauthenticated(str((data or {}).get("why", "")))
        elif kind == "eof":
            if link is not None and link.dropped:
                said = ", ".join(f"{n} x {why}" for why, n in link.dropped.most_common(6))
                self.say(f"dropped {link.dropped.total()} lines of the master's connection: {said}")
            if link is self.uplink:
                self.uplink = None
                if link is not None and link.cut:  # connect again; a silent master still counts
                    self.say(f"cut the master's connection ({link.cut}); connecting again")
                elif self.master_seen is not None:
                    self.master_gone("the master's agent closed the connection")
        elif link is self.uplink and data is not None:
            self.heard_master()
            self.on_message(data)

    def note_unauthenticated(self, why: str) -> None:
        """A watchdog answered that is not this job's master (said once per reason)."""
        if "authenticate" in why and why != self.unauthenticated:
            self.say(f"refused: {why}")
        self.unauthenticated = why

    def heard_master(self) -> None:
        """A verified message of the master."""
        self.master_seen = time.monotonic()
        self.master_lost_at = None
        self.master_refused = False

    def stop(self) -> None:
        """SIGTERM on a worker: end the command, tell the master, end (unless this node is
        shutting down: go_down)."""
        if self.stop_requested or self.go_down():
            return
        self.stop_requested = True
        self.say("stop requested")
        if self.command.running():
            self.command.end("stop requested")  # its exit tells the master
            return
        self.send_master(
            {
                "t": Kind.EXIT.value,
                "attempt": self.attempt,
                "stopped": True,
                "exit_status": None,
                "rank": self.spec.rank,
            }
        )
        self.leave(Phase.STOPPED, self.failure(FailureKind.STOPPED, "stopped on request"))

    def on_message(self, data: dict[str, Any]) -> None:
        """What the master says: start, restart, abort, final."""
        handlers = {
            Kind.START.value: lambda: self.start_attempt(int(data.get("attempt") or self.attempt)),
            Kind.CONTINUE.value: lambda: self.continue_run(data),
            Kind.ABORT.value: lambda: self.abort(data),
            Kind.FINAL.value: lambda: self.leave(
                final_phase(data.get("phase")), Failure.from_dict(data.get("reason"))
            ),
        }
        handler = handlers.get(str(data.get("t")))
        if handler is not None:
            handler()

    def continue_run(self, data: dict[str, Any]) -> None:
        """The master continues the run from a checkpoint: a restart (`after`: the failure) or
        a resumed run's first attempt. Set aside what the plan says, then wait for its start."""
        after = Failure.from_dict(data.get("after"))
        self.attempt = int(data.get("attempt") or self.attempt)
        plan = data.get("plan") if isinstance(data.get("plan"), dict) else {}
        checkpoint = plan.get("checkpoint") if isinstance(plan.get("checkpoint"), str) else None
        if after is not None:
            self.restarts.append(Restart(self.attempt, iso(time.time()), after, checkpoint))
            self.say(f"restart: attempt {self.attempt} (after {after.node}: {after.message})")
        self.reason = None
        self.prepare_continue(plan)
        if not self.in_attempt():
            self.say(f"attempt {self.attempt} runs without this node: {', '.join(self.nodes)}")
        self.set_phase(Phase.WAITING)

    def in_attempt(self) -> bool:
        """Whether this node takes part in the current attempt (not left out: min_nodes)."""
        return not self.nodes or self.host in self.nodes

    def abort(self, data: dict[str, Any]) -> None:
        """The master ends this attempt on every node."""
        self.reason = Failure.from_dict(data.get("reason"))
        if self.command.running():
            said = f"{self.reason.node}: {self.reason.message}" if self.reason else "aborted"
            self.command.end(said)
            return
        self.send_master({"t": Kind.IDLE.value, "attempt": self.attempt})
        if self.phase is not Phase.DONE:
            self.set_phase(Phase.IDLE)

    def start_attempt(self, attempt: int) -> None:
        """Start this node's command for an attempt, once the master port answers."""
        if self.command.running() or self.phase is Phase.DONE or not self.in_attempt():
            return
        self.attempt = attempt
        address, port = self.spec.master.address, int(self.spec.master_port or 0)
        if port and not reachable(address, port):
            message = (
                f"cannot open {address}:{port} on the master {self.master_host}: "
                "check the firewall (roles/firewall) and the route"
            )
            self.say(message)
            self.reason = self.failure(FailureKind.START, message)
            self.send_master(
                {
                    "t": Kind.EXIT.value,
                    "attempt": attempt,
                    "exit_status": None,
                    "kind": FailureKind.START.value,
                    "message": message,
                    "errors": [],
                    "rank": self.spec.rank,
                    "at_s": time.time(),
                }
            )
            self.set_phase(Phase.IDLE)
            return
        self.set_phase(Phase.RUNNING)
        failed = self.start_command()
        if failed is not None:
            self.on_command(failed)

    # -- the local command ------------------------------------------------------------------
    def on_command(self, ended: Ended) -> None:
        if self.phase is Phase.DONE:
            return  # its ranks finished: what follows is teardown (said to the master)
        if ended.reported:
            message, reason = self.reported(ended)
            finished = self.finished_here()
            self.reason = None if finished else reason
            self.send_master(
                {
                    "t": Kind.EXIT.value,
                    "attempt": self.attempt,
                    "exit_status": ended.code,
                    "errors": ended.errors,
                    "rank": self.spec.rank,
                    "at_s": time.time(),
                    "message": message,
                    "cause": ended.cause,
                    "finished": finished,
                }
            )
            self.command.end("it reported a failure")
            if finished:
                self.set_phase(Phase.DONE)
            return
        self.command_ended(ended)

    def command_ended(self, ended: Ended) -> None:
        """This worker's command ended: tell the master (whether its ranks had all finished
        training, for a command that failed after: saves.finished)."""
        words = f"its command ended, {describe_exit(ended.code)}"
        failed = ended.code != 0 and not ended.aborted and not self.stop_requested
        finished = self.finished_here() if failed else ""
        self.send_master(
            {
                "t": Kind.EXIT.value,
                "attempt": self.attempt,
                "exit_status": ended.code,
                "aborted": ended.aborted and not self.stop_requested,
                "stopped": self.stop_requested,
                "errors": ended.errors,
                "rank": self.spec.rank,
                "at_s": time.time(),
                "message": words,
                "cause": ended.cause,
                "finished": finished,
            }
        )
        if self.stop_requested:
            self.leave(Phase.STOPPED, self.failure(FailureKind.STOPPED, "stopped on request"))
            return
        if (ended.code == 0 and not ended.aborted) or finished:
            self.set_phase(Phase.DONE)
            return
        if not ended.aborted:
            self.reason = self.failure(
                FailureKind.EXITED,
                self.explained(words, ended.cause),
                exit_status=ended.code,
                errors=tuple(ended.errors),
                cause=ended.cause,
            )
        self.set_phase(Phase.IDLE)

    # -- clocks -------------------------------------------------------------------------------
    def thawed(self, now: float) -> bool:
        """Whether this node got no CPU time (frozen, suspended) since the last look: the master
        has given up on it. Said once; the look's clock moves on."""
        if now - self.last_tick <= self.t.peer:
            return False
        self.frozen, self.last_tick = now - self.last_tick, now
        self.say(f"this node was frozen for {self.frozen:.0f} s")
        return True

    def tick(self, now: float) -> None:
        if self.thawed(now):
            self.master_gone(f"this node was frozen for {self.frozen:.0f} s")
        self.last_tick = now
        if now - self.last_beat >= self.t.heartbeat:
            self.last_beat = now
            self.send_master(
                {
                    "t": Kind.BEAT.value,
                    "phase": self.phase.value,
                    "attempt": self.attempt,
                    "stopped_procs": self.command.frozen(),
                }
            )
        if self.master_seen is None:
            self.check_first_contact(now)
        else:
            self.check_master(now)

    def check_first_contact(self, now: float) -> None:
        """The master's watchdog must answer within the start timeout."""
        if now <= self.connect_deadline:
            return
        why = f" ({self.unauthenticated})" if self.unauthenticated else ""
        self.leave(
            Phase.FAILED,
            self.failure(
                FailureKind.START,
                f"cannot reach the watchdog on {self.spec.master.address}:"
                f"{self.spec.watchdog_port} (is the master's agent up, and does the "
                f"firewall let it through?){why}",
                node=self.master_host,
            ),
        )

    def check_master(self, now: float) -> None:
        """A silent master is gone; one gone for good ends this node's part."""
        assert self.master_seen is not None
        if now - self.master_seen > self.t.peer and self.master_lost_at is None:
            if self.uplink is not None:
                self.uplink.close()
                self.uplink = None
            self.master_gone(f"no heartbeat for {self.t.peer:.0f} s")
        if self.master_lost_at is None or self.command.running():
            return
        if not self.master_refused and now - self.master_lost_at <= self.t.restart:
            return
        if self.phase is Phase.DONE:
            self.leave(Phase.SUCCEEDED, None)
            return
        reason = self.reason
        if not reason or reason.kind is not FailureKind.VANISHED:
            ended = " (its agent has ended)" if self.master_refused else " for good"
            why = f"lost the master {self.master_host}{ended}"
            reason = self.failure(FailureKind.VANISHED, why, node=self.master_host)
        self.leave(Phase.FAILED, reason)

    def master_gone(self, why: str) -> None:
        """The master went silent or closed: end the command here, wait for it to come back.
        Where this node was frozen meanwhile (its connection's end read before the loop's clock),
        the freeze is the reason."""
        self.thawed(time.monotonic())
        if self.master_lost_at is None:
            self.master_lost_at = time.monotonic()
            self.say(f"lost the master {self.master_host}: {why}")
        if not self.command.running():
            return
        if self.frozen:
            self.reason = self.failure(
                FailureKind.VANISHED, f"this node was frozen for {self.frozen:.0f} s"
            )
        else:
            self.reason = self.failure(FailureKind.VANISHED, why, node=self.master_host)
        self.command.end(f"the master {self.master_host} is gone")

    def leave(self, phase: Phase, reason: Failure | None) -> None:
        """End this worker's part of the job."""
        self.command.end_now("the job ended")
        self.reason = reason
        said = f" ({reason.node}: {reason.message})" if reason else ""
        self.say(f"the job ended here: {phase.value}{said}")
        self.set_phase(phase)
