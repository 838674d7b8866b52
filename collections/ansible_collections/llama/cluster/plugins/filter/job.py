"""Jinja filters that turn what every node's llama-job said into one job status and its words.

The play only reports: each node's agent already decided (see roles/job_supervisor); these
filters pick the view that speaks for the job when some nodes could not be asked, and say it.
Every status here is llama-job's own type (module_utils/llama_job/protocol.py): the filters take
and return its JSON (`JobStatus.to_dict`), unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.job_view import job_status
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import (
    FailureKind,
    JobStatus,
    Phase,
    RankStatus,
    Restart,
    Resume,
    RunSummary,
    describe_exit,
    ranks_text,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.resume import resume_point
from ansible_collections.llama.cluster.plugins.module_utils.planner.plan import Plan, RunReport
from ansible_collections.llama.cluster.plugins.module_utils.trainer_log import brought_back


def job_status_of(
    hosts: list[str], hostvars: Mapping[str, Any], master: str, register: str, job: str = ""
) -> dict[str, Any]:
    """One job's status across the cluster (job_view.job_status) from each node's registered
    `llama_job status`: a node without the result (it left the play, did not answer, or was not
    asked: job_gone) counts as unreachable."""
    results = {}
    for host in hosts:
        found = hostvars[host].get(register) if host in hostvars else None
        asked = isinstance(found, Mapping) and not found.get("skipped")
        results[host] = found if asked else {"unreachable": True}
    return job_status(results, master, job).to_dict()


def job_gone(watched: object, master: str) -> list[str]:
    """The nodes that stopped answering, from the master's `llama_job wait` (its registered
    result): those its agent gave up (RankStatus.given_up), or the master itself when it could
    not be asked. Every later task of the play skips them, so that each is asked once."""
    if not isinstance(watched, Mapping) or watched.get("unreachable"):
        return [master]
    lead = watched.get("lead")
    return list(RankStatus.from_dict(lead).given_up()) if isinstance(lead, Mapping) else []


def _failure_head(status: JobStatus, where: str) -> str:
    """The message's first line: stopped, or failed with what it said and its exit status."""
    reason = status.reason
    said = reason.message if reason else "it failed"
    if reason is not None and reason.kind is FailureKind.STOPPED:
        return f"Job {status.job} was stopped ({said}, on {where})."
    code = reason.exit_status if reason else None
    words = describe_exit(code).split(" (")[0] if code is not None else ""
    tail = f", {words}" if words and words not in said else ""
    return f"Job {status.job} failed on {where}: {said}{tail}."


def _aftermath(status: JobStatus) -> list[str]:
    """The restarts, what still runs or was stopped, and the nodes that did not answer."""
    lines = []
    if status.restarts:
        lines.append(f"It was restarted {len(status.restarts)} time(s) of {status.max_restarts}.")
    stopped = [h for h, n in status.nodes.items() if n.reachable]
    if status.active:
        lines.append(f"Still running on {', '.join(status.active)}: stop it (playbooks/stop.yml).")
    elif stopped:
        lines.append(f"Every rank was stopped on {', '.join(stopped)}.")
    vanished = status.reason is not None and status.reason.kind is FailureKind.VANISHED
    away = [h for h in status.unreachable if h != status.node or not vanished]
    if away:
        lines.append(
            f"{', '.join(status.unreachable)} did not answer: its agent ends its ranks on "
            "its own once it notices the master is gone."
        )
    elif status.unreachable:
        lines.append(f"{status.node} did not answer.")
    return lines


def job_failure_message(data: Mapping[str, Any], ranks: Mapping[str, int]) -> str:
    """The play's failure message: the node, its exit status and its first error lines."""
    status = JobStatus.from_dict(data)
    node = status.node or "an unknown node"
    rank = ranks.get(node, status.reason.rank if status.reason else None)
    processes = status.nodes[node].ranks if node in status.nodes else ()
    where = node_words(node, rank, processes)
    lines = [_failure_head(status, where), *_aftermath(status)]
    errors = list(status.reason.errors) if status.reason else []
    if errors:
        lines.append(f"First error lines on {node}:")
        lines.extend(f"  {line}" for line in errors[:12])
    return "\n".join(lines)


def node_words(host: str, rank: int | None, processes: tuple[int, ...]) -> str:
    """'node2 (node rank 1, ranks 2-3)': a node, its rank, and the global ranks of its processes
    where the job says them; 'node2 (rank 1)' where it does not."""
    if rank is None:
        return host
    if not processes:
        return f"{host} (rank {rank})"
    return f"{host} (node rank {rank}, {ranks_text(processes)})"


def job_found_files(
    hosts: list[str], hostvars: Mapping[str, Any], register: str
) -> dict[str, list[dict[str, Any]] | None]:
    """Per node, the entries a registered llama_checkpoints (or `find`) returned; None where the
    node did not answer."""
    found: dict[str, list[dict[str, Any]] | None] = {}
    for host in hosts:
        result = hostvars[host].get(register) if host in hostvars else None
        if not isinstance(result, Mapping) or any(
            result.get(k) for k in ("unreachable", "failed", "skipped")
        ):
            found[host] = None
        else:
            found[host] = [dict(f) for f in result.get("files") or [] if isinstance(f, Mapping)]
    return found


def resume_command(run_id: str) -> str:
    """The command that continues a run from its checkpoint."""
    return f"ansible-playbook train.yml -e resume=true -e run_id={run_id}"


def _moment(value: object) -> datetime | None:
    try:
        return datetime.strptime(str(value), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return None


def _run_time(status: JobStatus, log: Mapping[str, Any]) -> tuple[float | None, str]:
    """The run's time in seconds and where it comes from: llama-job's start and end of the job
    (every attempt), else the trainer's elapsed time (its last attempt only)."""
    started, ended = _moment(status.started), _moment(status.ended)
    if started and ended and ended >= started:
        return (ended - started).total_seconds(), "llama-job"
    elapsed = str(log.get("elapsed") or "")
    parts = elapsed.split(":")
    if len(parts) == 3 and all(p.strip().isdigit() for p in parts):
        hours, minutes, seconds = (int(p) for p in parts)
        return float(hours * 3600 + minutes * 60 + seconds), "trainer log"
    return None, ""


def resume_of(
    checkpoints: Mapping[str, Any] | None, run_id: str, run_dir: str, sharded: bool
) -> Resume:
    """The checkpoint a resume would continue from (the rule llama-job applies before a
    restart and a resumed run's first attempt: the latest complete checkpoint every node
    holds), the command, or why there is none."""
    found = dict(checkpoints or {})
    silent = sorted(host for host, entries in found.items() if entries is None)
    if not found or silent:
        return Resume(
            None,
            None,
            f"{', '.join(silent)} did not answer, so the checkpoint to continue from is "
            f"unknown. Bring it back (a run resumes on the same nodes), then: "
            f"{resume_command(run_id)}"
            if silent
            else "its checkpoints were not looked for",
        )
    point = resume_point(found, run_id, run_dir, "-", sharded)
    if not point["ok"]:
        return Resume(None, None, point["message"])
    command = resume_command(run_id)
    return Resume(point["checkpoint"], command, f"Continue from {point['checkpoint']}: {command}")


def job_resume(
    checkpoints: Mapping[str, Any] | None, run_id: str, run_dir: str, sharded: bool = False
) -> dict[str, Any]:
    """The checkpoint a resume of `run_id` would continue from, given what each node holds
    (job_found_files' shape): a Resume's JSON (checkpoint None: the message says why)."""
    return resume_of(checkpoints, run_id, run_dir, sharded).to_dict()


def job_run_summary(
    data: Mapping[str, Any],
    checkpoints: Mapping[str, Any] | None,
    run_dir: str = "",
    sharded: bool = False,
) -> dict[str, Any] | None:
    """What a user wants to know of an ended run (succeeded, failed or stopped), from its job
    status and, for a failed or stopped run, the checkpoints every node holds (job_found_files
    of llama_checkpoints in the output dir): a RunSummary's JSON.
    None for a run that has not ended."""
    status = JobStatus.from_dict(data)
    if not status.phase.is_terminal():
        return None
    log = status.trainer_log
    record = status.progress
    loss = log.get("final_loss")
    if loss is None and isinstance(record.get("loss"), int | float):
        loss = record["loss"]
    seconds, source = _run_time(status, log)
    summary = RunSummary(
        step=log.get("last_step", record.get("current_steps")),
        total_steps=log.get("total_steps") or record.get("total_steps"),
        final_loss=loss,
        time_s=seconds,
        time_from=source,
        restarts=len(status.restarts),
        max_restarts=status.max_restarts,
        restarted_after=tuple(str(r.after.node) for r in status.restarts if r.after),
        resume=(
            resume_of(checkpoints, status.job, run_dir, sharded)
            if status.phase.resumable()
            else None
        ),
    )
    return summary.to_dict()


def _summary_lines(summary: RunSummary) -> tuple[str, list[str]]:
    """The head's figures of an ended run, and the lines under it."""
    figures = []
    if summary.step is not None:
        figures.append(f"step {summary.step}/{summary.total_steps or '?'}")
    if summary.final_loss is not None:
        figures.append(f"final loss {summary.final_loss:.4f}")
    if summary.time_s is not None:
        figures.append(f"time {timedelta(seconds=int(summary.time_s))}")
    if summary.restarts:
        after = ", then ".join(summary.restarted_after)
        lines = [f"  Restarts: {summary.restarts} of {summary.max_restarts} ({after} failed)"]
    else:
        lines = [f"  Restarts: none ({summary.max_restarts} allowed)"]
    resume = summary.resume
    if resume is not None:
        lines.append(
            f"  {resume.message}" if resume.checkpoint else f"  No resume: {resume.message}"
        )
    return ", ".join(figures), lines


def _status_head(status: JobStatus, figures: str) -> str:
    """The first line of status.yml's report: the phase and what matters in it."""
    record, reason = status.progress, status.reason
    head = f"Run {status.job}: {status.phase.value}"
    if status.phase in (Phase.RUNNING, Phase.STARTING) and record:
        head += f", step {record.get('current_steps', '?')}/{record.get('total_steps', '?')}"
        if isinstance(record.get("loss"), int | float):
            head += f", loss {record['loss']:.4f}"
        if record.get("remaining_time"):
            head += f", ETA {record['remaining_time']}"
    elif status.phase is Phase.RESTARTING and reason is not None:
        head += (
            f" after {reason.node}: {reason.message} "
            f"(restart {len(status.restarts) + 1} of {status.max_restarts})"
        )
    elif status.phase.resumable() and reason is not None:
        code = reason.exit_status
        words = describe_exit(code).split(" (")[0] if code is not None else ""
        head += f" on {reason.node}: {reason.message}"
        if words and words not in reason.message:
            head += f" ({words})"
    elif status.phase is Phase.SUCCEEDED and figures:
        head += f", {figures}"
    return head


def _attempt_lines(status: JobStatus) -> list[str]:
    """Every attempt of a run of several (a restart's, or a resume's by hand): when it began,
    from which checkpoint, and when and why the one before it ended."""
    first = [] if status.history or not status.restarts else [Restart(1, status.started)]
    lines = []
    for item in [*status.history, *first, *status.restarts]:
        how = "resumed (-e resume=true)" if item.resumed else "restarted"
        if item.attempt == 1 and not item.resumed:
            lines.append(f"  attempt 1: started at {item.at or '?'}")
            continue
        after = item.after
        ended = (
            f", after attempt {item.attempt - 1} ended at {after.at or '?'} on {after.node}: "
            f"{after.message}"
            if after
            else ""
        )
        lines.append(
            f"  attempt {item.attempt}: {how} at {item.at or '?'} from "
            f"{item.checkpoint or 'the beginning'}{ended}"
        )
    return lines


def job_status_lines(data: Mapping[str, Any]) -> list[str]:
    """status.yml's report of one run; an ended run's figures come from its summary
    (job_run_summary)."""
    status = JobStatus.from_dict(data)
    figures, below = _summary_lines(status.summary) if status.summary else ("", [])
    head = _status_head(status, figures)
    if status.phase.resumable() and figures:
        below.insert(0, f"  Ended at {figures}")
    lines = [head, *below]
    for host, node in sorted(status.nodes.items()):
        said = node.phase.value if node.reachable else "did not answer"
        left = " (processes left)" if node.active and node.phase.is_terminal() else ""
        where = (
            node_words(host, node.rank, node.ranks)
            if node.ranks
            else host + (f" rank {node.rank}" if node.rank is not None else "")
        )
        lines.append(f"  {where}: {said}{left}")
    lines += _attempt_lines(status)
    if status.phase is Phase.FAILED and status.reason is not None:
        lines.extend(f"  | {line}" for line in status.reason.errors[:6])
    return lines


def ranks_line(status: JobStatus) -> str:
    """'node1: ranks 0-1 (node rank 0); node2: ranks 2-3 (node rank 1)': every node's processes
    by their global ranks, in node rank order ("" where the job does not name them)."""
    nodes = sorted(
        ((host, node) for host, node in status.nodes.items() if node.ranks),
        key=lambda item: (item[1].rank is None, item[1].rank or 0, item[0]),
    )
    return "; ".join(
        f"{host}: {ranks_text(node.ranks)}"
        + (f" (node rank {node.rank})" if node.rank is not None else "")
        for host, node in nodes
    )


def _checkpoint_step(path: str) -> tuple[int, str]:
    number = path.rsplit("-", 1)[-1]
    return (int(number) if number.isdigit() else -1, path)


def job_run_report(
    plan: Mapping[str, Any],
    data: Mapping[str, Any] | None,
    controller_dir: str,
    run_dir: str,
    *,
    checkpoints: Sequence[str] = (),
    master: str = "the master",
) -> dict[str, Any]:
    """How a finished run went (planner/plan.py's RunReport: the plan's choices, the job's ranks,
    what came back to controller_dir, the checkpoints on the master in step order) as `report`,
    and the lines the play prints as `lines`."""
    planned = Plan.from_dict(plan)
    status = JobStatus.from_dict(data or {"job": planned.run_id, "phase": "unknown"})
    report = RunReport.of(
        planned,
        ranks={host: node.ranks for host, node in status.nodes.items()},
        output_dir=f"{run_dir}/output",
        checkpoints=tuple(sorted(checkpoints, key=_checkpoint_step)),
        warnings=status.warnings,
        left_out=status.left_out,
        **brought_back(controller_dir),
    )
    failed = [restart.after.node if restart.after else "?" for restart in status.restarts]
    lines = report.lines(
        ranks_line(status),
        master,
        adapter=planned.model.get("finetuning_type") == "lora",
        failed=failed,
        allowed=status.max_restarts,
        without=f"min_nodes, from attempt {status.attempt}: {status.restarts[-1].note}"
        if status.restarts
        else "",
    )
    return {"report": report.to_dict(), "lines": lines}


# A line of a node's log that one of torchrun's local ranks printed: its prefix carries the
# global rank (roles/job sets TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank${rank}]:"); llama-job's
# own lines (attempts, restarts) belong to every rank of the node.
RANK_LINE = re.compile(r"^\[rank(\d+)\]:(.*)$")
AGENT_LINE = re.compile(r"^\[llama-job")


def job_rank_logs(text: str) -> dict[str, str]:
    """One node's log split into one log per rank: rank (as text) -> its lines, prefix removed,
    with the node's llama-job lines (attempt, restart, stop) in every rank's log where they fell.
    Lines of the launchers (torchrun's, LLaMA-Factory's launcher) stay in the node's log only."""
    ranks: dict[str, list[tuple[int, str]]] = {}
    agent: list[tuple[int, str]] = []  # (how many rank lines came before it, the line)
    count = 0
    for line in str(text or "").splitlines():
        found = RANK_LINE.match(line)
        if found:
            ranks.setdefault(found.group(1), []).append((count, found.group(2)))
            count += 1
        elif AGENT_LINE.match(line):
            agent.append((count, line))
    logs = {}
    for rank, lines in ranks.items():
        # Stable: an agent line before the rank line that came after it.
        merged = sorted([*agent, *lines], key=lambda item: item[0])
        logs[rank] = "\n".join(line for _, line in merged) + "\n"
    return logs


class FilterModule:
    """Job status filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "job_status": job_status_of,
            "job_gone": job_gone,
            "job_failure_message": job_failure_message,
            "job_found_files": job_found_files,
            "job_resume": job_resume,
            "job_run_summary": job_run_summary,
            "job_status_lines": job_status_lines,
            "job_run_report": job_run_report,
            "job_rank_logs": job_rank_logs,
        }
