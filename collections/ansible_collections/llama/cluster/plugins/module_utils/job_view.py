"""The controller's view of a job across the cluster: one `JobStatus` from every node's
`llama_job status` result (the filter job_status). It runs on the controller only, so it is not
part of llama-job (the zipapp carries llama_job/ alone)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .llama_job.protocol import Failure, FailureKind, JobStatus, NodeStatus, Phase, RankStatus


def _mapping(value: object) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def answered(result: object) -> bool:
    """Whether a node's registered result is an answer (not unreachable, not failed)."""
    return isinstance(result, Mapping) and not (result.get("unreachable") or result.get("failed"))


def node_ranks(result: object) -> list[RankStatus]:
    """The rank statuses in one node's `llama_job status` result ([] when it did not answer)."""
    if not answered(result):
        return []
    assert isinstance(result, Mapping)
    return [RankStatus.from_dict(r) for r in result.get("ranks") or [] if isinstance(r, Mapping)]


def _views(
    results: Mapping[str, object],
) -> tuple[dict[str, NodeStatus], list[str], list[RankStatus]]:
    """Per node its view, the nodes that did not answer, and every rank reported."""
    nodes: dict[str, NodeStatus] = {}
    unreachable: list[str] = []
    views: list[RankStatus] = []
    for host, result in sorted(results.items()):
        ranks = node_ranks(result)
        if not ranks and not answered(result):
            unreachable.append(host)
            nodes[host] = NodeStatus(Phase.UNKNOWN, reachable=False, active=None)
        elif not ranks:
            nodes[host] = NodeStatus(Phase.ABSENT)
        for rank in ranks:
            views.append(rank)
            nodes[host] = NodeStatus.of(rank)
    return nodes, unreachable, views


def _lead(views: list[RankStatus], master: str) -> RankStatus | None:
    """The master's agent's view: on the master host first, else wherever one reports."""
    masters = [r for r in views if r.role == "master"]
    return next((r for r in masters if r.host == master), masters[0] if masters else None)


def _workers_verdict(
    views: list[RankStatus], unreachable: list[str], master: str
) -> tuple[Phase, Failure | None]:
    """Without the master's view: what the workers' own records say."""
    finals = [r for r in views if r.phase.is_terminal()]
    failed = [r for r in finals if r.phase is Phase.FAILED]
    source = failed[0] if failed else (finals[0] if finals else None)
    if source is not None:
        phase, reason = source.phase, source.reason
    else:
        phase, reason = (Phase.UNKNOWN if unreachable else Phase.ABSENT), None
    if reason is None and master in unreachable:
        reason = Failure(
            node=master, kind=FailureKind.VANISHED, message="the master did not answer"
        )
        phase = Phase.FAILED if phase in (Phase.UNKNOWN, Phase.ABSENT) else phase
    return phase, reason


def job_status(results: Mapping[str, object], master: str, job: str = "") -> JobStatus:
    """One job's status across the cluster from each node's `llama_job status` result.

    A node without a result mapping counts as unreachable. The master's agent coordinates
    the job, so its view wins; without it, the workers' own records say what they saw
    (typically that the master vanished).
    """
    nodes, unreachable, views = _views(results)
    lead = _lead(views, master)
    if lead is not None:
        phase, reason = lead.phase, lead.reason
    else:
        phase, reason = _workers_verdict(views, unreachable, master)
    lead_result = results.get(lead.host) if lead is not None else None
    return JobStatus(
        job=job or (lead.job if lead is not None else ""),
        phase=phase,
        reason=None if phase is Phase.SUCCEEDED else reason,
        unreachable=tuple(unreachable),
        active=tuple(sorted(h for h, n in nodes.items() if n.active)),
        nodes=nodes,
        attempt=lead.attempt if lead is not None else 1,
        max_restarts=lead.max_restarts if lead is not None else 0,
        restarts=lead.restarts if lead is not None else (),
        history=lead.history if lead is not None else (),
        progress=dict(lead.progress) if lead is not None else {},
        started=lead.started if lead is not None else None,
        ended=lead.ended if lead is not None else None,
        trainer_log=_mapping(lead_result.get("trainer_log"))
        if isinstance(lead_result, Mapping)
        else {},
        warnings=lead.warnings if lead is not None else (),
        left_out=lead.left_out if lead is not None else (),
    )
