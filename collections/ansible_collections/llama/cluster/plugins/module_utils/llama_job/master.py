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
from dataclasses import dataclass, field, replace
from typing import Any

from .agent import NodeAgent
from .checkpoints import continue_plan, listing, restart_stamp, resume_stamp
from .command import Ended
from .link import Hub, Link
from .logs import is_peer_symptom, last_record, stall_limit
from .procs import listening_inodes, socket_owners
from .protocol import Failure, FailureKind, Phase, Restart, describe_exit, iso
from .saves import activity, activity_stamp, measure_write_speed, save_allowance
from .untrusted import file_size
from .wire import Kind

REFUSALS_EVERY = 10.0  # seconds between the log's lines on refused connections


@dataclass(frozen=True)
class Arrival:
    """A failure as it reached the master: `at` is the master's monotonic clock when it did
    (a worker's own clock, Failure.at_s, may be skewed, or not a number)."""

    at: float
    failure: Failure


def choose_culprit(arrivals: list[Arrival]) -> Failure | None:
    """The failure that explains the others.

    A request to stop wins; then a node whose failure is its own (not a lost connection to a
    peer); then a node that vanished or stalled; then the rest: within each, the one that
    reached the master first, by the master's clock.
    """
    if not arrivals:
        return None
    own = (FailureKind.EXITED, FailureKind.START)
    gone = (FailureKind.VANISHED, FailureKind.STALLED, FailureKind.LOST)

    def key(arrival: Arrival) -> tuple[int, float]:
        item = arrival.failure
        if item.kind is FailureKind.STOPPED:
            rank = 0
        elif item.kind in own and not is_peer_symptom(list(item.errors)):
            rank = 1
        elif item.kind in gone:
            rank = 2
        else:
            rank = 3
        return rank, arrival.at

    return sorted(arrivals, key=key)[0].failure


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
    rank: int = 0  # its node rank, as it said when it joined

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
    activity: tuple[int, int] | None = None  # rank 0's activity file as last seen (saves.py)
    doing: dict[str, Any] = field(default_factory=dict)  # ... and what it said


class MasterAgent(NodeAgent):
    """Coordinates the job: start, gate, watch, abort, restart, finish."""

    def __init__(self, spec: Any) -> None:  # noqa: ANN401 - a JobSpec
        super().__init__(spec)
        self.peers = {host: Peer() for host in spec.peers}
        self.server: socket.socket | None = None
        self.hub: Hub | None = None
        self.candidates: list[Arrival] = []
        # Failures in teardown after every rank of a node finished: warnings, unless the run
        # fails after all (then they are among the candidates).
        self.teardown: list[Arrival] = []
        self.save_s = 0.0  # what a save may take beyond the stall limit (saves.py)
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
            self.hub = Hub(self.server, self.spec.key, self.spec.job, self.host, self.spec.peers)
            self.hub.start(self.events)
        self.plan_saves()
        if self.spec.resume:
            self.gathering = True
            self.say("a resumed run: waiting for every node's checkpoints")
            self.set_phase(Phase.STARTING)
        else:
            self.begin_attempt()
        return True

    def plan_saves(self) -> None:
        """What a save may take beyond the stall limit: the planned checkpoint over the speed
        of this node's disk, measured here once (saves.py)."""
        planned, directory = self.spec.checkpoint_bytes, self.spec.checkpoints_dir
        if not planned or not self.spec.progress_file:
            return
        speed = self.spec.disk_write_bps or measure_write_speed(directory)
        self.save_s = save_allowance(planned, speed)
        measured = f"{speed / (1 << 20):,.0f} MiB/s" if speed else "not measured"
        self.say(
            f"a save of a checkpoint (about {planned / (1 << 20):,.1f} MiB on {directory}; its "
            f"disk: {measured}) may take {self.save_s:.0f} s beyond the stall limit"
        )

    def finish(self) -> None:
        self.last_refusals = -REFUSALS_EVERY  # what was refused since the last line, said now
        self.report_refusals(time.monotonic())
        reason = self.reason.to_dict() if self.reason else None
        self.broadcast({"t": Kind.FINAL.value, "phase": self.phase.value, "reason": reason})
        if self.server is not None:
            time.sleep(0.5)  # let the final message reach the peers before the sockets close
            self.server.close()

    def listen(self) -> socket.socket | None:
        """The watchdog's listening socket, on the master's cluster address only (never every
        interface: where that address does not bind, the job does not start, naming it)."""
        port, address = self.spec.watchdog_port, self.spec.master.address
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind((address, port))
        except OSError as err:
            hint = (
                f"{address} is not an address of this node: set its cluster_address"
                if err.errno == errno.EADDRNOTAVAIL
                else str(err)
            )
            why = f"the watchdog cannot listen on {address}:{port}: {hint}"
            server.close()
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
                if link is not None and link.cut:  # it may connect again, within the peer timeout
                    self.say(f"{host}: cut its connection ({link.cut}); waiting for it to return")
                    return
                self.peer_gone(
                    host,
                    "its agent closed the connection (the node or its llama-job ended)",
                    silent=False,
                )
        elif data is not None and link is not None:
            self.on_message(link, data)

    def stop(self) -> None:
        """A stop was requested here (unless this node is shutting down: go_down)."""
        if not self.stop_requested and not self.go_down():
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
        rank = data.get("rank")
        peer.rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else peer.rank
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
        finished = data.get("finished")
        peer.phase = Phase.DONE if finished else Phase.IDLE
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
        if data.get("at_s") is not None:  # its clock (messages.py: finite): said, never ordered by
            reason = replace(reason, at_s=float(data["at_s"]))
        if isinstance(finished, str) and finished:
            peer.done = True
            self.after_finish(reason, finished)
            return
        self.add_candidate(reason)

    def peer_gone(self, host: str, why: str, *, silent: bool = True) -> None:
        """A peer vanished (fell silent, or closed its connection: `silent` False): a failure
        while the job runs (unless the run goes on without it: min_nodes)."""
        self.peers[host].phase = Phase.ABSENT
        self.say(f"{host}: {why}")
        if host in self.left_out:
            return
        if self.phase in (Phase.STARTING, Phase.RUNNING):
            self.add_candidate(self.failure(FailureKind.VANISHED, why, node=host, silent=silent))

    def after_finish(self, reason: Failure, finished: str) -> None:
        """A node's command failed after its every rank finished training and its final
        checkpoint is whole: a warning, kept for the verdict should the run fail after all."""
        note = f"{reason.node}: {reason.message}, after {finished} (a failure in teardown)"
        self.say(f"warning: {note}")
        self.warnings.append(note)
        self.teardown.append(Arrival(time.monotonic(), reason))

    def add_candidate(self, reason: Failure) -> None:
        """A failure: end this attempt on every node (once), and keep it for the verdict (with
        the teardown failures before it: they came first)."""
        self.candidates.extend(self.teardown)
        self.teardown = []
        self.candidates.append(Arrival(time.monotonic(), reason))
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
        first = self.candidates[-1].failure
        self.say(f"ending attempt {self.attempt} on every node: {first.node}: {first.message}")
        message = {"t": Kind.ABORT.value, "attempt": self.attempt, "reason": first.to_dict()}
        self.broadcast(message)
        self.command.end(f"{first.node}: {first.message}")
        self.set_phase(Phase.STOPPING)

    # -- the local command ------------------------------------------------------------------
    def on_command(self, ended: Ended) -> None:
        if self.local_done_at is not None:
            return  # its ranks finished: what follows is teardown (after_finish said it)
        finished = self.finished_here() if self.phase is Phase.RUNNING else ""
        if ended.reported:
            _message, reason = self.reported(ended)
            if finished:
                self.local_done_at = time.monotonic()
                self.after_finish(reason, finished)
            else:
                self.add_candidate(reason)
            self.command.end("it reported a failure")
            return
        if self.phase is Phase.STOPPING and ended.aborted:
            return
        if ended.code == 0 and self.phase is Phase.RUNNING:
            self.local_done_at = time.monotonic()
            return
        message = f"its command ended, {describe_exit(ended.code)}"
        if finished:
            self.local_done_at = time.monotonic()
            reason = self.failure(FailureKind.EXITED, message, exit_status=ended.code)
            self.after_finish(replace(reason, errors=tuple(ended.errors)), finished)
            return
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
        self.candidates, self.teardown, self.reason, self.abort_started = [], [], None, None
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
            # A peer heard from (connected, or its connection cut) whose silence outlasts the
            # peer timeout.
            heard = peer.seen is not None and peer.phase is not Phase.ABSENT
            if heard and now - (peer.seen or now) > self.t.peer:
                link, peer.link = peer.link, None
                if link is not None:
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
        missing = [h for h, p in self.peers.items() if not p.joined and h not in self.left_out]
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
        doing = self.read_activity(now)
        saving = doing.get("what") == "saving"
        if saving:
            limit += self.save_s
        silent = now - self.watch.seen_at
        if silent <= limit:
            return
        frozen = [h for h, p in self.peers.items() if p.stopped_procs]
        if self.command.frozen():
            frozen.insert(0, self.host)
        what = "first progress record" if not self.watch.seen_any else "new step"
        saved = doing.get("checkpoint")
        during = f", {self.save_s:.0f} s of it for saving {saved}" if saving else ""
        self.add_candidate(
            self.failure(
                FailureKind.STALLED,
                f"no {what} in {os.path.basename(self.spec.progress_file)} for "
                f"{silent:.0f} s (limit {limit:.0f} s{during})"
                + (f"; stopped processes on {', '.join(frozen)}" if frozen else ""),
                node=frozen[0] if frozen else self.host,
            )
        )

    def read_activity(self, now: float) -> dict[str, Any]:
        """Rank 0's activity (saves.py): a rewrite of it is a sign of life (an evaluation's
        progress, a save's start and end) that restarts the stall clock."""
        stamp = activity_stamp(self.marks)
        if stamp is None:
            return {}
        if stamp != self.watch.activity:
            self.watch.activity, self.watch.seen_at = stamp, now
            self.watch.doing = activity(self.marks)
        return self.watch.doing

    def check_finish(self, now: float) -> None:
        """Rank 0 is done: the job is, once every peer is; a peer far behind has stalled."""
        if all(p.done for h, p in self.peers.items() if h not in self.left_out):
            self.say("every node finished")
            self.set_phase(Phase.SUCCEEDED)
            return
        waited = now - (self.local_done_at or now)
        if waited > self.t.stall_floor:
            late = [h for h, p in self.peers.items() if not p.done and h not in self.left_out]
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
        waiting = [
            h
            for h, p in self.peers.items()
            if p.joined and p.phase not in ended and h not in self.left_out
        ]
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
        it holds (a node the last attempt ran without: if it is back by then); after `within`
        seconds, on the nodes that are back if they are at least min_nodes, else fail naming
        the nodes that stayed away."""
        back = [h for h, p in self.peers.items() if self.is_back(p)]
        away = [h for h in self.peers if h not in back and h not in self.left_out]
        if not away:
            self.continue_run(back)
            return
        if now - self.phase_since <= within:
            return
        late = f"{', '.join(away)} did not come back within {within:.0f} s"
        if self.spec.min_nodes and 1 + len(back) >= self.spec.min_nodes and self.reason:
            self.say(f"{late}: the run continues without them (min_nodes {self.spec.min_nodes})")
            self.continue_run(back)
            return
        if self.reason is None:  # a resumed run whose nodes never all joined
            self.reason = self.failure(FailureKind.START, late, node=away[0], away=tuple(away))
        else:
            self.reason = replace(self.reason.said(f"; no restart: {late}"), away=tuple(away))
        self.gathering = False
        self.say(f"failed: {', '.join(away)} stayed away")
        self.set_phase(Phase.FAILED)

    def is_back(self, peer: Peer) -> bool:
        """Whether a peer is connected, idle and has said which checkpoints it holds."""
        listed = peer.checkpoints is not None or not self.spec.checkpoints_dir
        return peer.joined and peer.phase in (Phase.IDLE, Phase.DONE, Phase.WAITING) and listed

    def continuation(self, back: list[str], resuming: bool, stamp: str) -> dict[str, Any]:
        """The plan of the next attempt on this node and the peers `back`: the checkpoint the
        nodes of the last attempt all hold (continue_plan), and a node that comes back after
        the run went on without it only where it holds that checkpoint too."""
        found = {self.host: listing(self.spec.checkpoints_dir)}
        core = [h for h in back if h not in self.left_out]
        found.update({h: self.peers[h].checkpoints or [] for h in core})
        options = {"sharded": self.spec.sharded, "from_scratch": not resuming}
        plan = continue_plan(found, self.spec.job, self.spec.checkpoints_dir, stamp, **options)
        returning = [h for h in back if h in self.left_out]
        if plan["ok"] and returning:
            found.update({h: self.peers[h].checkpoints or [] for h in returning})
            wider = continue_plan(found, self.spec.job, self.spec.checkpoints_dir, stamp, **options)
            if wider["ok"] and wider["checkpoint"] == plan["checkpoint"]:
                plan, core = wider, core + returning
        nodes = [self.host, *sorted(core, key=lambda h: self.peers[h].rank)]
        fewer = self.spec.fewer_nodes.get(len(nodes))
        return {
            **plan,
            "nodes": nodes,
            "args": list(fewer.args) if fewer else [],
            "note": fewer.note if fewer else "",
        }

    def continue_run(self, back: list[str] | None = None) -> None:
        """Every node is back (or min_nodes of them, `back` the peers among them): the next
        attempt, from the checkpoint they all hold. The one way a run continues: after a
        failure (a restart, `self.reason` its cause) and at the start of a resumed run alike."""
        after, resuming = self.reason, self.gathering
        self.gathering = False
        stamp = resume_stamp() if resuming else restart_stamp(self.attempt + 1)
        plan = self.continuation(list(self.peers) if back is None else back, resuming, stamp)
        if not plan["ok"]:
            self.say(f"failed: {plan['message']}")
            self.reason = (
                after.said(f"; no restart: {plan['message']}")
                if after is not None
                else self.failure(FailureKind.START, plan["message"])
            )
            self.set_phase(Phase.FAILED)
            return
        self.left_out = [h for h in self.peers if h not in plan["nodes"]]
        if after is not None:
            self.attempt += 1
            self.restarts.append(
                Restart(
                    self.attempt,
                    iso(time.time()),
                    after,
                    plan["checkpoint"],
                    tuple(self.left_out),
                    plan["note"],
                )
            )
            self.say(
                f"restart {len(self.restarts)} of {self.spec.max_restarts}: attempt {self.attempt}"
            )
        elif resuming:  # attempts count on from the launch before (carry_history)
            self.attempt += 1 if self.history else 0
            now = iso(time.time())
            self.history.append(
                Restart(self.attempt, now, self.earlier, plan["checkpoint"], resumed=True)
            )
        if self.left_out:
            self.say(
                f"attempt {self.attempt} runs on {len(plan['nodes'])} of {self.spec.nnodes} nodes "
                f"({', '.join(plan['nodes'])}), without {', '.join(self.left_out)}: "
                f"{plan['note'] or 'as planned'}"
            )
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
