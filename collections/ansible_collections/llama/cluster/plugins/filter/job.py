"""Jinja filters that turn what every node's llama-job said into one verdict and one message.

The play only reports: each node's runner already decided (see roles/job_supervisor); these
filters pick the view that speaks for the job when some nodes could not be asked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.llama_job import protocol
from ansible_collections.llama.cluster.plugins.module_utils.planner.checkpoints import (
    resume_point,
)
from ansible_collections.llama.cluster.plugins.module_utils.trainer_log import (
    log_figures,
    parse_records,
)


def job_outcome(
    hosts: list[str], hostvars: Mapping[str, Any], master: str, register: str
) -> dict[str, Any]:
    """One job's state across the cluster from each node's registered `llama_job status`
    (protocol.job_outcome: a node without the result, which left the play or did not answer,
    counts as unreachable)."""
    results = {}
    for host in hosts:
        found = hostvars[host].get(register) if host in hostvars else None
        results[host] = found if isinstance(found, Mapping) else {"unreachable": True}
    return protocol.job_outcome(results, master)


def _exit_words(code: object) -> str:
    if not isinstance(code, int):
        return ""
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"


def _failure_head(reason: Mapping[str, Any], job: str, where: str) -> str:
    """The message's first line: stopped, or failed with what it said and its exit status."""
    words = _exit_words(reason.get("exit_status"))
    said = str(reason.get("message") or "it failed")
    if reason.get("kind") == "stopped":
        return f"Job {job} was stopped ({said}, on {where})."
    tail = f", {words}" if words and words not in said else ""
    return f"Job {job} failed on {where}: {said}{tail}."


def _aftermath(outcome: Mapping[str, Any], node: str, kind: object) -> list[str]:
    """The restarts, what still runs or was stopped, and the nodes that did not answer."""
    lines = []
    if outcome.get("restarts"):
        lines.append(
            f"It was restarted {len(outcome['restarts'])} time(s) of {outcome.get('max_restarts')}."
        )
    stopped = [h for h, n in (outcome.get("nodes") or {}).items() if n.get("reachable")]
    if outcome.get("active"):
        lines.append(
            f"Still running on {', '.join(outcome['active'])}: stop it (playbooks/stop.yml)."
        )
    elif stopped:
        lines.append(f"Every rank was stopped on {', '.join(stopped)}.")
    unreachable = list(outcome.get("unreachable") or [])
    away = [h for h in unreachable if h != node or kind != "vanished"]
    if away:
        lines.append(
            f"{', '.join(unreachable)} did not answer: its runner ends its ranks on "
            "its own once it notices the master is gone."
        )
    elif unreachable:
        lines.append(f"{node} did not answer.")
    return lines


def job_failure_message(outcome: Mapping[str, Any], job: str, ranks: Mapping[str, int]) -> str:
    """The play's failure message: the node, its exit status and its first error lines."""
    reason = outcome.get("reason") or {}
    node = reason.get("node") or "an unknown node"
    rank = ranks.get(node, reason.get("rank"))
    where = f"{node} (rank {rank})" if rank is not None else node
    lines = [_failure_head(reason, job, where), *_aftermath(outcome, node, reason.get("kind"))]
    errors = list(outcome.get("errors") or [])
    if errors:
        lines.append(f"First error lines on {node}:")
        lines.extend(f"  {line}" for line in errors[:12])
    return "\n".join(lines)


def job_found_paths(
    hosts: list[str], hostvars: Mapping[str, Any], register: str
) -> dict[str, list[str] | None]:
    """Per node, the paths a registered `find` returned; None where the node did not answer."""
    found: dict[str, list[str] | None] = {}
    for host in hosts:
        result = hostvars[host].get(register) if host in hostvars else None
        if not isinstance(result, Mapping) or result.get("unreachable") or result.get("failed"):
            found[host] = None
        else:
            found[host] = [str(f.get("path")) for f in result.get("files") or []]
    return found


def job_found_files(
    hosts: list[str], hostvars: Mapping[str, Any], register: str
) -> dict[str, list[dict[str, Any]] | None]:
    """Per node, the entries a registered `find` returned; None where the node did not answer."""
    found: dict[str, list[dict[str, Any]] | None] = {}
    for host in hosts:
        result = hostvars[host].get(register) if host in hostvars else None
        if not isinstance(result, Mapping) or result.get("unreachable") or result.get("failed"):
            found[host] = None
        else:
            found[host] = [dict(f) for f in result.get("files") or [] if isinstance(f, Mapping)]
    return found


def job_trainer_log(text: str) -> dict[str, Any]:
    """What a trainer_log.jsonl's text says, from its last attempt's records (log_figures)."""
    return log_figures(parse_records(str(text or "")))


def resume_command(run_id: str) -> str:
    """The command that continues a run from its checkpoint."""
    return f"ansible-playbook train.yml -e resume=true -e run_id={run_id}"


def _moment(value: object) -> datetime | None:
    try:
        return datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None


def _run_time(outcome: Mapping[str, Any], log: Mapping[str, Any]) -> tuple[float | None, str]:
    """The run's time in seconds and where it comes from: llama-job's start and end of the job
    (every attempt), else the trainer's elapsed time (its last attempt only)."""
    started, ended = _moment(outcome.get("started")), _moment(outcome.get("ended"))
    if started and ended and ended >= started:
        return (ended - started).total_seconds(), "llama-job"
    elapsed = str(log.get("elapsed") or "")
    parts = elapsed.split(":")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        hours, minutes, seconds = (int(p) for p in parts)
        return float(hours * 3600 + minutes * 60 + seconds), "trainer log"
    return None, ""


def _resume(
    checkpoints: Mapping[str, Any] | None, run_id: str, run_dir: str, sharded: bool
) -> dict[str, Any]:
    """The checkpoint a resume would continue from (the rule of -e resume=true: the latest
    complete checkpoint every node holds), the command, or why there is none."""
    found = dict(checkpoints or {})
    silent = sorted(host for host, entries in found.items() if entries is None)
    if not found or silent:
        return {
            "checkpoint": None,
            "command": None,
            "message": (
                f"{', '.join(silent)} did not answer, so the checkpoint to continue from is "
                f"unknown. Bring it back (a run resumes on the same nodes), then: "
                f"{resume_command(run_id)}"
                if silent
                else "its checkpoints were not looked for"
            ),
        }
    point = resume_point(found, run_id, run_dir, "-", sharded)
    if not point["ok"]:
        return {"checkpoint": None, "command": None, "message": point["message"]}
    return {
        "checkpoint": point["checkpoint"],
        "command": resume_command(run_id),
        "message": f"Continue from {point['checkpoint']}: {resume_command(run_id)}",
    }


def job_run_summary(
    outcome: Mapping[str, Any],
    checkpoints: Mapping[str, Any] | None,
    run_id: str,
    run_dir: str = "",
    sharded: bool = False,
) -> dict[str, Any]:
    """What a user wants to know of an ended run (succeeded, failed or stopped), from its
    `job_outcome` and, for a failed or stopped run, the checkpoints every node holds
    (job_found_files of a `find` for checkpoint-* and trainer_state.json in the output dir).

    Returns outcome, step, total_steps, final_loss (the last attempt's last logged loss), time_s
    and time_from (llama-job's start to end; the trainer log's elapsed where llama-job recorded
    no end), restarts, max_restarts, restarted_after (the node that failed before each restart),
    and resume: {checkpoint, command, message} for a failed or stopped run, else None. {} for a
    run that has not ended.
    """
    phase = outcome.get("phase")
    if not protocol.is_terminal(phase):
        return {}
    log = outcome.get("trainer_log") or {}
    record = outcome.get("progress") or {}
    loss = log.get("final_loss")
    if loss is None and isinstance(record.get("loss"), int | float):
        loss = record["loss"]
    seconds, source = _run_time(outcome, log)
    restarts = [r for r in outcome.get("restarts") or [] if isinstance(r, Mapping)]
    return {
        "outcome": phase,
        "step": log.get("last_step", record.get("current_steps")),
        "total_steps": log.get("total_steps") or record.get("total_steps"),
        "final_loss": loss,
        "time_s": seconds,
        "time_from": source,
        "restarts": len(restarts),
        "max_restarts": outcome.get("max_restarts", 0),
        "restarted_after": [(r.get("after") or {}).get("node") for r in restarts],
        "resume": None if phase == "succeeded" else _resume(checkpoints, run_id, run_dir, sharded),
    }


def _summary_lines(summary: Mapping[str, Any]) -> tuple[str, list[str]]:
    """The head's figures of an ended run, and the lines under it."""
    figures = []
    if summary.get("step") is not None:
        figures.append(f"step {summary['step']}/{summary.get('total_steps') or '?'}")
    if isinstance(summary.get("final_loss"), int | float):
        figures.append(f"final loss {summary['final_loss']:.4f}")
    if summary.get("time_s") is not None:
        figures.append(f"time {timedelta(seconds=int(summary['time_s']))}")
    count, allowed = summary.get("restarts") or 0, summary.get("max_restarts") or 0
    if count:
        after = ", then ".join(str(node) for node in summary.get("restarted_after") or [])
        lines = [f"  Restarts: {count} of {allowed} ({after} failed)"]
    else:
        lines = [f"  Restarts: none ({allowed} allowed)"]
    resume = summary.get("resume")
    if resume:
        lines.append(
            f"  {resume['message']}"
            if resume.get("checkpoint")
            else f"  No resume: {resume.get('message')}"
        )
    return ", ".join(figures), lines


def _steps(names: object) -> list[int]:
    found = []
    for name in names or []:
        match = re.search(r"checkpoint-(\d+)$", str(name).rstrip("/"))
        if match:
            found.append(int(match.group(1)))
    return sorted(found)


def job_resume_advice(
    checkpoints: Mapping[str, Any],
    needs: list[str],
    run_id: str,
    outcome: Mapping[str, Any] | None = None,
) -> str:
    """What to do after a failed run: resume only when every node that needs a checkpoint has one.

    `checkpoints` maps each node to the checkpoint directories found there (a list), or to
    None when the node could not be asked. `needs` are the nodes that must hold one: every
    node when each keeps its own (save_on_each_node), only the master on shared storage.
    """
    reason = (outcome or {}).get("reason") or {}
    never_trained = reason.get("kind") == "start"
    fix = "Fix what the message says, then " if never_trained else "Once the cause above is fixed, "
    resume = f"ansible-playbook train.yml -e resume=true -e run_id={run_id}"
    unknown = [h for h in needs if checkpoints.get(h) is None]
    empty = [h for h in needs if checkpoints.get(h) is not None and not _steps(checkpoints[h])]
    if unknown:
        return (
            f"No resume yet: {', '.join(unknown)} did not answer, so its checkpoints are unknown. "
            f"Bring it back (a run resumes on the same nodes), then: {resume}"
        )
    if empty:
        where = ", ".join(empty) + (" have" if len(empty) > 1 else " has")
        return (
            f"No resume: {where} no checkpoint of this run (one is written every save_steps "
            f"steps). {fix}start a new run (ansible-playbook train.yml -e model=... as before)."
        )
    common = set(_steps(checkpoints[needs[0]])) if needs else set()
    for host in needs[1:]:
        common &= set(_steps(checkpoints[host]))
    if not common:
        return (
            f"No resume: the nodes hold no checkpoint of the same step ({', '.join(needs)}). "
            f"{fix}start a new run."
        )
    return f"{fix}continue from checkpoint-{max(common)} (on {', '.join(needs)}): {resume}"


def _status_head(outcome: Mapping[str, Any], job: str, figures: str) -> str:
    """The first line of status.yml's report: the phase and what matters in it."""
    phase = outcome.get("phase", "unknown")
    record = outcome.get("progress") or {}
    reason = outcome.get("reason") or {}
    head = f"Run {job}: {phase}"
    if phase in ("running", "starting") and record:
        head += f", step {record.get('current_steps', '?')}/{record.get('total_steps', '?')}"
        if isinstance(record.get("loss"), int | float):
            head += f", loss {record['loss']:.4f}"
        if record.get("remaining_time"):
            head += f", ETA {record['remaining_time']}"
    elif phase == "restarting":
        head += (
            f" after {reason.get('node')}: {reason.get('message')} "
            f"(restart {len(outcome.get('restarts') or []) + 1} of {outcome.get('max_restarts')})"
        )
    elif phase in ("failed", "stopped") and reason:
        words = _exit_words(reason.get("exit_status"))
        head += f" on {reason.get('node')}: {reason.get('message')}"
        if words and words not in str(reason.get("message")):
            head += f" ({words})"
    elif phase == "succeeded" and figures:
        head += f", {figures}"
    return head


def job_status_lines(outcome: Mapping[str, Any], job: str) -> list[str]:
    """status.yml's report of one run; an ended run's figures come from outcome["summary"]
    (job_run_summary)."""
    phase = outcome.get("phase", "unknown")
    summary = outcome.get("summary") or {}
    figures, below = _summary_lines(summary) if summary else ("", [])
    head = _status_head(outcome, job, figures)
    if phase in ("failed", "stopped") and figures:
        below.insert(0, f"  Ended at {figures}")
    lines = [head, *below]
    for host, node in sorted((outcome.get("nodes") or {}).items()):
        state = node.get("phase") if node.get("reachable") else "did not answer"
        rank = f" rank {node['rank']}" if node.get("rank") is not None else ""
        lines.append(
            f"  {host}{rank}: {state}"
            + (" (processes left)" if node.get("active") and protocol.is_terminal(state) else "")
        )
    for item in outcome.get("restarts") or []:
        after = item.get("after") or {}
        lines.append(
            f"  restart to attempt {item.get('attempt')} at {item.get('at')}, after "
            f"{after.get('node')}: {after.get('message')}"
        )
    for line in (outcome.get("errors") or [])[:6] if phase == "failed" else []:
        lines.append(f"  | {line}")
    return lines


class FilterModule:
    """Job outcome filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "job_outcome": job_outcome,
            "job_failure_message": job_failure_message,
            "job_resume_advice": job_resume_advice,
            "job_found_paths": job_found_paths,
            "job_found_files": job_found_files,
            "job_trainer_log": job_trainer_log,
            "job_run_summary": job_run_summary,
            "job_status_lines": job_status_lines,
        }
