"""The master's agent: coordinates the job. Starts rank 0's command, opens the gate once it
listens and every peer has joined, watches the peers' heartbeats and rank 0's progress, ends
the attempt on every node at the first failure, names the node that explains it, and restarts
from the last checkpoint while restarts are left. A resumed run (the spec's `resume`) takes
the same way in: the checkpoint every node holds first (`continue_run`), then its attempt."""

from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

from .agent import NodeAgent
from .checkpoints import continue_plan, listing, restart_stamp, resume_stamp
from .command import Ended
from .link import Hub, Link
from .logs import is_peer_symptom, last_record, stall_limit
from .procs import listening_inodes, socket_owners
from .protocol import Failure, FailureKind, Phase, Restart, describe_exit, iso
from .untrusted import file_size
from .wire import Kind

REFUSALS_EVERY = 10.0  # seconds between the log's lines on refused connections


def choose_culprit(candidates: list[Failure]) -> Failure | None:
    """The failure that explains the others.

    A request to stop wins; then a node whose failure is its own (not a lost connection to a
    peer), earliest first; then a node that vanished or stalled; then the earliest of the rest.
    """
    if not candidates:
        return None
    own = (FailureKind.EXITED, FailureKind.START)
    gone = (FailureKind.VANISHED, FailureKind.STALLED, FailureKind.LOST)

    def key(item: Failure) -> tuple[int, float]:
        if item.kind is FailureKind.STOPPED:
            rank = 0
        elif item.kind in own and not is_peer_symptom(list(item.errors)):
            rank = 1
        elif item.kind in gone:
            rank = 2
        else:
            rank = 3
        return rank, float(item.at_s or 0)

    return sorted(candidates, key=key)[0]


@dataclass
class Peer:
    """A worker as the master sees it."""

    link: Link | None = None
    seen: float | None = None
    phase: Phase = Phase.ABSENT
    done: bool = False
    reported: int = 0
    stopped_procs: bool = False
    checkpoints: list[dict[str, Any]] | None = None  # listed since its command ended

    @property
    def joined(self) -> bool:
        """Whether its agent is connected (and authenticated)."""
        return self.link is not None


@dataclass
class Progress:
    """Rank 0's trainer log as the stall clock follows it."""

    size: int = -1
    seen_at: float = 0.0
    seen_any: bool = False
    intervals: list[float] | None = None


class MasterAgent(NodeAgent):
    """Coordinates the job: start, gate, watch, abort, restart, finish."""

    def __init__(self, spec: Any) -> None:  # noqa: ANN401 - a JobSpec
        super().__init__(spec)
        self.peers = {host: Peer() for host in spec.peers}
        self.server: socket.socket | None = None
        self.hub: Hub | None = None
        self.candidates: list[Failure] = []
        self.abort_started: float | None = None
        self.local_done_at: float | None = None
        self.gate_open = False
        self.watch = Progress()
        self.last_beat = 0.0
        self.last_refusals = time.monotonic()
        # A resumed run: every node's checkpoints are gathered before its first attempt starts.
        self.gathering = False

    def peers_state(self, now: float) -> dict[str, Any]:
        return {
            host: {
                "phase": peer.phase.value,
                "connected": bool(peer.link and not peer.link.closed),
                "silent_s": None if peer.seen is None else round(now - peer.seen, 1),
            }
            for host, peer in self.peers.items()
        }

    # -- the loop's frame -------------------------------------------------------------------
    def begin(self) -> bool:
        if self.peers:  # a job of one node (a service) has no peer to hear from
            self.server = self.listen()
            if self.server is None:
                return False
            self.hub = Hub(self.server, self.spec.key, self.spec.job, len(self.peers))
            self.hub.start(self.events)
        if self.spec.resume:
            self.gathering = True
            self.say("a resumed run: waiting for every node's checkpoints")
            self.set_phase(Phase.STARTING)
        else:
            self.begin_attempt()
        return True

    def finish(self) -> None:
        reason = self.reason.to_dict() if self.reason else None
        self.broadcast({"t": Kind.FINAL.value, "phase": self.phase.value, "reason": reason})
        if self.server is not None:
            time.sleep(0.5)  # let the final message reach the peers before the sockets close
            self.server.close()

    def listen(self) -> socket.socket | None:
        """The watchdog's listening socket."""
        port, address = self.spec.watchdog_port, self.spec.master.address
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for host in (address, ""):
            try:
                server.bind((host, port))
                break
            except OSError as err:
                if err.errno != errno.EADDRNOTAVAIL or host == "":
                    why = f"the watchdog cannot listen on port {port}: {err}"
                    self.reason = self.failure(FailureKind.START, why)
                    self.set_phase(Phase.FAILED)
                    return None
        server.listen(64)
        return server

    def broadcast(self, message: dict[str, Any]) -> None:
        """Send a message to every connected peer."""
        for peer in self.peers.values():
            if peer.link is not None:
                peer.link.send(message)

    # -- events -------------------------------------------------------------------------------
    def on_event(self, kind: str, link: Link | None, data: dict[str, Any] | None) -> None:
        if kind == "stop":
            self.stop()
        elif kind == "eof":
            host = link.host if link else None
            if host in self.peers and self.peers[host].link is link:
                self.peers[host].link = None
                self.peer_gone(
                    host,
                    "its agent closed the connection (the node or its llama-job ended)",
                    silent=False,
                )
        elif data is not None and link is not None:
            self.on_message(link, data)

    def stop(self) -> None:
        """A stop was requested here."""
        if not self.stop_requested:
            self.stop_requested = True
            self.say("stop requested")
            self.add_candidate(
                self.failure(FailureKind.STOPPED, "stopped on request (llama-job stop)")
            )

    def on_message(self, link: Link, data: dict[str, Any]) -> None:
        """A verified message of a peer."""
        kind = data.get("t")
        if kind == Kind.HELLO.value:
            self.peer_hello(link, data)
            return
        host = link.host
        if host not in self.peers or self.peers[host].link is not link:
            return
        peer = self.peers[host]
        peer.seen = time.monotonic()
        listed = data.get("checkpoints")
        if isinstance(listed, list) and all(isinstance(e, dict) for e in listed):
            peer.checkpoints = listed
        if kind == Kind.BEAT.value:
            peer.phase = Phase.of(data.get("phase"), peer.phase)
            peer.stopped_procs = bool(data.get("stopped_procs"))
        elif kind == Kind.EXIT.value:
            self.peer_exit(host, peer, data)
        elif kind == Kind.IDLE.value:
            peer.phase = Phase.IDLE
            peer.reported = int(data.get("attempt") or 0)

    def peer_hello(self, link: Link, data: dict[str, Any]) -> None:
        """A node's agent joined (or joined again after a freeze): check it, note it."""
        host = data.get("host")
        if host not in self.peers:
            link.send({"t": Kind.REFUSED.value, "why": f"{host!r} is not a node of this job"})
            link.close()
            return
        assert isinstance(host, str)
        peer = self.peers[host]
        if peer.link is not None and peer.link is not link:
            peer.link.close()
        link.host = host
        peer.link, peer.seen = link, time.monotonic()
        peer.phase = Phase.of(data.get("phase"), Phase.WAITING)
        self.say(f"{host} joined (its phase: {peer.phase.value})")
        link.send(
            {
                "t": Kind.WELCOME.value,
                "phase": self.phase.value,
                "attempt": self.attempt,
                "nonce": data.get("nonce"),
            }
        )

    def peer_exit(self, host: str, peer: Peer, data: dict[str, Any]) -> None:
        """A peer's command ended: done, ended on request, or a failure."""
        peer.reported = int(data.get("attempt") or 0)
        code = data.get("exit_status")
        code = code if isinstance(code, int) and not isinstance(code, bool) else None
        if data.get("attempt") != self.attempt or data.get("aborted"):
            peer.phase = Phase.IDLE  # an earlier attempt, or ended because this master asked
            return
        if code == 0 and not data.get("stopped"):
            peer.phase, peer.done = Phase.DONE, True
            self.say(f"{host}: its command ended, exit status 0")
            return
        peer.phase = Phase.IDLE
        cause = data.get("cause") if isinstance(data.get("cause"), dict) else None
        message = str(data.get("message") or f"its command ended, {describe_exit(code)}")
        kind = FailureKind.STOPPED if data.get("stopped") else FailureKind.of(data.get("kind"))
        reason = self.failure(
            kind,
            self.explained(message, cause, node=host),
            node=host,
            rank=data.get("rank") if isinstance(data.get("rank"), int) else None,
            exit_status=code,
            errors=tuple(str(e) for e in data.get("errors") or []),
            cause=cause,
        )
        if isinstance(data.get("at_s"), int | float):
            reason = replace(reason, at_s=float(data["at_s"]))
        self.add_candidate(reason)

    def peer_gone(self, host: str, why: str, *, silent: bool = True) -> None:
        """A peer vanished (fell silent, or closed its connection: `silent` False): a failure
        while the job runs."""
        self.peers[host].phase = Phase.ABSENT
        self.say(f"{host}: {why}")
        if self.phase in (Phase.STARTING, Phase.RUNNING):
            self.add_candidate(self.failure(FailureKind.VANISHED, why, node=host, silent=silent))

    def add_candidate(self, reason: Failure) -> None:
        """A failure: end this attempt on every node (once), and keep it for the verdict."""
        self.candidates.append(reason)
        if self.abort_started is None and self.phase in (
            Phase.STARTING,
            Phase.RUNNING,
            Phase.RESTARTING,
        ):
            self.begin_abort()

    def begin_abort(self) -> None:
        """Tell every node to end this attempt, and end it here."""
        self.abort_started = time.monotonic()
        for peer in self.peers.values():
            peer.checkpoints = None  # a restart needs what each holds once its command ended
        first = self.candidates[-1]
        self.say(f"ending attempt {self.attempt} on every node: {first.node}: {first.message}")
        message = {"t": Kind.ABORT.value, "attempt": self.attempt, "reason": first.to_dict()}
        self.broadcast(message)
        self.command.end(f"{first.node}: {first.message}")
        self.set_phase(Phase.STOPPING)

    # -- the local command ------------------------------------------------------------------
    def on_command(self, ended: Ended) -> None:
        if ended.reported:
            _message, reason = self.reported(ended)
            self.add_candidate(reason)
            self.command.end("it reported a failure")
            return
        if self.phase is Phase.STOPPING and ended.aborted:
            return
        if ended.code == 0 and self.phase is Phase.RUNNING:
            self.local_done_at = time.monotonic()
            return
        message = f"its command ended, {describe_exit(ended.code)}"
        if self.phase is Phase.STARTING and not self.gate_open:
            message += f" before it listened on port {self.spec.gate_port}"
        self.add_candidate(
            self.failure(
                FailureKind.EXITED,
                self.explained(message, ended.cause),
                exit_status=ended.code,
                errors=tuple(ended.errors),
                cause=ended.cause,
            )
        )

    def begin_attempt(self) -> None:
        """Start this node's command and wait for the gate and the peers."""
        self.candidates, self.reason, self.abort_started = [], None, None
        self.local_done_at, self.gate_open = None, False
        path = self.spec.progress_file
        self.watch = Progress(file_size(path) if path else -1, time.monotonic(), False, [])
        for peer in self.peers.values():
            peer.done = False
        self.set_phase(Phase.STARTING)
        self.phase_since = time.monotonic()  # the start timeout counts from here
        failed = self.start_command()
        if failed is not None:
            self.on_command(failed)

    def gate_passed(self) -> bool:
        """Whether this job's own command listens on the gate port (nobody else's counts)."""
        port = self.spec.gate_port
        if not port:
            return True
        inodes = listening_inodes(int(port))
        if not inodes:
            return False
        return any(socket_owners(set(inodes), self.command.processes()).values())

    # -- clocks -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if now - self.last_beat >= self.t.heartbeat:
            self.last_beat = now
            self.broadcast(
                {"t": Kind.BEAT.value, "phase": self.phase.value, "attempt": self.attempt}
            )
        self.report_refusals(now)
        for host, peer in self.peers.items():
            if peer.link is not None and peer.seen is not None and now - peer.seen > self.t.peer:
                link, peer.link = peer.link, None
                link.close()
                self.peer_gone(host, f"stopped answering (no heartbeat for {self.t.peer:.0f} s)")
        ticks = {
            Phase.STARTING: self.tick_starting,
            Phase.RUNNING: self.tick_running,
            Phase.STOPPING: self.tick_stopping,
            Phase.RESTARTING: self.tick_restarting,
        }
        if self.phase in ticks:
            ticks[self.phase](now)

    def report_refusals(self, now: float) -> None:
        """One log line, at most every REFUSALS_EVERY s, on what the watchdog port refused."""
        if self.hub is None or now - self.last_refusals < REFUSALS_EVERY:
            return
        self.last_refusals = now
        refused = self.hub.take_refused()
        if refused:
            said = ", ".join(f"{count} x {why}" for why, count in refused.most_common(6))
            self.say(f"the watchdog port refused {sum(refused.values())} messages: {said}")

    def tick_starting(self, now: float) -> None:
        """The gate opens once rank 0 listens; the attempt runs once every peer has joined (a
        resumed run: once every node has said which checkpoints it holds)."""
        if self.gathering:
            self.gather(now, self.t.start)
            return
        if not self.gate_open and self.command.running() and self.gate_passed():
            self.gate_open = True
            self.say(f"rank 0 listens on port {self.spec.gate_port}")
        missing = [h for h, p in self.peers.items() if not p.joined]
        if self.gate_open and not missing:
            self.broadcast({"t": Kind.START.value, "attempt": self.attempt})
            self.set_phase(Phase.RUNNING)
            self.watch.seen_at = now
            return
        if now - self.phase_since <= self.t.start:
            return
        if not self.gate_open:
            why = f"rank 0 did not listen on port {self.spec.gate_port} within {self.t.start:.0f} s"
            self.add_candidate(self.failure(FailureKind.START, why))
            return
        for host in missing:
            self.add_candidate(
                self.failure(
                    FailureKind.START,
                    f"never joined the watchdog on {self.spec.master.address}:"
                    f"{self.spec.watchdog_port} within {self.t.start:.0f} s "
                    "(is llama-job running there, and does the firewall let it through?)",
                    node=host,
                )
            )

    def tick_running(self, now: float) -> None:
        """Every node done: succeeded; else the stall clock, and the late finishers."""
        self.read_progress(now)
        if self.local_done_at is not None:
            self.check_finish(now)
            return
        if not self.spec.progress_file:
            return
        limit = stall_limit(self.watch.intervals or [], self.t.as_dict(), self.watch.seen_any)
        silent = now - self.watch.seen_at
        if silent <= limit:
            return
        frozen = [h for h, p in self.peers.items() if p.stopped_procs]
        if self.command.frozen():
            frozen.insert(0, self.host)
        what = "first progress record" if not self.watch.seen_any else "new step"
        self.add_candidate(
            self.failure(
                FailureKind.STALLED,
                f"no {what} in {os.path.basename(self.spec.progress_file)} for "
                f"{silent:.0f} s (limit {limit:.0f} s)"
                + (f"; stopped processes on {', '.join(frozen)}" if frozen else ""),
                node=frozen[0] if frozen else self.host,
            )
        )

    def check_finish(self, now: float) -> None:
        """Rank 0 is done: the job is, once every peer is; a peer far behind has stalled."""
        if all(p.done for p in self.peers.values()):
            self.say("every node finished")
            self.set_phase(Phase.SUCCEEDED)
            return
        waited = now - (self.local_done_at or now)
        if waited > self.t.stall_floor:
            late = [h for h, p in self.peers.items() if not p.done]
            why = f"still running {waited:.0f} s after rank 0 finished"
            self.add_candidate(self.failure(FailureKind.STALLED, why, node=late[0]))

    def read_progress(self, now: float) -> None:
        """Follow rank 0's trainer log: progress for status, and the stall clock."""
        path = self.spec.progress_file
        if not path:
            return
        size = file_size(path)
        if size == self.watch.size:
            return
        self.watch.size = size
        record = last_record(path)
        if not record or record == self.progress:
            return
        if self.watch.seen_any:
            self.watch.intervals = [*(self.watch.intervals or []), now - self.watch.seen_at][-50:]
        self.watch.seen_any, self.watch.seen_at = True, now
        self.progress = record
        self.write_state(force=False)

    def tick_stopping(self, now: float) -> None:
        """The abort ends when every node has ended its command (or is gone)."""
        since = now - (self.abort_started or now)
        if self.command.running() or since < self.t.settle:
            return
        ended = (Phase.IDLE, Phase.DONE, Phase.ABSENT)
        waiting = [h for h, p in self.peers.items() if p.joined and p.phase not in ended]
        overdue = since > self.t.stop + self.t.peer
        if waiting and not overdue:
            return
        for host in waiting:
            self.peer_gone(
                host, f"did not end its command within {self.t.stop + self.t.peer:.0f} s"
            )
        self.decide(choose_culprit(self.candidates) or self.failure(FailureKind.EXITED, "failed"))

    def decide(self, verdict: Failure) -> None:
        """After an abort: stopped, a restart, or failed."""
        self.abort_started = None
        if self.stop_requested or verdict.kind is FailureKind.STOPPED:
            self.reason = verdict
            self.say("stopped on every node")
            self.set_phase(Phase.STOPPED)
            return
        used, allowed = len(self.restarts), self.spec.max_restarts
        if verdict.kind.restartable() and used < allowed:
            self.reason = verdict
            self.say(
                f"attempt {self.attempt} failed ({verdict.node}: {verdict.message}); "
                f"restart {used + 1} of {allowed} once every node is back"
            )
            self.set_phase(Phase.RESTARTING)
            return
        if verdict.kind.restartable() and allowed:
            verdict = verdict.said(f" (no restart left: {used} of {allowed} used)")
        self.reason = verdict
        self.say(f"failed: {verdict.node}: {verdict.message}")
        self.set_phase(Phase.FAILED)

    # -- continuing from a checkpoint: a restart, or a resumed run's first attempt ------------
    def tick_restarting(self, now: float) -> None:
        """Start the next attempt once every node is back."""
        self.gather(now, self.t.restart)

    def gather(self, now: float, within: float) -> None:
        """Continue the run once every node is connected, idle and has said which checkpoints
        it holds; fail, naming the nodes that stayed away, after `within` seconds."""
        back = (Phase.IDLE, Phase.DONE, Phase.WAITING)
        listed = bool(self.spec.checkpoints_dir)
        away = [
            h
            for h, p in self.peers.items()
            if not (p.joined and p.phase in back and (p.checkpoints is not None or not listed))
        ]
        if not away:
            self.continue_run()
            return
        if now - self.phase_since <= within:
            return
        late = f"{', '.join(away)} did not come back within {within:.0f} s"
        if self.reason is None:  # a resumed run whose nodes never all joined
            self.reason = self.failure(FailureKind.START, late, node=away[0], away=tuple(away))
        else:
            self.reason = replace(self.reason.said(f"; no restart: {late}"), away=tuple(away))
        self.gathering = False
        self.say(f"failed: {', '.join(away)} stayed away")
        self.set_phase(Phase.FAILED)

    def continue_run(self) -> None:
        """Every node is back: the next attempt, from the checkpoint they all hold. The one way
        a run continues: after a failure (a restart, `self.reason` its cause) and at the start
        of a resumed run alike."""
        after, resuming = self.reason, self.gathering
        self.gathering = False
        stamp = resume_stamp() if resuming else restart_stamp(self.attempt + 1)
        found = {self.host: listing(self.spec.checkpoints_dir)}
        found.update({host: peer.checkpoints or [] for host, peer in self.peers.items()})
        plan = continue_plan(
            found,
            self.spec.job,
            self.spec.checkpoints_dir,
            stamp,
            sharded=self.spec.sharded,
            from_scratch=not resuming,
        )
        if not plan["ok"]:
            self.say(f"failed: {plan['message']}")
            self.reason = (
                after.said(f"; no restart: {plan['message']}")
                if after is not None
                else self.failure(FailureKind.START, plan["message"])
            )
            self.set_phase(Phase.FAILED)
            return
        if after is not None:
            self.attempt += 1
            self.restarts.append(Restart(self.attempt, iso(time.time()), after, plan["checkpoint"]))
            self.say(
                f"restart {len(self.restarts)} of {self.spec.max_restarts}: attempt {self.attempt}"
            )
        elif resuming:  # attempts count on from the launch before (carry_history)
            self.attempt += 1 if self.history else 0
            now = iso(time.time())
            self.history.append(Restart(self.attempt, now, self.earlier, plan["checkpoint"], True))
        if plan["message"]:
            self.say(plan["message"])
        self.broadcast(
            {
                "t": Kind.CONTINUE.value,
                "attempt": self.attempt,
                "after": after.to_dict() if after is not None else None,
                "plan": plan,
            }
        )
        self.prepare_continue(plan)
        self.begin_attempt()
