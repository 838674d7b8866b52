"""The command line: argparse for the commands, rich for the live view and the reports."""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import logging
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import (
    JobStatus,
    Phase,
)
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.logging import RichHandler
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from llama_runner.api import DEFAULT_INVENTORY, DEFAULT_PRIVATE_DATA_DIR, Cluster
from llama_runner.errors import (
    EXIT_OK,
    HostUnreachable,
    InvalidInput,
    PlaybookFailed,
    RunInterrupted,
    RunnerError,
    exit_code,
)
from llama_runner.events import failure_message
from llama_runner.results import Event, RunResult, TrainProgress, TrainSummary
from llama_runner.scaling import DEFAULT_STEPS, Scaling
from llama_runner.secrets import holds_secret

DESCRIPTION = "llama-cluster's playbooks as commands: a live view of each run, a report at its end."
EPILOG = "exit codes: 0 ok, 1 playbook failed, 2 bad input, 3 host unreachable, 130 interrupted"


# --------------------------------------------------------------------------------------------
# The live view
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
    """Shows a run on a rich console: plays, per-host task progress, the training bar."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.rows: dict[str, _HostRow] = {}
        self.play = ""
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

    def on_event(self, event: Event) -> None:
        """Cluster's on_event: a play line, the host table, failures as they happen."""
        with self.lock:
            self._update(event)

    def on_progress(self, progress: TrainProgress) -> None:
        """Cluster's on_progress: the training bar (a line per step when not on a terminal)."""
        with self.lock:
            self._show_progress(progress)

    def _update(self, event: Event) -> None:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host")
        res = data.get("res") or {}
        row = self.rows.setdefault(host, _HostRow()) if host else None
        if kind == "playbook_on_play_start" and data.get("play", "") != self.play:
            self.play = data.get("play", "")
            self.console.print(Text.assemble(("PLAY ", "bold blue"), self.play))
        elif row is None:
            return
        elif kind == "runner_on_start":
            row.task, row.state = data.get("task", ""), "running"
        elif kind == "runner_on_ok":
            row.ok += 1
            row.changed += bool(res.get("changed"))
            row.state = "changed" if res.get("changed") else "ok"
        elif kind == "runner_on_skipped":
            row.skipped += 1
            row.state = "skipped"
        elif kind == "runner_on_failed":
            ignored = data.get("ignore_errors")
            row.failed += not ignored
            row.state = "failed (ignored)" if ignored else "failed"
            if not ignored:
                line = f"{host} | {data.get('task')}: {failure_message(res)}"
                self.console.print(Text.assemble(("FAILED ", "bold red"), line))
        elif kind == "runner_on_unreachable":
            row.unreachable += 1
            row.state = "unreachable"
            line = f"{host}: {failure_message(res)}"
            self.console.print(Text.assemble(("UNREACHABLE ", "bold red"), line))

    def _show_progress(self, progress: TrainProgress) -> None:
        where = f"[{progress.host}] " if progress.host else ""
        self.note = f"{where}{progress.text}"
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
                self.console.print(f"{where}{progress.text}", markup=False)
            else:
                steps = f"{progress.step}/{progress.total_steps or '?'}"
                line = f"{where}step {steps}  loss {loss}  ETA {eta}"
                self.console.print(line, markup=False)

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


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------
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
        f"tokens/s        {_speed(summary)}",
        f"output dir      {summary.output_dir}",
        f"checkpoints     {', '.join(Path(c).name for c in summary.checkpoints) or '-'}",
        f"on controller   {summary.controller_dir or '-'}",
        f"loss plot       {summary.loss_plot or '-'}",
    ]
    return Panel("\n".join(lines), title="training summary", expand=False)


def _speed(summary: TrainSummary) -> str:
    measured = f"{summary.tokens_per_s:,.0f}" if summary.tokens_per_s else "-"
    if summary.predicted_tokens_per_s:
        return f"{measured} (predicted {summary.predicted_tokens_per_s:,.0f})"
    return measured


def _report_scaling(console: Console, scaling: Scaling, *, as_json: bool) -> None:
    console.print(Panel("\n".join(scaling.lines()), title="scaling, measured", expand=False))
    if as_json:
        document = dataclasses.asdict(scaling)
        document |= {"speedup": scaling.speedup, "efficiency": scaling.efficiency}
        print(json.dumps(document, default=_json_default, indent=2))


def _status_panel(job: JobStatus) -> Panel:
    progress, summary = job.progress, job.summary
    nodes = Counter(node.phase.value for node in job.nodes.values())
    loss = progress.get("loss", summary.final_loss if summary else None)
    lines = [
        f"phase        {job.phase.value}",
        f"step         {job.step if job.step is not None else '-'}/{job.total_steps or '?'}",
        f"loss         {loss if loss is not None else '-'}",
        f"ETA          {progress.get('remaining_time') or '-'}",
        f"nodes        {', '.join(f'{n} {phase}' for phase, n in nodes.items()) or '-'}",
    ]
    if job.node and job.phase is not Phase.SUCCEEDED:
        status = f" (exit status {job.exit_status})" if job.exit_status is not None else ""
        lines.append(f"failed node  {job.node}{status}")
    if summary is not None:
        after = f" ({', then '.join(summary.restarted_after)} failed)" if summary.restarts else ""
        lines += [
            f"final loss   {summary.final_loss if summary.final_loss is not None else '-'}",
            f"time         {_duration(summary.time_s)}",
            f"restarts     {summary.restarts} of {summary.max_restarts}{after}",
        ]
    resume = summary.resume if summary else None
    if resume is not None and resume.checkpoint:
        lines.append(f"resume from  {resume.checkpoint}: {resume.command}")
    elif resume is not None:
        lines.append(f"no resume    {resume.message}")
    return Panel("\n".join(lines), title=f"run {job.job}", expand=False)


def _json_default(value: object) -> object:
    return str(value) if isinstance(value, Path) else repr(value)


def _result_json(result: RunResult) -> str:
    document = dataclasses.asdict(result)
    document.pop("events")
    document["files"] = [str(p) for p in result.files]
    return json.dumps(document, default=_json_default, indent=2)


def _report_error(console: Console, exc: RunnerError) -> int:
    """Print what went wrong; return the exit code that says it."""
    code = exit_code(exc)
    if isinstance(exc, RunInterrupted):
        console.print(f"[bold yellow]INTERRUPTED[/] {exc.message}", soft_wrap=True)
        if exc.run_id and not exc.stopped:
            console.print(
                f"run {exc.run_id} may still be running: python train_runner.py status "
                f"--run-id {exc.run_id} / attach / stop --run-id {exc.run_id}",
                soft_wrap=True,
            )
        return code
    if isinstance(exc, PlaybookFailed) and exc.result is not None:
        console.print(_recap(exc.result))
    if isinstance(exc, InvalidInput):
        title = "invalid input"
    elif isinstance(exc, HostUnreachable):
        title = "host unreachable"
    else:
        title = "failed"
    console.print(Text(title.upper(), style="bold red"))
    console.print(str(exc), markup=False, highlight=False, soft_wrap=True)
    if exc.result is not None:
        console.print(f"Ansible's output: {exc.result.stdout_path}")
    return code


def _report_result(console: Console, result: RunResult, *, as_json: bool) -> None:
    console.print(_recap(result))
    if result.job is not None:
        console.print(_status_panel(result.job))
    if result.plan:
        text = Text("\n".join(result.plan))
        console.print(Panel(text, title="plan only (--check): nothing was changed", expand=False))
    if result.summary:
        console.print(_summary_panel(result.summary))
    elif result.run_id:
        console.print(f"run id: {result.run_id}")
    if result.files:
        console.print(f"on the controller: {result.controller_dir} ({len(result.files)} files)")
    if as_json:
        print(_result_json(result))


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------
def _parse_assignments(pairs: Iterable[str]) -> dict[str, Any]:
    """KEY=VALUE pairs (values are YAML: numbers, booleans, lists) and mappings as extra variables.

    A secret (a name or key that holds_secret recognises) is refused: this command's own argv is
    in every user's process list and in the shell's history.
    """
    values: dict[str, Any] = {}
    for pair in pairs:
        for key, value in _assignments(pair):
            _refuse_secret(key, value)
            values[key] = value
    return values


def _assignments(pair: str) -> list[tuple[str, Any]]:
    """One -e: KEY=VALUE, or a YAML/JSON mapping as ansible-playbook's -e '{"key": value}'."""
    if pair.lstrip().startswith("{"):
        try:
            loaded = yaml.safe_load(pair)
        except yaml.YAMLError as err:
            raise InvalidInput(
                f"-e {pair!r} is not a YAML or JSON mapping: {_yaml_problem(err)}"
            ) from None
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and k.isidentifier() for k in loaded
        ):
            raise InvalidInput(f"-e {pair!r}: expected a mapping of variable names to values")
        return list(loaded.items())
    key, sep, raw = pair.partition("=")
    if not sep or not key.isidentifier():
        raise InvalidInput(
            f"expected KEY=VALUE or a mapping such as '{{\"key\": 1}}', got {pair!r}"
        )
    try:
        return [(key, yaml.safe_load(raw) if raw else "")]
    except yaml.YAMLError as err:
        flow = raw.lstrip().startswith(("{", "["))
        why = "; YAML reads a value that starts with { or [ as a mapping or a list" if flow else ""
        raise InvalidInput(
            f"-e {key}=...: the value {raw!r} is not YAML ({_yaml_problem(err)}{why}); to "
            f"pass it as text, quote it: -e '{key}=\"...\"'"
        ) from None


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and at which column of the value."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem:
        mark = err.problem_mark
        return f"{err.problem} at column {mark.column + 1}" if mark else err.problem
    return str(err).splitlines()[0]


def _refuse_secret(key: str, value: object) -> None:
    """A secret on this command's own argv is refused, naming the ways that keep it off it."""
    if holds_secret(key, value):
        raise InvalidInput(
            f"-e {key}=... would put a secret on this command's own command line, which every "
            "user of this machine sees in the process list (and your shell keeps in its "
            f"history). Pass it another way: --secret {key} (asked without echo, or read from "
            f"stdin), --secrets-file FILE (YAML, {key}: ...), or the environment "
            "(HF_TOKEN, WANDB_API_KEY, LLAMA_SERVE_API_KEY: read by the project's defaults)."
        )


def _read_secrets(names: Iterable[str], files: Iterable[str]) -> dict[str, Any]:
    """Secret extra variables from files (YAML mappings) and from prompts (--secret NAME)."""
    values: dict[str, Any] = {}
    for name in files:
        path = Path(name)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidInput(f"--secrets-file {path}: cannot read it as YAML ({exc})") from exc
        if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
            raise InvalidInput(f"--secrets-file {path}: expected a YAML mapping, name: value")
        values.update(loaded)
    for name in names:
        if not name.isidentifier():
            raise InvalidInput(f"--secret expects a variable name, got {name!r}")
        # A terminal is asked without echo; a pipe (printf ... | train_runner.py) gives one line.
        if sys.stdin.isatty():
            values[name] = getpass.getpass(f"{name}: ")
        else:
            values[name] = sys.stdin.readline().rstrip("\n")
        if not values[name]:
            raise InvalidInput(f"--secret {name}: nothing was entered")
    return values


def build_parser() -> argparse.ArgumentParser:
    """The command line of train_runner.py."""
    parser = argparse.ArgumentParser(prog="llama-cluster", description=DESCRIPTION, epilog=EPILOG)
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
        "-e",
        "--set",
        dest="extravars",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra variable (repeatable; the value is YAML; or a mapping as ansible-playbook's "
        "-e '{\"train_args\": {...}}'; no secrets: see --secret)",
    )
    extra.add_argument(
        "--secret",
        dest="secrets",
        action="append",
        default=[],
        metavar="NAME",
        help="a secret extra variable (e.g. hf_token), asked without echo (or read from stdin)",
    )
    extra.add_argument(
        "--secrets-file", dest="secrets_files", action="append", default=[], metavar="FILE",
        help="secret extra variables from a YAML file (name: value), e.g. a 0600 file",
    )  # fmt: skip
    run_id = argparse.ArgumentParser(add_help=False)
    run_id.add_argument("--run-id", help="the run (default: the latest)")

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
    plan = sub.add_parser(
        "plan", parents=[extra], help="the plan of a run, without training (train.yml --check)"
    )
    plan.add_argument("--model", help="catalogue name, e.g. tiny, qwen-7b (not with --resume)")
    plan.add_argument("--dataset")
    plan.add_argument("--run-id", help="with --resume: the run to continue (default: latest)")
    plan.add_argument("--resume", action="store_true", help="the plan of a resumed run")
    for sub_parser in (train, plan):  # the go/no-go's way out: fewer nodes
        sub_parser.add_argument(
            "--nodes",
            type=int,
            help="train on the inventory's first N nodes in node rank order (a YAML inventory)",
        )
    scaling = sub.add_parser(
        "scaling", parents=[extra], help="train the plan on every node, then on one: tokens/s"
    )
    scaling.add_argument("--model", help="catalogue name, e.g. tiny, qwen-7b")
    scaling.add_argument("--dataset")
    scaling.add_argument(
        "--steps",
        type=int,
        help=f"steps of each run (default {DEFAULT_STEPS})",
    )
    sub.add_parser("status", parents=[run_id], help="where a run stands")
    sub.add_parser("attach", parents=[run_id], help="follow a (detached) run to its end")
    sub.add_parser("stop", parents=[run_id], help="stop a run on every node")
    sub.add_parser("logs", parents=[run_id], help="bring a run's logs to runs/<run id>/")
    sub.add_parser("export", parents=[run_id, extra], help="export a run's model")
    run = sub.add_parser("run", parents=[extra], help="any playbook, e.g. playbooks/wiring.yml")
    run.add_argument("playbook", help="path relative to the project, or absolute")
    return parser


# The variables a command also takes as a flag, and the type of each: `-e model=tiny` is
# `--model tiny` (the API takes them as named arguments, never twice).
FLAG_TYPES: Mapping[str, type] = {
    "model": str, "dataset": str, "run_id": str, "resume": bool, "detach": bool, "nodes": int,
    "steps": int,
}  # fmt: skip
TYPE_WORDS: Mapping[type, str] = {str: "text", bool: "true or false", int: "an integer"}


def merge_flags(args: argparse.Namespace, extravars: dict[str, Any]) -> None:
    """Move each -e that names one of the command's flags onto the flag: taken where the flag
    was not given, accepted where it says the same, InvalidInput where the two disagree or the
    value is not of the flag's type."""
    for name in [n for n in extravars if n in FLAG_TYPES and hasattr(args, n)]:
        value, flag = extravars.pop(name), "--" + name.replace("_", "-")
        kind = FLAG_TYPES[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidInput(f"-e {name}={value!r}: {flag} takes {TYPE_WORDS[kind]}")
        given = getattr(args, name)
        if given not in (None, False) and given != value:
            raise InvalidInput(
                f"-e {name}={value!r} and {flag} {given!r} disagree: give the value once"
            )
        setattr(args, name, value)


def _dispatch(cluster: Cluster, args: argparse.Namespace) -> RunResult | Scaling:
    extravars = _parse_assignments(getattr(args, "extravars", []))
    merge_flags(args, extravars)
    extravars |= _read_secrets(getattr(args, "secrets", []), getattr(args, "secrets_files", []))
    calls: Mapping[str, Callable[[], RunResult | Scaling]] = {
        "lab": lambda: cluster.lab(nodes=args.nodes, state=args.state),
        "provision": lambda: cluster.provision(**extravars),
        "check": lambda: cluster.check(**extravars),
        "train": lambda: cluster.train(
            args.model,
            args.dataset,
            resume=args.resume,
            detach=args.detach,
            run_id=args.run_id,
            nodes=args.nodes,
            **extravars,
        ),
        "plan": lambda: cluster.plan(
            args.model,
            args.dataset,
            resume=args.resume,
            run_id=args.run_id,
            nodes=args.nodes,
            **extravars,
        ),
        "scaling": lambda: cluster.scaling(
            args.model,
            args.dataset,
            steps=DEFAULT_STEPS if args.steps is None else args.steps,
            **extravars,
        ),
        "status": lambda: cluster.status(args.run_id),
        "attach": lambda: cluster.attach(args.run_id),
        "stop": lambda: cluster.stop(args.run_id),
        "logs": lambda: cluster.logs(args.run_id),
        "export": lambda: cluster.export(args.run_id, **extravars),
        "run": lambda: cluster.run_playbook(args.playbook, extravars),
    }
    return calls[args.command]()


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    console = Console(stderr=args.json)
    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    try:
        cluster = Cluster(
            args.inventory,
            private_data_dir=args.private_data_dir,
            verbosity=args.verbose,
            quiet=not args.raw,
        )
    except RunnerError as exc:
        return _report_error(console, exc)
    view = ConsoleView(console)
    if not args.raw:
        cluster.on_event = view.on_event
        cluster.on_progress = view.on_progress

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
    if isinstance(result, Scaling):
        _report_scaling(console, result, as_json=args.json)
    else:
        _report_result(console, result, as_json=args.json)
    return EXIT_OK
