"""Cluster: the project's playbooks as methods, each one ansible-runner run with a typed result."""

from __future__ import annotations

import configparser
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import (
    JobStatus,
    Phase,
)
from ansible_runner.interface import init_runner

from llama_runner.checkout import find_project_dir
from llama_runner.errors import InvalidInput, PlaybookFailed, RunInterrupted, RunnerError
from llama_runner.events import (
    Canceller,
    EventCallback,
    EventCollector,
    ProgressCallback,
    error_from_events,
    touched_nodes,
)
from llama_runner.extravars import argument as extravars_argument
from llama_runner.results import (
    Event,
    HostStats,
    RunResult,
    TrainProgress,
    TrainSummary,
    summary_of_files,
)
from llama_runner.scaling import (
    DEFAULT_STEPS,
    MEASURE_ARGS,
    Point,
    Scaling,
    first_nodes,
    master_only,
    pinned,
)
from llama_runner.secrets import SecretsFile, run_secrets

PROJECT_DIR = find_project_dir()
DEFAULT_INVENTORY = PROJECT_DIR / "inventory" / "lab.yml"
DEFAULT_PRIVATE_DATA_DIR = PROJECT_DIR / ".runner"
DEFAULT_KEEP_ARTIFACTS = 20
# The progress line of a training job (stdout callback), in the project's collection.
PROGRESS_CALLBACK = "llama.cluster.llama_progress"
PROGRESS_CALLBACK_FILE = (
    "collections/ansible_collections/llama/cluster/plugins/callback/llama_progress.py"
)
# Ctrl-C presses that abandon the stop which follows an interrupted training run.
SHIELD_INTERRUPTS = 3
# Seconds between two looks at a run that attach() follows (the job watcher's report_every).
ATTACH_POLL_S = 15.0

# The set_stats key under which status.yml publishes the run's JobStatus (its to_dict).
STATUS_STAT = "llama_status"

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

log = logging.getLogger("llama_runner")


def _find_ansible_next_to_python() -> None:
    """Put this interpreter's bin first on PATH when ansible-playbook is not on PATH.

    ansible-runner starts `ansible-playbook` by name: with `.venv/bin/python train_runner.py`
    and no activated venv it would not be found.
    """
    if shutil.which("ansible-playbook") is None:
        bin_dir = str(Path(sys.executable).parent)
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def _with_run_id(run_id: str | None) -> dict[str, Any]:
    return {"run_id": run_id} if run_id else {}


def _train_vars(
    model: str | None,
    dataset: str | None,
    resume: bool,
    run_id: str | None,
    overrides: Mapping[str, object],
    **named: object,
) -> dict[str, Any]:
    """train.yml's extra variables for train() and plan() (`named`: their other arguments);
    InvalidInput for a request without a model, or overrides that repeat a named argument."""
    if not resume and not (model and isinstance(model, str)):
        raise InvalidInput("model must be a catalogue name such as 'tiny'")
    extravars: dict[str, Any] = {"resume": resume, **named}
    extravars |= {"model": model} if model else {}
    extravars |= {"dataset": dataset} if dataset else {}
    extravars |= _with_run_id(run_id)
    clash = set(overrides) & set(extravars)
    if clash:
        raise InvalidInput(f"overrides repeat named arguments: {', '.join(sorted(clash))}")
    return extravars | dict(overrides)


class Cluster:
    """A llama-cluster inventory, and the playbooks that act on it.

    Each method runs one playbook (attach() several in turn) through ansible-runner, which
    starts ansible-playbook with the project's ansible.cfg; it blocks until the end and returns
    a RunResult, or raises PlaybookFailed, HostUnreachable, InvalidInput or RunInterrupted.
    `on_event` (here or per call) receives every Ansible event, `on_progress` every training
    progress report, both from the runner's thread. cancel() (from any thread or a signal
    handler) or a KeyboardInterrupt cancels the current run. One run at a time per Cluster;
    artifacts of the last `keep_artifacts` runs stay in <private_data_dir>/artifacts/.
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
        on_progress: ProgressCallback | None = None,
    ) -> None:
        if keep_artifacts < 1:
            raise InvalidInput("keep_artifacts must be at least 1")
        _find_ansible_next_to_python()
        self.project_dir = Path(project_dir).resolve()
        if not (self.project_dir / "train.yml").is_file():
            raise InvalidInput(
                f"{self.project_dir} is not a llama-cluster checkout (no train.yml): run inside "
                "one, or set LLAMA_CLUSTER_DIR=<checkout>"
            )
        self.inventory = Path(inventory or DEFAULT_INVENTORY).resolve()
        self.private_data_dir = Path(
            private_data_dir or self.project_dir / DEFAULT_PRIVATE_DATA_DIR.name
        ).resolve()
        self.keep_artifacts = keep_artifacts
        self.verbosity = verbosity
        self.quiet = quiet
        self.on_event = on_event
        self.on_progress = on_progress
        self._cancel = threading.Event()
        self._busy = threading.Lock()
        self._collector: EventCollector | None = None

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
        nodes: int | None = None,
        on_event: EventCallback | None = None,
        on_progress: ProgressCallback | None = None,
        **overrides: object,
    ) -> RunResult:
        """Train `model` (a catalogue name) on `dataset`; `overrides` are train.yml's other
        variables (model_path, cutoff_len, deepspeed, train_args={...}, ...). `nodes`: train on
        the inventory's first N nodes in node rank order (a YAML inventory: a copy of it that
        holds them alone, beside it, removed after), the way out the go/no-go names.

        Returns when the run has finished (or, with detach, once every rank has started: attach()
        follows it); the result's `run_id` is the one train.yml settled on and `summary` what it
        reported. With `resume`, `run_id` names the run to continue (default: the latest). If the
        run is interrupted once ranks may have started, the cluster is asked to stop it (stop.yml)
        unless `detach`, and RunInterrupted says whether it was.
        """
        extravars = _train_vars(model, dataset, resume, run_id, overrides, detach=detach)
        if nodes is not None:
            with self._first_nodes(nodes):
                return self.train(
                    model,
                    dataset,
                    resume=resume,
                    detach=detach,
                    run_id=run_id,
                    on_event=on_event,
                    on_progress=on_progress,
                    **overrides,
                )
        try:
            return self.run_playbook(
                PLAYBOOKS["train"], extravars, on_event=on_event, on_progress=on_progress
            )
        except RunInterrupted as interrupted:
            events = interrupted.result.events if interrupted.result else None
            if detach or not touched_nodes(events):
                raise  # detached on purpose, or interrupted before any node was touched
            # Without the run id (not seen yet), stop.yml stops the latest run: train.yml
            # refuses to start while another one runs.
            raise self._stop_after_interrupt(interrupted) from interrupted

    @contextlib.contextmanager
    def _first_nodes(self, count: int) -> Iterator[None]:
        """This Cluster on a copy of its inventory that holds its first `count` nodes in node
        rank order (scaling.first_nodes), so that cancel() and current_run_id reach the run."""
        with first_nodes(self.inventory, count) as (inventory, _):
            self.inventory, every_node = inventory, self.inventory
            try:
                yield
            finally:
                self.inventory = every_node

    def plan(
        self,
        model: str | None = None,
        dataset: str | None = None,
        *,
        resume: bool = False,
        run_id: str | None = None,
        nodes: int | None = None,
        on_event: EventCallback | None = None,
        **overrides: object,
    ) -> RunResult:
        """What train() with these arguments would run, planned without training: train.yml in
        check mode (`ansible-playbook train.yml --check`).

        The result's `plan` holds the plan's lines (the model and where it comes from, stage,
        batch, the runner-up and why it lost, the go/no-go, memory and disk); its `run_id` is
        None: nothing was started, no run directory claimed, no node written to (the nodes' GPU
        facts are read where none are cached). A request that train() would refuse raises the
        same error here (InvalidInput naming the problem).
        """
        if nodes is not None:  # train(nodes=N)'s plan
            with self._first_nodes(nodes):
                return self.plan(
                    model, dataset, resume=resume, run_id=run_id, on_event=on_event, **overrides
                )
        extravars = _train_vars(model, dataset, resume, run_id, overrides)
        result = self.run_playbook(PLAYBOOKS["train"], extravars, on_event=on_event, check=True)
        result.plan = tuple(
            str(line) for line in result.data.get("llama_plan", {}).get("lines", ())
        )
        return result

    def scaling(
        self,
        model: str,
        dataset: str | None = None,
        *,
        steps: int = DEFAULT_STEPS,
        on_event: EventCallback | None = None,
        on_progress: ProgressCallback | None = None,
        **overrides: object,
    ) -> Scaling:
        """Measure the run's scaling: `steps` optimizer steps of its plan on every node, then the
        same plan on the master alone; tokens/s of both (llama_runner/scaling.py).

        The go/no-go is lifted for the run on every node (allow_slow_scaling): measuring a
        cluster predicted to scale backwards is the point. Both runs are runs like any other:
        their output stays on the nodes (runs/<run id>/, the final model included) and their logs
        come back to runs/<run id>/ here. `overrides` are train()'s.
        """
        if steps < 2:
            raise InvalidInput(
                f"steps must be at least 2 (the speed is taken after the first), not {steps}"
            )
        following = sorted({"detach", "resume", "run_id"} & set(overrides))
        if following:
            raise InvalidInput(
                f"scaling starts two new runs and follows both to their end: it takes no "
                f"{', '.join(following)}"
            )
        asked = overrides.pop("train_args", None) or {}
        if not isinstance(asked, Mapping):
            raise InvalidInput(f"train_args must be a mapping, not {asked!r}")
        train_args = dict(asked)
        train_args |= MEASURE_ARGS | {"max_steps": steps}
        overrides.setdefault("allow_slow_scaling", True)
        with master_only(self.inventory) as (inventory, master):
            every = self.train(
                model,
                dataset,
                train_args=train_args,
                on_event=on_event,
                on_progress=on_progress,
                **overrides,
            )
            plan = every.summary or TrainSummary(run_id=every.run_id or "")
            stage, pins = pinned(plan)
            overrides.pop("deepspeed", None)
            # The one-node run is this Cluster's own run on the master-only inventory, so that
            # cancel(), current_run_id and one-run-at-a-time reach it like any other run.
            self.inventory, every_node = inventory, self.inventory
            try:
                one = self.train(
                    model,
                    dataset,
                    train_args=train_args | pins,
                    on_event=on_event,
                    on_progress=on_progress,
                    **({"deepspeed": stage} if stage else {}),
                    **overrides,
                )
            except InvalidInput as refused:  # the plan of every node refused on one (memory)
                raise InvalidInput(
                    f"the plan of the run on every node ({plan.run_id}: {stage}, micro-batch "
                    f"{plan.per_device_train_batch_size} x accumulation "
                    f"{plan.gradient_accumulation_steps}) cannot run on {master} alone, so its "
                    f"scaling cannot be measured against one node: {refused.message}",
                    host=refused.host,
                    task=refused.task,
                    result=refused.result,
                ) from refused
            finally:
                self.inventory = every_node
        return Scaling(
            one=Point(1, one.summary or TrainSummary(run_id=one.run_id or "")),
            every=Point(plan.nnodes or 0, plan),
        )

    def status(
        self, run_id: str | None = None, *, on_event: EventCallback | None = None
    ) -> RunResult:
        """Where a run (default: the latest) stands on every node (playbooks/status.yml): `job`
        is its JobStatus, as the protocol defines it (None when status.yml published none)."""
        result = self.run_playbook(PLAYBOOKS["status"], _with_run_id(run_id), on_event=on_event)
        published = result.data.get(STATUS_STAT)
        result.job = JobStatus.from_dict(published) if isinstance(published, Mapping) else None
        return result

    def attach(
        self,
        run_id: str | None = None,
        *,
        poll_s: float = ATTACH_POLL_S,
        on_event: EventCallback | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> RunResult:
        """Follow a run (default: the latest), e.g. one started with train(detach=True), to its end.

        Looks at it with status() every `poll_s` seconds, reporting its progress to
        `on_progress`, then brings its logs back (logs()) and returns that result with train()'s
        `summary` and last `progress`. Raises PlaybookFailed naming the node when the run failed;
        an interrupt stops the following, not the run (RunInterrupted with stopped=False).
        """
        on_progress = on_progress or self.on_progress
        progress: TrainProgress | None = None
        try:
            while True:
                job = self._job_status(run_id, on_event)
                run_id = job.job
                progress = TrainProgress.of_job(job)
                if on_progress:
                    on_progress(progress)
                if not job.phase.in_progress():
                    break
                self._pause(poll_s)
        except RunInterrupted as interrupted:
            raise RunInterrupted(
                f"stopped following run {run_id or '(the latest)'}; the run goes on",
                run_id=run_id or interrupted.run_id,
                result=interrupted.result,
            ) from interrupted
        result = self.logs(run_id, on_event=on_event)
        if result.summary is None and result.controller_dir:
            result.summary = summary_of_files(run_id, result.controller_dir)
        result.progress = progress
        result.job = job
        if job.phase is Phase.FAILED:
            node = job.node
            exit_status = f", exit status {job.exit_status}" if job.exit_status is not None else ""
            raise PlaybookFailed(
                f"run {run_id} failed on {node or 'a node'}{exit_status}; logs: "
                f"{result.controller_dir}",
                host=node,
                failed_hosts=(node,) if node else (),
                result=result,
            )
        return result

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
        on_progress: ProgressCallback | None = None,
        shield: bool = False,
        check: bool = False,
    ) -> RunResult:
        """Run one playbook (relative to the project, or absolute) and return its result.

        `inventory=False` runs it without -i (localhost-only playbooks). `shield` makes a
        KeyboardInterrupt leave the run alone (used for the stop that follows an interrupt).
        `check` runs it in check mode (--check).
        """
        playbook_path = self.project_dir / playbook
        if not playbook_path.is_file():
            raise InvalidInput(f"no playbook {playbook_path} in this checkout")
        if inventory and not self.inventory.is_file():
            hint = (
                " (start the lab: train_runner.py lab)"
                if self.inventory == DEFAULT_INVENTORY
                else ""
            )
            raise InvalidInput(f"inventory {self.inventory} does not exist{hint}")
        stale = self.private_data_dir / "env"
        if stale.exists():
            # ansible-runner would silently add env/extravars, env/envvars ... to every run.
            raise RunnerError(f"{stale} exists: remove it, train_runner passes everything per call")
        self.private_data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not self._busy.acquire(blocking=False):
            raise RunnerError("this Cluster is running a playbook already: one run at a time")
        try:
            collector = self._collector = EventCollector(
                on_event or self.on_event, on_progress or self.on_progress, self.cancel
            )
            return self._run(
                playbook_path, extravars or {}, inventory, collector, shield=shield, check=check
            )
        finally:
            self._busy.release()

    def _run(
        self,
        playbook: Path,
        extravars: Mapping[str, Any],
        inventory: bool,
        collector: EventCollector,
        *,
        shield: bool,
        check: bool = False,
    ) -> RunResult:
        verb = playbook.stem
        ident = f"{verb}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        self._cancel.clear()
        try:
            public, secret, secret_env = run_secrets(extravars, os.environ)
            # Every string marked unsafe (llama_runner/extravars.py): data, never a template.
            public_argument = extravars_argument(public)
            secrets = SecretsFile(self.private_data_dir, ident, secret)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc

        def handle(event: Event) -> bool:
            # Extra variables are read before the first play: the file is no longer needed.
            if event.get("event") == "playbook_on_start":
                secrets.discard()
            return collector(event)

        try:
            # init_runner, not run_async: the environment it recorded (and would pass on) is
            # cleaned of secrets before the run starts and writes artifacts/<ident>/command.
            runner = init_runner(
                private_data_dir=str(self.private_data_dir),
                project_dir=str(self.project_dir),
                playbook=str(playbook),
                inventory=str(self.inventory) if inventory else None,
                cmdline=" ".join(
                    filter(None, [secrets.argument, public_argument, "--check" if check else ""])
                )
                or None,
                envvars=self._envvars(),
                ident=ident,
                rotate_artifacts=self.keep_artifacts,
                suppress_env_files=True,
                # The project's jsonfile cache (ansible.cfg), shared with ansible-playbook runs,
                # rather than one per artifact directory that rotation deletes.
                fact_cache_type="ansible.cfg",
                quiet=self.quiet,
                verbosity=self.verbosity or None,
                event_handler=handle,
                cancel_callback=Canceller(self._cancel, collector),
            )
            for name in secret_env:
                runner.config.env.pop(name, None)
            thread = threading.Thread(target=runner.run, name=f"ansible-runner {ident}")
            thread.start()
            artifact_dir = Path(runner.config.artifact_dir)
            self._wait(thread, artifact_dir, shield=shield)
        finally:
            secrets.discard()

        data = collector.artifact_data
        summary = TrainSummary.from_dict(data["llama_run"]) if "llama_run" in data else None
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
            hosts=HostStats.from_runner(runner.stats),
            artifact_dir=artifact_dir,
            run_id=run_id,
            data=data,
            summary=summary,
            progress=collector.progress,
            controller_dir=self._controller_dir(run_id, summary),
            events=collector.events,
        )
        if collector.callback_error is not None:
            raise collector.callback_error
        if runner.status == "canceled" or (not result.ok and self._cancel.is_set()):
            result.status = "canceled"
            raise RunInterrupted(f"{verb} was interrupted", run_id=run_id, result=result)
        if not result.ok:
            error = error_from_events(collector.events, result.hosts)
            if error.host is None and error.task is None:
                error.message = f"{error.message}\n{_stdout_tail(result.stdout_path)}".strip()
            error.result = result
            raise error
        return result

    def _controller_dir(self, run_id: str | None, summary: TrainSummary | None) -> Path | None:
        """Where the run's files came back to on the controller, if anywhere."""
        if summary and summary.controller_dir:
            return summary.controller_dir
        candidate = self.project_dir / "runs" / run_id if run_id else None
        return candidate if candidate and candidate.is_dir() else None

    def _wait(self, thread: threading.Thread, artifact_dir: Path, *, shield: bool) -> None:
        # Ctrl-C is counted by a signal handler rather than raised as KeyboardInterrupt: raised
        # inside thread.is_alive() (or join()), it marks the live runner thread as finished on
        # Python 3.11, and the run's result would be read while ansible-playbook still runs.
        pressed: list[int] = []
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
        try:
            self._follow(thread, artifact_dir, pressed, shield=shield)
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _follow(
        self, thread: threading.Thread, artifact_dir: Path, pressed: list[int], *, shield: bool
    ) -> None:
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
            except KeyboardInterrupt:  # a handler of the caller's that raises it
                pressed.append(signal.SIGINT)
            while len(pressed) > interrupts:
                interrupts += 1
                if not shield or interrupts >= SHIELD_INTERRUPTS:
                    self.cancel()
                else:
                    log.warning(
                        "still stopping the run (press Ctrl-C %d more times to abandon the stop)",
                        SHIELD_INTERRUPTS - interrupts,
                    )

    def _pause(self, seconds: float) -> None:
        """Wait between two runs; cancel() or Ctrl-C ends the wait with RunInterrupted."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._cancel.is_set():
                raise RunInterrupted("interrupted between two runs")
            try:
                time.sleep(0.2)
            except KeyboardInterrupt:
                self.cancel()

    def _job_status(self, run_id: str | None, on_event: EventCallback | None) -> JobStatus:
        """Where `run_id` (default: the latest run) stands; RunnerError when status.yml says
        nothing about it."""
        job = self.status(run_id, on_event=on_event).job
        if job is None:
            raise RunnerError(f"status.yml reported no run {run_id or ''}".strip())
        return job

    def _stop_after_interrupt(self, interrupted: RunInterrupted) -> RunInterrupted:
        run_id, result = interrupted.run_id, interrupted.result
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
        # lines in the stdout artifact), from the project's collection as ansible.cfg names it.
        callback = self.project_dir / PROGRESS_CALLBACK_FILE
        if "ANSIBLE_STDOUT_CALLBACK" not in os.environ and callback.is_file():
            env["ANSIBLE_STDOUT_CALLBACK"] = PROGRESS_CALLBACK
            # Without ansible.cfg's timers (profile_tasks, timer): they print after the recap,
            # as events after playbook_on_stats and over the stdout tail an error quotes; every
            # task event has its own times. Naming the stdout callback alone enables no other.
            if "ANSIBLE_CALLBACKS_ENABLED" not in os.environ:
                env["ANSIBLE_CALLBACKS_ENABLED"] = PROGRESS_CALLBACK
        return env

    def _cfg_bool(self, section: str, key: str, default: bool = True) -> bool:
        cfg = configparser.ConfigParser(interpolation=None)
        cfg.read(self.project_dir / "ansible.cfg")
        try:
            return cfg.getboolean(section, key, fallback=default)
        except ValueError:
            return default


def _stdout_tail(path: Path, lines: int = 15) -> str:
    """The last non-empty lines of Ansible's output (for a failure no task event explains)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(line for line in text.splitlines()[-lines:] if line.strip())
