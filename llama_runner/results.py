"""What a run produced: the dataclasses every Cluster method returns or fills in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils import trainer_log
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import JobStatus
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import RunReport

Event = dict[str, Any]


def as_number(value: object, kind: type[int] | type[float]) -> Any:  # noqa: ANN401 - int | float
    """`value` as an int or float, or None when it is missing or not a number."""
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


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


# How a finished training run went: train.yml's set_stats `llama_run`, read as it was written
# (TrainSummary.from_dict), as a job's status is (JobStatus.from_dict).
TrainSummary = RunReport


def summary_of_files(run_id: str, directory: Path) -> TrainSummary:
    """What the files a run brought back to the controller say (logs.yml's copies of rank 0's
    trainer_log.jsonl, all_results.json and training_loss.png): no world size, batch or
    checkpoints, which only train.yml's plan knows."""
    return TrainSummary(run_id=run_id, **trainer_log.brought_back(str(directory)))


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
