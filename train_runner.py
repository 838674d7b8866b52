"""llama-cluster from Python: every playbook as a method with a structured result, and a CLI.

    from train_runner import Cluster
    cluster = Cluster()                       # the lab: inventory/lab.yml
    cluster.provision()
    result = cluster.train("tiny", on_event=print)
    print(result.summary.final_loss, result.summary.loss_plot)

Each call is one ansible-runner run of one playbook (no ansible-playbook subprocess): the
project's ansible.cfg applies, artifacts go to .runner/artifacts/<ident>/ (the oldest rotated
away), results come from Ansible's events, and failures raise typed exceptions that name the
failing host, task and message.

CLI: python train_runner.py {lab,provision,check,train,status,stop,logs,export,run} --help
Exit codes: 0 success, 1 a playbook failed, 2 bad input (a validation play, an argument spec or
the command line rejected it), 3 a host was unreachable, 130 interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import ansible_runner
import yaml
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.logging import RichHandler
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

PROJECT_DIR = Path(__file__).resolve().parent
DEFAULT_INVENTORY = PROJECT_DIR / "inventory" / "lab.yml"
DEFAULT_PRIVATE_DATA_DIR = PROJECT_DIR / ".runner"
CONTROLLER_RUNS_DIR = PROJECT_DIR / "runs"
DEFAULT_KEEP_ARTIFACTS = 20
# Ctrl-C presses that abandon the stop which follows an interrupted training run.
SHIELD_INTERRUPTS = 3

PLAYBOOKS: dict[str, str] = {
    "lab": "playbooks/lab.yml",
    "provision": "provision.yml",
    "check": "playbooks/check.yml",
    "train": "train.yml",
    "status": "playbooks/status.yml",
    "stop": "playbooks/stop.yml",
    "logs": "playbooks/logs.yml",
    "export": "playbooks/export.yml",
}

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130

# Failures of these modules in a play on localhost are input validation (the pre-flight play).
_VALIDATION_ACTIONS = frozenset({"assert", "fail", "validate_argument_spec"})

log = logging.getLogger("train_runner")

Event = dict[str, Any]
EventCallback = Callable[[Event], None]


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostStats:
    """What one host did in a run, from the final stats event (ok includes changed)."""

    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    rescued: int = 0
    ignored: int = 0


@dataclass(frozen=True)
class TrainProgress:
    """One progress report of a watched training job (rank 0's trainer log)."""

    host: str
    text: str
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    lr: float | None = None
    epoch: float | None = None
    elapsed_s: float | None = None
    remaining_s: float | None = None
    tokens_per_s: float | None = None

    @classmethod
    def from_result(cls, host: str, res: Mapping[str, Any]) -> TrainProgress | None:
        """The progress in a task result, or None when the result carries none.

        Reads the contract's names (step, elapsed_s, ...) and LLaMA-Factory's own trainer log
        names (current_steps, elapsed_time "H:MM:SS", throughput, ...).
        """
        data = res.get("progress_data")
        if not isinstance(data, Mapping) and not res.get("progress"):
            return None
        data = data if isinstance(data, Mapping) else {}

        def first(*keys: str) -> Any:  # noqa: ANN401 - a JSON value
            return next((data[k] for k in keys if data.get(k) is not None), None)

        return cls(
            host=host,
            text=str(res.get("progress") or ""),
            step=_number(first("step", "current_steps"), int),
            total_steps=_number(first("total_steps"), int),
            loss=_number(first("loss"), float),
            lr=_number(first("lr", "learning_rate"), float),
            epoch=_number(first("epoch"), float),
            elapsed_s=_seconds(first("elapsed_s", "elapsed_time")),
            remaining_s=_seconds(first("remaining_s", "remaining_time")),
            tokens_per_s=_number(first("tokens_per_s", "throughput"), float),
        )

    @property
    def fraction(self) -> float | None:
        """How much of the run is done, 0 to 1, when the trainer said."""
        if self.step is None or not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)


def _number(value: object, kind: type[int] | type[float]) -> Any:  # noqa: ANN401 - int | float
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def _seconds(value: object) -> float | None:
    """Seconds from a number or an "[D days, ]H:MM:SS" duration."""
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str) or not value.strip():
        return None
    days = 0
    text = value.strip()
    if "day" in text:
        head, _, text = text.partition(",")
        days = _number(head.split()[0], int) or 0
    try:
        parts = [float(p) for p in text.strip().split(":")]
    except ValueError:
        return None
    total = 0.0
    for part in parts:
        total = total * 60 + part
    return days * 86400 + total


@dataclass(frozen=True)
class TrainSummary:
    """What train.yml reports at the end of a run (its set_stats `llama_run`)."""

    run_id: str
    world_size: int | None = None
    effective_batch_size: int | None = None
    runtime_s: float | None = None
    final_loss: float | None = None
    last_step: int | None = None
    output_dir: str | None = None
    checkpoints: tuple[str, ...] = ()
    controller_dir: Path | None = None
    loss_plot: Path | None = None

    @classmethod
    def from_stats(cls, data: Mapping[str, Any]) -> TrainSummary:
        """The summary from the `llama_run` mapping of the stats event."""

        def path(value: object) -> Path | None:
            return Path(str(value)) if value else None

        return cls(
            run_id=str(data.get("run_id", "")),
            world_size=data.get("world_size"),
            effective_batch_size=data.get("effective_batch_size"),
            runtime_s=data.get("runtime_s"),
            final_loss=data.get("final_loss"),
            last_step=data.get("last_step"),
            output_dir=data.get("output_dir"),
            checkpoints=tuple(str(c) for c in data.get("checkpoints") or ()),
            controller_dir=path(data.get("controller_dir")),
            loss_plot=path(data.get("loss_plot")),
        )


@dataclass
class RunResult:
    """The outcome of one playbook run."""

    playbook: str
    ident: str
    status: str  # ansible-runner's: successful, failed, canceled, timeout
    rc: int | None
    hosts: dict[str, HostStats]
    artifact_dir: Path
    run_id: str | None = None
    data: dict[str, Any] = field(default_factory=dict)  # set_stats data of the run
    summary: TrainSummary | None = None
    progress: TrainProgress | None = None  # the last one seen
    events: list[Event] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """Whether the playbook succeeded."""
        return self.status == "successful"

    @property
    def stdout_path(self) -> Path:
        """Ansible's output of this run, as it would have printed it."""
        return self.artifact_dir / "stdout"

    @property
    def controller_dir(self) -> Path | None:
        """Where the run's logs, plots and exports came back to on the controller, if anywhere."""
        if self.summary and self.summary.controller_dir:
            return self.summary.controller_dir
        if self.run_id and (CONTROLLER_RUNS_DIR / self.run_id).is_dir():
            return CONTROLLER_RUNS_DIR / self.run_id
        return None

    @property
    def files(self) -> list[Path]:
        """The files in the controller directory of the run (logs, plots, exports)."""
        root = self.controller_dir
        return sorted(p for p in root.rglob("*") if p.is_file()) if root else []


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
class RunnerError(Exception):
    """Base of every error train_runner raises."""

    def __init__(self, message: str, result: RunResult | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.result = result


class PlaybookFailed(RunnerError):
    """A task failed. `host` is the node that failed: for a distributed job, the node whose rank
    failed first (as the job watcher reported it), else the host the failing task ran on.
    `task` is the failing task, `failed_hosts` every node the job watcher saw fail."""

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        task: str | None = None,
        failed_hosts: tuple[str, ...] = (),
        result: RunResult | None = None,
    ) -> None:
        super().__init__(message, result)
        self.host = host
        self.task = task
        self.failed_hosts = failed_hosts

    def __str__(self) -> str:
        where = " ".join(
            part
            for part in (
                f"host {self.host}" if self.host else "",
                f"task '{self.task}'" if self.task else "",
            )
            if part
        )
        return f"{where}: {self.message}" if where else self.message


class HostUnreachable(PlaybookFailed):
    """Ansible could not reach a host."""


class InvalidInput(PlaybookFailed, ValueError):
    """The inputs were rejected: by a validation play, an argument spec, or before any run."""


class RunInterrupted(RunnerError):
    """The run was cancelled (Ctrl-C, SIGTERM or Cluster.cancel()).

    `stopped` says whether the training ranks were stopped on the cluster afterwards; when it is
    False and `run_id` is set, the run may still be going (detached, or the stop failed).
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        stopped: bool = False,
        result: RunResult | None = None,
    ) -> None:
        super().__init__(message, result)
        self.run_id = run_id
        self.stopped = stopped


# --------------------------------------------------------------------------------------------
# Event collection
# --------------------------------------------------------------------------------------------
class _Collector:
    """Keeps a run's events and the facts the result is built from; ansible-runner's handler."""

    def __init__(self, on_event: EventCallback | None, cancel: Callable[[], None]) -> None:
        self.on_event = on_event
        self.cancel = cancel
        self.events: list[Event] = []
        self.progress: TrainProgress | None = None
        self.run_id: str | None = None
        self.callback_error: BaseException | None = None
        self.pid: int | None = None  # ansible-playbook's, from its first event

    def __call__(self, event: Event) -> bool:
        self.events.append(event)
        if self.pid is None and isinstance(event.get("pid"), int):
            self.pid = event["pid"]
        data = event.get("event_data", {})
        res = data.get("res")
        if isinstance(res, Mapping):
            progress = TrainProgress.from_result(data.get("host", ""), res)
            if progress:
                self.progress = progress
            self.run_id = _run_id_in(res.get("ansible_facts")) or self.run_id
        if self.on_event and self.callback_error is None:
            try:
                self.on_event(event)
            except Exception as exc:  # re-raised once the run has ended
                self.callback_error = exc
                self.cancel()
        return True  # ansible-runner keeps (writes) an event only when its handler says so

    def stats_event(self) -> Event | None:
        return next(
            (e for e in reversed(self.events) if e.get("event") == "playbook_on_stats"), None
        )


def _run_id_in(facts: object) -> str | None:
    """The run id a play settled on: a `run_id` fact, or one inside a fact (train.yml's plan)."""
    if not isinstance(facts, Mapping):
        return None
    candidates = [facts.get("run_id")]
    candidates += [v.get("run_id") for v in facts.values() if isinstance(v, Mapping)]
    return next((c for c in candidates if isinstance(c, str) and c), None)


class _Canceller:
    """ansible-runner's cancel_callback: stops ansible-playbook the way Ctrl-C would.

    ansible-runner cancels with SIGKILL to ansible-playbook's process group, which leaves the
    worker processes (each in its own session) and the commands they run behind. SIGTERM first
    lets ansible-playbook terminate its workers; SIGKILL follows if it has not exited in time.
    """

    GRACE_S = 20.0

    def __init__(self, requested: threading.Event, collector: _Collector) -> None:
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


def _host_stats(stats: Mapping[str, Any]) -> dict[str, HostStats]:
    def count(key: str, host: str) -> int:
        return int((stats.get(key) or {}).get(host, 0))

    names: set[str] = set()
    for key in ("processed", "ok", "changed", "failures", "dark", "skipped"):
        names.update((stats.get(key) or {}).keys())
    return {
        host: HostStats(
            ok=count("ok", host),
            changed=count("changed", host),
            failed=count("failures", host),
            unreachable=count("dark", host),
            skipped=count("skipped", host),
            rescued=count("rescued", host),
            ignored=count("ignored", host),
        )
        for host in sorted(names)
    }


def _failure_message(res: Mapping[str, Any]) -> str:
    """The most useful message of a failed task result (a failed loop item's, if any)."""
    for item in res.get("results") or ():
        if isinstance(item, Mapping) and item.get("failed"):
            return _failure_message(item)
    message = str(res.get("msg") or "").strip()
    stderr = str(res.get("stderr") or "").strip()
    if stderr and stderr not in message:
        tail = "\n".join(stderr.splitlines()[-10:])
        message = f"{message}\n{tail}" if message else tail
    errors = res.get("argument_errors")
    if errors and not message:
        message = "; ".join(str(e) for e in errors)
    return message or "failed (no message)"


def _error_from_events(events: Iterable[Event], hosts: Mapping[str, HostStats]) -> PlaybookFailed:
    """The typed error that explains a failed run: its first fatal failure."""
    failed_hosts = {h for h, s in hosts.items() if s.failed or s.unreachable}
    events = list(events)
    candidates = []
    for event in events:
        kind = event.get("event")
        data = event.get("event_data", {})
        if kind == "runner_on_unreachable" or (
            kind == "runner_on_failed" and not data.get("ignore_errors")
        ):
            candidates.append(event)
    # A failure later rescued leaves its host out of the final failures.
    fatal = [e for e in candidates if e["event_data"].get("host") in failed_hosts] or candidates
    if not fatal:
        return PlaybookFailed("the playbook failed before any task ran (see stdout)")
    event = fatal[0]
    data = event["event_data"]
    host, task = data.get("host"), data.get("task")
    message = _failure_message(data.get("res") or {})
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
    """The nodes the job watcher last reported failed, in the order their ranks failed."""
    culprits: tuple[str, ...] = ()
    for event in events:
        if event.get("counter", 0) >= before:
            break
        res = event.get("event_data", {}).get("res")
        if isinstance(res, Mapping) and res.get("failed_hosts"):
            culprits = tuple(str(h) for h in res["failed_hosts"])
    return culprits


def _stdout_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(line for line in text.splitlines()[-lines:] if line.strip())


# --------------------------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------------------------
def _find_ansible_next_to_python() -> None:
    """Put this interpreter's bin first on PATH when ansible-playbook is not on PATH.

    ansible-runner starts `ansible-playbook` by name: with `.venv/bin/python train_runner.py`
    and no activated venv it would not be found.
    """
    if shutil.which("ansible-playbook") is None:
        bin_dir = str(Path(sys.executable).parent)
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


class Cluster:
    """A llama-cluster inventory, and the playbooks that act on it.

    Methods block until their playbook ends and return a RunResult, or raise PlaybookFailed,
    HostUnreachable, InvalidInput or RunInterrupted. `on_event` (here or per call) receives every
    Ansible event as ansible-runner reports it, from the runner's thread. cancel() (from any thread
    or a signal handler) or a KeyboardInterrupt cancels the current run. One run at a time per
    Cluster; artifacts of the last `keep_artifacts` runs stay in <private_data_dir>/artifacts/.
    """

    def __init__(
        self,
        inventory: str | os.PathLike[str] | None = None,
        *,
        project_dir: str | os.PathLike[str] = PROJECT_DIR,
        private_data_dir: str | os.PathLike[str] | None = None,
        keep_artifacts: int = DEFAULT_KEEP_ARTIFACTS,
        verbosity: int = 0,
        quiet: bool = True,
        on_event: EventCallback | None = None,
    ) -> None:
        if keep_artifacts < 1:
            raise InvalidInput("keep_artifacts must be at least 1")
        _find_ansible_next_to_python()
        self.project_dir = Path(project_dir).resolve()
        self.inventory = Path(inventory or DEFAULT_INVENTORY).resolve()
        self.private_data_dir = Path(
            private_data_dir or self.project_dir / DEFAULT_PRIVATE_DATA_DIR.name
        ).resolve()
        self.keep_artifacts = keep_artifacts
        self.verbosity = verbosity
        self.quiet = quiet
        self.on_event = on_event
        self._cancel = threading.Event()
        self._busy = threading.Lock()
        self._collector: _Collector | None = None

    # ---- the playbooks ---------------------------------------------------------------------
    def lab(
        self, nodes: int = 2, state: str = "present", *, on_event: EventCallback | None = None
    ) -> RunResult:
        """Start (present) or remove (absent) the local Docker lab of `nodes` nodes."""
        if state not in ("present", "absent"):
            raise InvalidInput(f"state must be present or absent, not {state!r}")
        if nodes < 1:
            raise InvalidInput(f"nodes must be at least 1, not {nodes}")
        # The lab plays on localhost and writes the inventory: it needs none.
        return self.run_playbook(
            PLAYBOOKS["lab"],
            {"lab_nodes": nodes, "lab_state": state},
            inventory=False,
            on_event=on_event,
        )

    def provision(self, *, on_event: EventCallback | None = None, **extravars: object) -> RunResult:
        """Install and wire the training stack on every node (provision.yml)."""
        return self.run_playbook(PLAYBOOKS["provision"], extravars, on_event=on_event)

    def check(self, *, on_event: EventCallback | None = None, **extravars: object) -> RunResult:
        """Check the cluster's consistency, reachability and all-reduce (playbooks/check.yml)."""
        return self.run_playbook(PLAYBOOKS["check"], extravars, on_event=on_event)

    def train(
        self,
        model: str | None = None,
        dataset: str | None = None,
        *,
        resume: bool = False,
        detach: bool = False,
        run_id: str | None = None,
        on_event: EventCallback | None = None,
        **overrides: object,
    ) -> RunResult:
        """Train `model` (a catalogue name) on `dataset`; `overrides` are train.yml's other
        variables (model_path, cutoff_len, deepspeed, train_args={...}, ...).

        Returns when the run has finished (or, with detach, once every rank has started); the
        result's `run_id` is the one train.yml settled on and `summary` what it reported. With
        `resume`, `run_id` names the run to continue (default: the latest). If the run is
        interrupted once ranks may have started, the cluster is asked to stop it (stop.yml)
        unless `detach`, and RunInterrupted says whether it was.
        """
        if not resume and not (model and isinstance(model, str)):
            raise InvalidInput("model must be a catalogue name such as 'tiny'")
        extravars: dict[str, Any] = {"resume": resume, "detach": detach}
        extravars |= {"model": model} if model else {}
        extravars |= {"dataset": dataset} if dataset else {}
        extravars |= {"run_id": run_id} if run_id else {}
        clash = set(overrides) & set(extravars)
        if clash:
            raise InvalidInput(f"overrides repeat named arguments: {', '.join(sorted(clash))}")
        extravars |= overrides
        try:
            result = self.run_playbook(PLAYBOOKS["train"], extravars, on_event=on_event)
        except RunInterrupted as interrupted:
            if detach or not _touched_nodes(interrupted.result):
                raise  # detached on purpose, or interrupted before any node was touched
            # Without the run id (not seen yet), stop.yml stops the latest run: train.yml
            # refuses to start while another one runs.
            outcome = self._stop_after_interrupt(interrupted.run_id, interrupted.result)
            raise outcome from interrupted
        if result.summary is None and result.data.get("llama_run"):
            result.summary = TrainSummary.from_stats(result.data["llama_run"])
        return result

    def status(
        self, run_id: str | None = None, *, on_event: EventCallback | None = None
    ) -> RunResult:
        """The state of a run on every node (playbooks/status.yml); its report is in `data`."""
        return self.run_playbook(PLAYBOOKS["status"], _with_run_id(run_id), on_event=on_event)

    def stop(
        self, run_id: str | None = None, *, on_event: EventCallback | None = None
    ) -> RunResult:
        """Stop a run's ranks on every node (playbooks/stop.yml)."""
        return self.run_playbook(PLAYBOOKS["stop"], _with_run_id(run_id), on_event=on_event)

    def logs(
        self, run_id: str | None = None, *, on_event: EventCallback | None = None
    ) -> RunResult:
        """Bring a run's logs back to runs/<run id>/ (playbooks/logs.yml); see `files`."""
        return self.run_playbook(PLAYBOOKS["logs"], _with_run_id(run_id), on_event=on_event)

    def export(
        self,
        run_id: str | None = None,
        *,
        on_event: EventCallback | None = None,
        **extravars: object,
    ) -> RunResult:
        """Export a run's model (playbooks/export.yml); `extravars` are export.yml's options."""
        return self.run_playbook(
            PLAYBOOKS["export"], _with_run_id(run_id) | extravars, on_event=on_event
        )

    # ---- the machinery ---------------------------------------------------------------------
    @property
    def current_run_id(self) -> str | None:
        """The run id the playbook in progress settled on, once an event has shown it."""
        collector = self._collector
        return collector.run_id if collector else None

    def cancel(self) -> None:
        """Cancel the run in progress (ansible-runner stops ansible-playbook within seconds)."""
        self._cancel.set()

    def run_playbook(
        self,
        playbook: str | os.PathLike[str],
        extravars: Mapping[str, Any] | None = None,
        *,
        inventory: bool = True,
        on_event: EventCallback | None = None,
        shield: bool = False,
    ) -> RunResult:
        """Run one playbook (relative to the project, or absolute) and return its result.

        `inventory=False` runs it without -i (localhost-only playbooks). `shield` makes a
        KeyboardInterrupt leave the run alone (used for the stop that follows an interrupt).
        """
        playbook_path = self.project_dir / playbook
        if not playbook_path.is_file():
            raise InvalidInput(f"no playbook {playbook_path} in this checkout")
        if inventory and not self.inventory.is_file():
            raise InvalidInput(
                f"inventory {self.inventory} does not exist"
                + (
                    " (start the lab: train_runner.py lab)"
                    if self.inventory == DEFAULT_INVENTORY
                    else ""
                )
            )
        stale = self.private_data_dir / "env"
        if stale.exists():
            # ansible-runner would silently add env/extravars, env/envvars ... to every run.
            raise RunnerError(f"{stale} exists: remove it, train_runner passes everything per call")
        self.private_data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self._busy.acquire(blocking=False):
            raise RunnerError("this Cluster is running a playbook already: one run at a time")
        try:
            return self._run(playbook_path, extravars or {}, inventory, on_event, shield=shield)
        finally:
            self._busy.release()

    def _run(
        self,
        playbook: Path,
        extravars: Mapping[str, Any],
        inventory: bool,
        on_event: EventCallback | None,
        *,
        shield: bool,
    ) -> RunResult:
        verb = playbook.stem
        ident = f"{verb}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        self._cancel.clear()
        collector = self._collector = _Collector(on_event or self.on_event, self.cancel)
        thread, runner = ansible_runner.run_async(
            private_data_dir=str(self.private_data_dir),
            project_dir=str(self.project_dir),
            playbook=str(playbook),
            inventory=str(self.inventory) if inventory else None,
            extravars=dict(extravars),
            envvars=self._envvars(),
            ident=ident,
            rotate_artifacts=self.keep_artifacts,
            suppress_env_files=True,
            # The project's jsonfile cache (ansible.cfg), shared with ansible-playbook runs,
            # rather than one per artifact directory that rotation deletes.
            fact_cache_type="ansible.cfg",
            quiet=self.quiet,
            verbosity=self.verbosity or None,
            event_handler=collector,
            cancel_callback=_Canceller(self._cancel, collector),
        )
        self._wait(thread, Path(runner.config.artifact_dir), shield=shield)

        stats_event = collector.stats_event()
        stats_data = stats_event["event_data"] if stats_event else {}
        data = dict(stats_data.get("artifact_data") or {})
        summary = TrainSummary.from_stats(data["llama_run"]) if "llama_run" in data else None
        run_id = (
            (summary.run_id if summary else None) or collector.run_id or extravars.get("run_id")
        )
        result = RunResult(
            playbook=str(playbook.relative_to(self.project_dir))
            if playbook.is_relative_to(self.project_dir)
            else str(playbook),
            ident=ident,
            status=runner.status,
            rc=runner.rc,
            hosts=_host_stats(stats_data),
            artifact_dir=Path(runner.config.artifact_dir),
            run_id=run_id,
            data=data,
            summary=summary,
            progress=collector.progress,
            events=collector.events,
        )
        if collector.callback_error is not None:
            raise collector.callback_error
        if runner.status == "canceled" or (not result.ok and self._cancel.is_set()):
            result.status = "canceled"
            raise RunInterrupted(f"{verb} was interrupted", run_id=run_id, result=result)
        if not result.ok:
            error = _error_from_events(collector.events, result.hosts)
            if error.host is None and error.task is None:
                error.message = f"{error.message}\n{_stdout_tail(result.stdout_path)}".strip()
            error.result = result
            raise error
        return result

    def _wait(self, thread: threading.Thread, artifact_dir: Path, *, shield: bool) -> None:
        # Poll rather than join(timeout): a KeyboardInterrupt inside join() marks a live thread
        # as finished on Python 3.11 (its tstate lock is released), sleep() is safe to interrupt.
        interrupts = 0
        touched = time.monotonic()
        while thread.is_alive():
            if time.monotonic() - touched > 10:
                # Rotation removes the oldest artifact directories by mtime, whichever process
                # runs next: keep a long run's directory the newest while it runs.
                with contextlib.suppress(OSError):
                    os.utime(artifact_dir)
                touched = time.monotonic()
            try:
                time.sleep(0.2)
            except KeyboardInterrupt:
                interrupts += 1
                if not shield or interrupts >= SHIELD_INTERRUPTS:
                    self.cancel()
                else:
                    log.warning(
                        "still stopping the run (press Ctrl-C %d more times to abandon the stop)",
                        SHIELD_INTERRUPTS - interrupts,
                    )

    def _stop_after_interrupt(self, run_id: str | None, result: RunResult | None) -> RunInterrupted:
        log.warning("interrupted: stopping run %s on every node", run_id or "(the latest)")
        try:
            stopped = self.run_playbook(PLAYBOOKS["stop"], _with_run_id(run_id), shield=True)
        except RunnerError as exc:
            return RunInterrupted(
                f"run {run_id or '(the latest)'} was interrupted and could NOT be stopped ({exc});"
                f" its ranks may still be running: python train_runner.py stop --run-id {run_id}",
                run_id=run_id,
                stopped=False,
                result=result,
            )
        run_id = run_id or stopped.run_id
        return RunInterrupted(
            f"run {run_id} was interrupted and stopped on every node",
            run_id=run_id,
            stopped=True,
            result=result,
        )

    def _envvars(self) -> dict[str, str]:
        env: dict[str, str] = {}
        # ansible-runner turns host key checking off unless told; keep ansible.cfg's choice.
        if "ANSIBLE_HOST_KEY_CHECKING" not in os.environ:
            env["ANSIBLE_HOST_KEY_CHECKING"] = str(self._cfg_bool("defaults", "host_key_checking"))
        # ansible-runner replaces the stdout callback; keep the project's inside it (progress
        # lines in the stdout artifact), found where ansible.cfg says.
        callbacks = self.project_dir / "plugins" / "callback"
        if (
            "ANSIBLE_STDOUT_CALLBACK" not in os.environ
            and (callbacks / "llama_progress.py").is_file()
        ):
            env["ANSIBLE_CALLBACK_PLUGINS"] = str(callbacks)
            env["ANSIBLE_STDOUT_CALLBACK"] = "llama_progress"
        return env

    def _cfg_bool(self, section: str, key: str, default: bool = True) -> bool:
        cfg = configparser.ConfigParser(interpolation=None)
        cfg.read(self.project_dir / "ansible.cfg")
        try:
            return cfg.getboolean(section, key, fallback=default)
        except ValueError:
            return default


def _with_run_id(run_id: str | None) -> dict[str, Any]:
    return {"run_id": run_id} if run_id else {}


def _touched_nodes(result: RunResult | None) -> bool:
    """Whether a run got as far as acting on a node (any event from a host but localhost)."""
    if result is None:
        return True  # unknown: assume it did
    return any(
        e.get("event_data", {}).get("host") not in (None, "localhost") for e in result.events
    )


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------
@dataclass
class _HostRow:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    task: str = ""
    state: str = ""


class ConsoleView:
    """Renders a run's events on a rich console: plays, per-host task progress, training bar."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rows: dict[str, _HostRow] = {}
        self.play = ""
        self.task = ""
        self.lock = threading.Lock()
        self.bar = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps  loss {task.fields[loss]}  ETA {task.fields[eta]}"),
            console=console,
        )
        self.bar_task: TaskID | None = None
        self.last_key: str | None = None
        self.note = ""
        self.live = Live(
            console=console, get_renderable=self.render, refresh_per_second=4, transient=True
        )

    def __enter__(self) -> ConsoleView:
        self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.stop()

    def __call__(self, event: Event) -> None:
        with self.lock:
            self._update(event)

    def _update(self, event: Event) -> None:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host")
        row = self.rows.setdefault(host, _HostRow()) if host else None
        if kind == "playbook_on_play_start":
            self.play = data.get("play", "")
            self.console.print(Text.assemble(("PLAY ", "bold blue"), self.play))
        elif kind == "playbook_on_task_start":
            self.task = data.get("task", "")
        elif kind == "runner_on_start" and row:
            row.task, row.state = data.get("task", ""), "running"
        elif kind == "runner_on_ok" and row:
            row.ok += 1
            row.changed += bool((data.get("res") or {}).get("changed"))
            row.state = "changed" if (data.get("res") or {}).get("changed") else "ok"
        elif kind == "runner_on_skipped" and row:
            row.skipped += 1
            row.state = "skipped"
        elif kind == "runner_on_failed" and row:
            ignored = data.get("ignore_errors")
            row.failed += not ignored
            row.state = "failed (ignored)" if ignored else "failed"
            if not ignored:
                message = _failure_message(data.get("res") or {})
                self.console.print(
                    Text.assemble(
                        ("FAILED ", "bold red"), f"{host} | {data.get('task')}: {message}"
                    )
                )
        elif kind == "runner_on_unreachable" and row:
            row.unreachable += 1
            row.state = "unreachable"
            message = _failure_message(data.get("res") or {})
            self.console.print(Text.assemble(("UNREACHABLE ", "bold red"), f"{host}: {message}"))
        res = data.get("res")
        if host and isinstance(res, Mapping):
            progress = TrainProgress.from_result(host, res)
            if progress:
                self._show_progress(progress)

    def _show_progress(self, progress: TrainProgress) -> None:
        self.note = f"[{progress.host}] {progress.text}"
        if progress.total_steps and self.bar_task is None:
            self.bar_task = self.bar.add_task(
                "train", total=progress.total_steps, loss="-", eta="-"
            )
        loss = f"{progress.loss:.4f}" if progress.loss is not None else "-"
        eta = _duration(progress.remaining_s)
        if self.bar_task is not None:
            self.bar.update(
                self.bar_task,
                completed=progress.step or 0,
                total=progress.total_steps,
                loss=loss,
                eta=eta,
            )
        if self.console.is_terminal:
            return
        # No live display on a pipe: a line per new step (or per new state before the first).
        key = str(progress.step) if progress.step is not None else progress.text
        if key != self.last_key:
            self.last_key = key
            if progress.step is None:
                self.console.print(f"[{progress.host}] {progress.text}", markup=False)
            else:
                steps = f"{progress.step}/{progress.total_steps or '?'}"
                self.console.print(
                    f"[{progress.host}] step {steps}  loss {loss}  ETA {eta}", markup=False
                )

    def render(self) -> RenderableType:
        """The live region: one line per host, then the training bar once a job reports."""
        with self.lock:
            table = Table(box=None, title=Text(self.play, style="bold"), title_justify="left")
            for column in ("host", "ok", "changed", "failed", "unreach.", "skipped", "task"):
                table.add_column(column)
            for host, row in sorted(self.rows.items()):
                table.add_row(
                    host,
                    str(row.ok),
                    str(row.changed),
                    str(row.failed),
                    str(row.unreachable),
                    str(row.skipped),
                    f"{row.task} [dim]({row.state})[/]" if row.task else "",
                )
            parts: list[RenderableType] = [table]
            if self.bar_task is not None:
                parts.append(self.bar.get_renderable())
            if self.note:
                parts.append(Text(self.note, style="cyan"))
            return Group(*parts)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _recap(result: RunResult) -> Table:
    table = Table(title=f"{result.playbook}: {result.status}", title_justify="left")
    for column in ("host", "ok", "changed", "failed", "unreachable", "skipped"):
        table.add_column(column, justify="left" if column == "host" else "right")
    for host, s in result.hosts.items():
        table.add_row(
            host, str(s.ok), str(s.changed), str(s.failed), str(s.unreachable), str(s.skipped)
        )
    return table


def _summary_panel(summary: TrainSummary) -> Panel:
    lines = [
        f"run id          {summary.run_id}",
        f"world size      {summary.world_size}",
        f"effective batch {summary.effective_batch_size}",
        f"runtime         {_duration(summary.runtime_s)}",
        f"final loss      {summary.final_loss}",
        f"steps           {summary.last_step}",
        f"output dir      {summary.output_dir}",
        f"checkpoints     {', '.join(Path(c).name for c in summary.checkpoints) or '-'}",
        f"on controller   {summary.controller_dir or '-'}",
        f"loss plot       {summary.loss_plot or '-'}",
    ]
    return Panel("\n".join(lines), title="training summary", expand=False)


def _json_default(value: object) -> object:
    return str(value) if isinstance(value, Path) else repr(value)


def _result_json(result: RunResult) -> str:
    document = dataclasses.asdict(result)
    document.pop("events")
    document["files"] = [str(p) for p in result.files]
    return json.dumps(document, default=_json_default, indent=2)


def _parse_assignments(pairs: Iterable[str]) -> dict[str, Any]:
    """KEY=VALUE pairs as extra variables; values are YAML (numbers, booleans, lists)."""
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise InvalidInput(f"expected KEY=VALUE, got {pair!r}")
        values[key] = yaml.safe_load(raw) if raw else ""
    return values


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_runner.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="exit codes: 0 ok, 1 playbook failed, 2 bad input, 3 host unreachable, "
        "130 interrupted",
    )
    parser.add_argument("-i", "--inventory", help=f"inventory file (default: {DEFAULT_INVENTORY})")
    parser.add_argument(
        "--private-data-dir",
        help=f"ansible-runner's directory: recent artifacts (default {DEFAULT_PRIVATE_DATA_DIR})",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="Ansible verbosity")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    parser.add_argument("--raw", action="store_true", help="show Ansible's own output instead")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "-e", "--set", dest="extravars", action="append", default=[], metavar="KEY=VALUE",
        help="an extra variable (repeatable; the value is YAML)",
    )  # fmt: skip
    run_id = argparse.ArgumentParser(add_help=False)
    run_id.add_argument("--run-id", help="the run (default: what the playbook picks)")

    lab = sub.add_parser("lab", help="start or remove the local Docker lab")
    lab.add_argument("--nodes", type=int, default=2)
    lab.add_argument("--state", choices=("present", "absent"), default="present")
    sub.add_parser("provision", parents=[extra], help="install the stack on every node")
    sub.add_parser("check", parents=[extra], help="check consistency, reachability, all-reduce")
    train = sub.add_parser("train", parents=[extra], help="train a model from the catalogue")
    train.add_argument("--model", help="catalogue name, e.g. tiny, qwen-7b (not with --resume)")
    train.add_argument("--dataset")
    train.add_argument("--run-id", help="with --resume: the run to continue (default: latest)")
    train.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    train.add_argument("--detach", action="store_true", help="return once every rank started")
    sub.add_parser("status", parents=[run_id], help="the state of a run")
    sub.add_parser("stop", parents=[run_id], help="stop a run on every node")
    sub.add_parser("logs", parents=[run_id], help="bring a run's logs to runs/<run id>/")
    sub.add_parser("export", parents=[run_id, extra], help="export a run's model")
    run = sub.add_parser("run", parents=[extra], help="any playbook, e.g. playbooks/wiring.yml")
    run.add_argument("playbook", help="path relative to the project, or absolute")
    return parser


def _dispatch(cluster: Cluster, args: argparse.Namespace) -> RunResult:
    extravars = _parse_assignments(getattr(args, "extravars", []))
    calls: dict[str, Callable[[], RunResult]] = {
        "lab": lambda: cluster.lab(nodes=args.nodes, state=args.state),
        "provision": lambda: cluster.provision(**extravars),
        "check": lambda: cluster.check(**extravars),
        "train": lambda: cluster.train(
            args.model,
            args.dataset,
            resume=args.resume,
            detach=args.detach,
            run_id=args.run_id,
            **extravars,
        ),
        "status": lambda: cluster.status(args.run_id),
        "stop": lambda: cluster.stop(args.run_id),
        "logs": lambda: cluster.logs(args.run_id),
        "export": lambda: cluster.export(args.run_id, **extravars),
        "run": lambda: cluster.run_playbook(args.playbook, extravars),
    }
    return calls[args.command]()


def _report_error(console: Console, exc: RunnerError) -> int:
    """Print what went wrong; return the exit code that says it."""
    if isinstance(exc, RunInterrupted):
        console.print(f"[bold yellow]INTERRUPTED[/] {exc.message}", soft_wrap=True)
        if exc.run_id and not exc.stopped:
            console.print(
                f"run {exc.run_id} may still be running: python train_runner.py status "
                f"--run-id {exc.run_id} / stop --run-id {exc.run_id}",
                soft_wrap=True,
            )
        return EXIT_INTERRUPTED
    if isinstance(exc, PlaybookFailed) and exc.result is not None:
        console.print(_recap(exc.result))
    if isinstance(exc, InvalidInput):
        title, code = "invalid input", EXIT_INVALID_INPUT
    elif isinstance(exc, HostUnreachable):
        title, code = "host unreachable", EXIT_UNREACHABLE
    else:
        title, code = "failed", EXIT_FAILED
    console.print(Text(title.upper(), style="bold red"))
    console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
    if exc.result is not None:
        console.print(f"Ansible's output: {exc.result.stdout_path}")
    return code


def _report_result(console: Console, result: RunResult, *, as_json: bool) -> None:
    console.print(_recap(result))
    if result.summary:
        console.print(_summary_panel(result.summary))
    elif result.run_id:
        console.print(f"run id: {result.run_id}")
    if result.files:
        console.print(f"on the controller: {result.controller_dir} ({len(result.files)} files)")
    if as_json:
        print(_result_json(result))


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code."""
    args = _build_parser().parse_args(argv)
    console = Console(stderr=args.json)
    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    cluster = Cluster(
        args.inventory,
        private_data_dir=args.private_data_dir,
        verbosity=args.verbose,
        quiet=not args.raw,
    )
    view = ConsoleView(console)
    if not args.raw:
        cluster.on_event = view

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        cluster.cancel()

    # Ctrl-C arrives as KeyboardInterrupt, which the Cluster turns into a cancel.
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if args.raw:
            result = _dispatch(cluster, args)
        else:
            with view:
                result = _dispatch(cluster, args)
    except RunnerError as exc:
        return _report_error(console, exc)
    _report_result(console, result, as_json=args.json)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
