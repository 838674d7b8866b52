"""What a run produced: the dataclasses every Cluster method returns or fills in."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils import trainer_log
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import JobStatus

Event = dict[str, Any]


def as_number(value: object, kind: type[int] | type[float]) -> Any:  # noqa: ANN401 - int | float
    """`value` as an int or float, or None when it is missing or not a number."""
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def as_flag(value: object) -> bool | None:
    """A boolean from a bool or Ansible's rendering of one ("True", "false"), else None."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if value is not None else ""
    return {"true": True, "false": False}.get(text)


def as_seconds(value: object) -> float | None:
    """Seconds from a number or an "[D days, ]H:MM:SS" duration; None when it is neither."""
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str) or not value.strip():
        return None
    days = 0
    text = value.strip()
    if "day" in text:
        head, _, text = text.partition(",")
        days = as_number(head.split()[0], int) or 0
    try:
        parts = [float(p) for p in text.strip().split(":")]
    except ValueError:
        return None
    total = 0.0
    for part in parts:
        total = total * 60 + part
    return days * 86400 + total


def json_object(text: str) -> dict[str, Any]:
    """The JSON object in `text`, or {} when it holds none."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class HostStats:
    """What one host did in a run: ansible-runner's stats (ok includes changed)."""

    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    rescued: int = 0
    ignored: int = 0

    @classmethod
    def from_runner(cls, stats: Mapping[str, Mapping[str, int]] | None) -> dict[str, HostStats]:
        """Every host's counts from `Runner.stats` (empty when the run ended without stats)."""
        stats = stats or {}
        keys = {
            "ok": "ok",
            "changed": "changed",
            "failed": "failures",
            "unreachable": "dark",
            "skipped": "skipped",
            "rescued": "rescued",
            "ignored": "ignored",
        }
        hosts = sorted({host for counts in stats.values() for host in counts or {}})
        return {
            host: cls(
                **{name: int((stats.get(key) or {}).get(host, 0)) for name, key in keys.items()}
            )
            for host in hosts
        }


@dataclass(frozen=True)
class TrainProgress:
    """One progress report of a training job (rank 0's trainer log)."""

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
    def from_record(cls, host: str, text: str, record: Mapping[str, Any]) -> TrainProgress:
        """The progress in one record of rank 0's trainer log (LLaMA-Factory's names:
        current_steps, elapsed_time "H:MM:SS", throughput, ...)."""
        return cls(
            host=host,
            text=text,
            step=as_number(record.get("current_steps"), int),
            total_steps=as_number(record.get("total_steps"), int),
            loss=as_number(record.get("loss"), float),
            lr=as_number(record.get("lr"), float),
            epoch=as_number(record.get("epoch"), float),
            elapsed_s=as_seconds(record.get("elapsed_time")),
            remaining_s=as_seconds(record.get("remaining_time")),
            tokens_per_s=as_number(record.get("throughput"), float),
        )

    @classmethod
    def from_result(cls, host: str, res: Mapping[str, Any]) -> TrainProgress | None:
        """The progress in a `llama_job` status or wait result (its progress line and its
        leading rank's last trainer log record), or None when the result carries none."""
        lead = res.get("lead")
        if not isinstance(lead, Mapping) or not res.get("progress"):
            return None
        record = lead.get("progress")
        return cls.from_record(
            host, str(res["progress"]), record if isinstance(record, Mapping) else {}
        )

    @classmethod
    def of_job(cls, job: JobStatus, host: str = "") -> TrainProgress:
        """A job status's progress, in the shape train() reports it."""
        steps = f"step {job.step}/{job.total_steps or '?'}" if job.step is not None else ""
        progress = cls.from_record(host, f"{job.phase.value} {steps}".strip(), job.progress)
        return replace(progress, step=job.step, total_steps=job.total_steps)

    @property
    def fraction(self) -> float | None:
        """How much of the run is done, 0 to 1, when the trainer said."""
        if self.step is None or not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)


@dataclass(frozen=True)
class TrainSummary:
    """How a finished training run went: train.yml's set_stats `llama_run`."""

    run_id: str
    world_size: int | None = None
    # Every node's processes by their global ranks (torchrun's RANK): host -> ranks.
    ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    effective_batch_size: int | None = None
    runtime_s: float | None = None
    final_loss: float | None = None
    last_step: int | None = None
    output_dir: str | None = None
    checkpoints: tuple[str, ...] = ()
    controller_dir: Path | None = None
    loss_plot: Path | None = None
    tokens_per_s: float | None = None  # measured: the trainer log's tokens over its time
    predicted_tokens_per_s: float | None = None  # the planner's (GPU plans only)
    # The plan's choices (train.yml's plan), so that the same plan can run elsewhere.
    nnodes: int | None = None
    deepspeed: str | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_checkpointing: bool | None = None
    torch_compile: bool | None = None
    # What did not fail the run (a failure in teardown after every rank finished), and the
    # nodes its last attempt ran without (-e min_nodes).
    warnings: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    @classmethod
    def from_stats(cls, data: Mapping[str, Any]) -> TrainSummary:
        """The summary from the `llama_run` mapping of the stats event."""

        def path(value: object) -> Path | None:
            return Path(str(value)) if value else None

        return cls(
            run_id=str(data.get("run_id", "")),
            world_size=data.get("world_size"),
            ranks={
                str(host): tuple(int(r) for r in ranks or ())
                for host, ranks in (data.get("ranks") or {}).items()
            },
            effective_batch_size=data.get("effective_batch_size"),
            runtime_s=data.get("runtime_s"),
            final_loss=data.get("final_loss"),
            last_step=data.get("last_step"),
            output_dir=data.get("output_dir"),
            checkpoints=tuple(str(c) for c in data.get("checkpoints") or ()),
            controller_dir=path(data.get("controller_dir")),
            loss_plot=path(data.get("loss_plot")),
            tokens_per_s=as_number(data.get("tokens_per_s"), float),
            predicted_tokens_per_s=as_number(data.get("predicted_tokens_per_s"), float),
            nnodes=as_number(data.get("nnodes"), int),
            deepspeed=str(data["deepspeed"]) if data.get("deepspeed") else None,
            per_device_train_batch_size=as_number(data.get("per_device_train_batch_size"), int),
            gradient_accumulation_steps=as_number(data.get("gradient_accumulation_steps"), int),
            gradient_checkpointing=as_flag(data.get("gradient_checkpointing")),
            torch_compile=as_flag(data.get("torch_compile")),
            warnings=tuple(str(w) for w in data.get("warnings") or ()),
            left_out=tuple(str(h) for h in data.get("left_out") or ()),
        )

    @classmethod
    def from_controller_dir(cls, run_id: str, directory: Path) -> TrainSummary:
        """What the files a run brought back to the controller say (logs.yml's copies of rank
        0's trainer_log.jsonl, all_results.json and training_loss.png): no world size, batch or
        checkpoints, which only train.yml's plan knows."""
        log_file = directory / "trainer_log.jsonl"
        results_file = directory / "all_results.json"
        plot = directory / "training_loss.png"
        text = log_file.read_text(encoding="utf-8") if log_file.is_file() else ""
        # The last attempt's records: after a restart the steps since the checkpoint are twice.
        figures = trainer_log.log_figures(trainer_log.parse_records(text))
        results = (
            json_object(results_file.read_text(encoding="utf-8")) if results_file.is_file() else {}
        )
        return cls(
            run_id=run_id,
            runtime_s=as_number(results.get("train_runtime"), float),
            final_loss=as_number(figures["final_loss"], float),
            last_step=as_number(figures["last_step"], int),
            tokens_per_s=as_number(figures["tokens_per_s"], float),
            controller_dir=directory,
            loss_plot=plot if plot.is_file() else None,
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
    controller_dir: Path | None = None  # where the run's logs, plots and exports came back to
    job: JobStatus | None = None  # status(), attach(): where the run's job stands
    plan: tuple[str, ...] = ()  # plan(): the plan's lines (train.yml --check)
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
    def files(self) -> list[Path]:
        """The files in the controller directory of the run (logs, plots, exports)."""
        root = self.controller_dir
        return sorted(p for p in root.rglob("*") if p.is_file()) if root else []
