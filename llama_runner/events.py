"""ansible-runner's callbacks for one run, and what its events say: run id, progress, failure."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import (
    Phase,
    RankStatus,
)

from llama_runner.errors import HostUnreachable, InvalidInput, PlaybookFailed
from llama_runner.results import Event, HostStats, TrainProgress

EventCallback = Callable[[Event], None]
ProgressCallback = Callable[[TrainProgress], None]

# The set_stats key that names the run a playbook acts on (train.yml publishes it once the plan
# is made). Playbooks that find an existing run (tasks/find_run.yml) set the fact `run_id`.
RUN_ID_STAT = "llama_run_id"
RUN_ID_FACT = "run_id"

# Failures of these modules in a play on localhost are input validation (the pre-flight play;
# run_plan: train.yml's check and plan of a new run).
_VALIDATION_ACTIONS = frozenset({"assert", "fail", "validate_argument_spec", "run_plan"})


class EventCollector:
    """ansible-runner's event handler: keeps every event, follows the run id and the progress,
    and passes each event and progress report on to the caller's callbacks."""

    def __init__(
        self,
        on_event: EventCallback | None,
        on_progress: ProgressCallback | None,
        cancel: Callable[[], None],
    ) -> None:
        self.on_event = on_event
        self.on_progress = on_progress
        self.cancel = cancel
        self.events: list[Event] = []
        self.progress: TrainProgress | None = None
        self.run_id: str | None = None
        self.artifact_data: dict[str, Any] = {}  # set_stats data, from the stats event
        self.callback_error: BaseException | None = None
        self.pid: int | None = None  # ansible-playbook's, from its first event

    def __call__(self, event: Event) -> bool:
        self.events.append(event)
        if self.pid is None and isinstance(event.get("pid"), int):
            self.pid = event["pid"]
        data = event.get("event_data", {})
        if event.get("event") == "playbook_on_stats":
            self.artifact_data = dict(data.get("artifact_data") or {})
        res = data.get("res")
        progress = None
        if isinstance(res, Mapping):
            self.run_id = _run_id_in(res) or self.run_id
            progress = TrainProgress.from_result(data.get("host", ""), res)
            self.progress = progress or self.progress
        if self.callback_error is None:
            try:
                if self.on_event:
                    self.on_event(event)
                if progress and self.on_progress:
                    self.on_progress(progress)
            except Exception as exc:  # re-raised once the run has ended
                self.callback_error = exc
                self.cancel()
        return True  # ansible-runner keeps (writes) an event only when its handler says so


def _run_id_in(res: Mapping[str, Any]) -> str | None:
    """The run id a task result names: set_stats `llama_run_id`, or find_run.yml's `run_id`."""
    stats = (res.get("ansible_stats") or {}).get("data") or {}
    facts = res.get("ansible_facts") or {}
    value = stats.get(RUN_ID_STAT) or facts.get(RUN_ID_FACT)
    return value if isinstance(value, str) and value else None


class Canceller:
    """ansible-runner's cancel_callback: stops ansible-playbook the way Ctrl-C would.

    ansible-runner cancels with SIGKILL to ansible-playbook's process group, which leaves the
    worker processes (each in its own session) and the commands they run behind. SIGTERM first
    lets ansible-playbook terminate its workers; SIGKILL follows if it has not exited in time.
    """

    GRACE_S = 20.0

    def __init__(self, requested: threading.Event, collector: EventCollector) -> None:
        self.requested = requested
        self.collector = collector
        self.signalled_at: float | None = None

    def __call__(self) -> bool:
        if not self.requested.is_set():
            return False
        if self.collector.pid is None:
            return True  # no playbook running yet
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
            try:
                os.kill(self.collector.pid, signal.SIGTERM)
            except ProcessLookupError:
                return True
        return time.monotonic() - self.signalled_at > self.GRACE_S


def failure_message(res: Mapping[str, Any]) -> str:
    """The most useful message of a failed task result (a failed loop item's, if any)."""
    for item in res.get("results") or ():
        if isinstance(item, Mapping) and item.get("failed"):
            return failure_message(item)
    message = str(res.get("msg") or "").strip()
    stderr = str(res.get("stderr") or "").strip()
    if stderr and stderr not in message:
        tail = "\n".join(stderr.splitlines()[-10:])
        message = f"{message}\n{tail}" if message else tail
    errors = res.get("argument_errors")
    if errors and not message:
        message = "; ".join(str(e) for e in errors)
    return message or "failed (no message)"


def _fatal_failure(events: list[Event], hosts: Mapping[str, HostStats]) -> Event | None:
    """The failure that ended the run: of the first host that failed, its last failure (a
    block's rescue that re-raises, to hand on a clearer message, is the one to report)."""
    failed_hosts = {h for h, s in hosts.items() if s.failed or s.unreachable}
    candidates = [
        e
        for e in events
        if e.get("event") == "runner_on_unreachable"
        or (e.get("event") == "runner_on_failed" and not e["event_data"].get("ignore_errors"))
    ]
    # A failure later rescued leaves its host out of the final failures.
    fatal = [e for e in candidates if e["event_data"].get("host") in failed_hosts] or candidates
    if not fatal:
        return None
    first = fatal[0]["event_data"].get("host")
    return [e for e in fatal if e["event_data"].get("host") == first][-1]


def error_from_events(events: Iterable[Event], hosts: Mapping[str, HostStats]) -> PlaybookFailed:
    """The typed error that explains a failed run: its first failure that was not rescued."""
    events = list(events)
    event = _fatal_failure(events, hosts)
    if event is None:
        return PlaybookFailed("the playbook failed before any task ran (see stdout)")
    data = event["event_data"]
    host, task = data.get("host"), data.get("task")
    message = failure_message(data.get("res") or {})
    if event["event"] == "runner_on_unreachable":
        return HostUnreachable(message, host=host, task=task)
    action = str(data.get("resolved_action") or data.get("task_action") or "").rsplit(".", 1)[-1]
    on_controller = data.get("play_pattern") in ("localhost", "127.0.0.1")
    if action == "validate_argument_spec" or (on_controller and action in _VALIDATION_ACTIONS):
        return InvalidInput(message, host=host, task=task)
    culprits = _job_failed_hosts(events, before=event.get("counter", 0))
    return PlaybookFailed(
        message, host=culprits[0] if culprits else host, task=task, failed_hosts=culprits
    )


def _job_failed_hosts(events: Iterable[Event], before: int) -> tuple[str, ...]:
    """The node the job watcher last reported failed: the failure of the leading rank of a
    `llama_job` status or wait result (the protocol's RankStatus, unchanged)."""
    culprits: tuple[str, ...] = ()
    for event in events:
        if event.get("counter", 0) >= before:
            break
        res = event.get("event_data", {}).get("res")
        lead = res.get("lead") if isinstance(res, Mapping) else None
        if isinstance(lead, Mapping):
            rank = RankStatus.from_dict(lead)
            if rank.phase is Phase.FAILED and rank.reason is not None and rank.reason.node:
                culprits = (rank.reason.node,)
    return culprits


def touched_nodes(events: Iterable[Event] | None) -> bool:
    """Whether a run got as far as acting on a node (any event from a host but localhost)."""
    if events is None:
        return True  # unknown: assume it did
    return any(e.get("event_data", {}).get("host") not in (None, "localhost") for e in events)
