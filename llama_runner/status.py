"""Where runs stand, from a status.yml run: the one module that knows what status.yml reports.

status.yml publishes (set_stats, key STATUS_STAT) one mapping per run:

    llama_status:
      runs:
        - {run_id: train-..., state: running, step: 30, total_steps: 100, loss: 1.2,
           eta_s: 95, failed_node: null, exit_status: null, nodes: {node1: running, ...},
           final_loss, time_s, restarts, max_restarts, restarted_after, resume_checkpoint,
           resume_command, resume_message}   # the last eight: an ended run's

with `state` one of results.RUN_STATES; a single run's mapping (without `runs`) is read as one
run, and roles/job's own shape of a run (`phase`, `progress`, `nodes`, and for an ended run
`summary`, the filter job_run_summary's: from_job_outcome) too.
FIELDS maps each RunStatus field to the key status.yml uses for it; the run's state is the
protocol's (llama_runner.collection.protocol: run_state of a job's phase).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from llama_runner.collection import protocol
from llama_runner.results import (
    Event,
    RunStatus,
    as_number,
    as_seconds,
)

STATUS_STAT = "llama_status"

# RunStatus field: status.yml's key for it.
FIELDS = {
    "run_id": "run_id",
    "state": "state",
    "step": "step",
    "total_steps": "total_steps",
    "loss": "loss",
    "eta_s": "eta_s",
    "failed_node": "failed_node",
    "exit_status": "exit_status",
    "nodes": "nodes",
    "final_loss": "final_loss",
    "time_s": "time_s",
    "restarts": "restarts",
    "max_restarts": "max_restarts",
    "restarted_after": "restarted_after",
    "resume_checkpoint": "resume_checkpoint",
    "resume_command": "resume_command",
    "resume_message": "resume_message",
}


def parse_status(data: Mapping[str, Any], events: Iterable[Event]) -> tuple[RunStatus, ...]:
    """The runs a status.yml run reported (its set_stats); none when it published none.

    `events` are the run's events, which status.yml's set_stats makes unneeded: it is kept for
    the callers' sake."""
    del events
    published = data.get(STATUS_STAT)
    return runs_from_stats(published) if published is not None else ()


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def from_job_outcome(item: Mapping[str, Any]) -> dict[str, Any]:
    """One run as FIELDS names it, from roles/job's status of a run (its `job_outcome` shape:
    phase, node, exit_status, progress as LLaMA-Factory's trainer log writes it, nodes, and for
    an ended run `summary`, as the filter job_run_summary works it out)."""
    progress = _mapping(item.get("progress"))
    nodes = _mapping(item.get("nodes"))
    reason = _mapping(item.get("reason"))
    summary = _mapping(item.get("summary"))
    resume = _mapping(summary.get("resume"))
    step = summary.get("step")
    loss = progress.get("loss")
    return {
        "run_id": item.get("run_id"),
        "state": protocol().run_state(item.get("phase")),
        "step": step if step is not None else progress.get("current_steps"),
        "total_steps": summary.get("total_steps") or progress.get("total_steps"),
        "loss": loss if loss is not None else summary.get("final_loss"),
        "eta_s": progress.get("remaining_time"),
        "failed_node": item.get("node") or reason.get("node"),
        "exit_status": item.get("exit_status"),
        "nodes": {
            host: (node.get("phase") if isinstance(node, Mapping) else node)
            for host, node in nodes.items()
        },
        "final_loss": summary.get("final_loss"),
        "time_s": summary.get("time_s"),
        "restarts": summary.get("restarts"),
        "max_restarts": summary.get("max_restarts"),
        "restarted_after": summary.get("restarted_after"),
        "resume_checkpoint": resume.get("checkpoint"),
        "resume_command": resume.get("command"),
        "resume_message": resume.get("message"),
    }


def _text(value: object) -> str | None:
    return str(value) if value else None


def runs_from_stats(published: object) -> tuple[RunStatus, ...]:
    """RunStatus for each run in status.yml's set_stats mapping (see the module's docstring)."""
    if isinstance(published, Mapping) and "runs" in published:
        published = published["runs"]
    items = [published] if isinstance(published, Mapping) else list(published or ())
    runs = []
    for item in items:
        if not isinstance(item, Mapping):
            continue
        own = "phase" in item and "state" not in item  # roles/job's own shape of a run
        fields = from_job_outcome(item) if own else item
        value = {name: fields.get(key) for name, key in FIELDS.items()}
        state = str(value["state"] or "")
        runs.append(
            RunStatus(
                run_id=str(value["run_id"] or ""),
                state=state if state in protocol().RUN_STATES else "stopped",
                step=as_number(value["step"], int),
                total_steps=as_number(value["total_steps"], int),
                loss=as_number(value["loss"], float),
                eta_s=as_seconds(value["eta_s"]),
                failed_node=str(value["failed_node"]) if value["failed_node"] else None,
                exit_status=as_number(value["exit_status"], int),
                nodes={str(h): str(s) for h, s in (value["nodes"] or {}).items()},
                final_loss=as_number(value["final_loss"], float),
                time_s=as_seconds(value["time_s"]),
                restarts=as_number(value["restarts"], int),
                max_restarts=as_number(value["max_restarts"], int),
                restarted_after=tuple(str(h) for h in value["restarted_after"] or () if h),
                resume_checkpoint=_text(value["resume_checkpoint"]),
                resume_command=_text(value["resume_command"]),
                resume_message=_text(value["resume_message"]),
            )
        )
    return tuple(runs)
