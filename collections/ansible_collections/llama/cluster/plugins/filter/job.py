"""Jinja filters that turn what every node's llama-job said into one verdict and one message.

The play only reports: each node's runner already decided (see roles/job_supervisor); these
filters pick the view that speaks for the job when some nodes could not be asked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

TERMINAL = ("succeeded", "failed", "stopped")


def _ranks(result: object) -> list[dict[str, Any]]:
    """The rank statuses in one node's `llama_job status` result ([] when it did not answer)."""
    if not isinstance(result, Mapping) or result.get("unreachable") or result.get("failed"):
        return []
    return [r for r in result.get("ranks") or [] if isinstance(r, Mapping)]


def job_outcome(
    hosts: list[str], hostvars: Mapping[str, Any], master: str, register: str
) -> dict[str, Any]:
    """One job's state across the cluster from each node's registered `llama_job status`.

    A node without the result (it left the play, or did not answer) counts as unreachable.
    The master's runner coordinates the job, so its view wins; without it, the workers' own
    records say what they saw (typically that the master vanished).
    """
    results = {}
    for host in hosts:
        found = hostvars[host].get(register) if host in hostvars else None
        results[host] = found if isinstance(found, Mapping) else {"unreachable": True}
    nodes: dict[str, dict[str, Any]] = {}
    unreachable = []
    views = []
    for host, result in sorted(results.items()):
        ranks = _ranks(result)
        if not ranks:
            if not isinstance(result, Mapping) or result.get("unreachable") or result.get("failed"):
                unreachable.append(host)
                nodes[host] = {"phase": "unknown", "active": None, "reachable": False}
            else:
                nodes[host] = {"phase": "absent", "active": False, "reachable": True}
            continue
        for rank in ranks:
            views.append((host, rank))
            nodes[host] = {
                "phase": rank.get("phase"),
                "active": bool(rank.get("active")),
                "reachable": True,
                "rank": rank.get("rank"),
                "unit": rank.get("unit"),
                "log": rank.get("log"),
                "exit_status": rank.get("exit_status"),
                "supervisor": rank.get("supervisor"),
            }
    lead = next((r for h, r in views if h == master and r.get("role") == "master"), None)
    if lead is None:
        lead = next((r for _, r in views if r.get("role") == "master"), None)
    if lead is not None:
        phase = lead.get("phase", "unknown")
        reason = lead.get("reason")
    else:
        finals = [r for _, r in views if r.get("phase") in TERMINAL]
        failed = [r for r in finals if r.get("phase") == "failed"]
        source = failed[0] if failed else (finals[0] if finals else None)
        phase = source.get("phase") if source else ("unknown" if unreachable else "absent")
        reason = source.get("reason") if source else None
        if reason is None and master in unreachable:
            reason = {
                "node": master,
                "kind": "vanished",
                "message": "the master did not answer",
                "exit_status": None,
                "errors": [],
            }
            phase = "failed" if phase in ("unknown", "absent") else phase
    if phase == "succeeded":
        reason = None
    still = sorted(h for h, n in nodes.items() if n.get("active"))
    return {
        "phase": phase,
        "reason": reason,
        "node": (reason or {}).get("node"),
        "exit_status": (reason or {}).get("exit_status"),
        "errors": list((reason or {}).get("errors") or []),
        "unreachable": unreachable,
        "active": still,
        "nodes": nodes,
        "attempt": (lead or {}).get("attempt", 1),
        "max_restarts": (lead or {}).get("max_restarts", 0),
        "restarts": list((lead or {}).get("restarts") or []),
        "progress": dict((lead or {}).get("progress") or {}),
    }


def _exit_words(code: object) -> str:
    if not isinstance(code, int):
        return ""
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"


def job_failure_message(outcome: Mapping[str, Any], job: str, ranks: Mapping[str, int]) -> str:
    """The play's failure message: the node, its exit status and its first error lines."""
    reason = outcome.get("reason") or {}
    node = reason.get("node") or "an unknown node"
    rank = ranks.get(node, reason.get("rank"))
    where = f"{node} (rank {rank})" if rank is not None else node
    words = _exit_words(reason.get("exit_status"))
    kind = reason.get("kind")
    said = str(reason.get("message") or "it failed")
    if kind == "stopped":
        head = f"Job {job} was stopped ({said}, on {where})."
    else:
        head = f"Job {job} failed on {where}: {said}"
        if words and words not in said:
            head += f", {words}"
        head += "."
    stopped = [h for h, n in (outcome.get("nodes") or {}).items() if n.get("reachable")]
    lines = [head]
    if outcome.get("restarts"):
        lines.append(
            f"It was restarted {len(outcome['restarts'])} time(s) of {outcome.get('max_restarts')}."
        )
    if outcome.get("active"):
        lines.append(
            f"Still running on {', '.join(outcome['active'])}: stop it (playbooks/stop.yml)."
        )
    elif stopped:
        lines.append(f"Every rank was stopped on {', '.join(stopped)}.")
    away = [h for h in outcome.get("unreachable") or [] if h != node or kind != "vanished"]
    if outcome.get("unreachable"):
        lines.append(
            f"{', '.join(outcome['unreachable'])} did not answer: its runner ends its ranks on "
            "its own once it notices the master is gone."
            if away
            else f"{node} did not answer."
        )
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


def job_status_lines(outcome: Mapping[str, Any], job: str) -> list[str]:
    """status.yml's report of one run."""
    phase = outcome.get("phase", "unknown")
    record = outcome.get("progress") or {}
    reason = outcome.get("reason") or {}
    restarts = outcome.get("restarts") or []
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
            f"(restart {len(restarts) + 1} of {outcome.get('max_restarts')})"
        )
    elif phase in ("failed", "stopped") and reason:
        words = _exit_words(reason.get("exit_status"))
        head += f" on {reason.get('node')}: {reason.get('message')}"
        if words and words not in str(reason.get("message")):
            head += f" ({words})"
    elif phase == "succeeded" and record:
        head += f", {record.get('current_steps', '?')} steps"
        if isinstance(record.get("loss"), int | float):
            head += f", last loss {record['loss']:.4f}"
    lines = [head]
    for host, node in sorted((outcome.get("nodes") or {}).items()):
        state = node.get("phase") if node.get("reachable") else "did not answer"
        rank = f" rank {node['rank']}" if node.get("rank") is not None else ""
        lines.append(
            f"  {host}{rank}: {state}"
            + (" (processes left)" if node.get("active") and state in TERMINAL else "")
        )
    for item in restarts:
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
            "job_status_lines": job_status_lines,
        }
