"""How a play reports a job from what each node's llama-job said (filter/job.py)."""

from __future__ import annotations

from ansible_collections.llama.cluster.plugins.filter.job import (
    job_failure_message,
    job_found_paths,
    job_outcome,
    job_resume_advice,
    job_status_lines,
)

REASON = {
    "node": "node2",
    "rank": 1,
    "kind": "exited",
    "exit_status": 1,
    "message": "its command ended, exit status 1",
    "errors": ["RuntimeError: Expected a string, got None"],
}


def _rank(host: str, role: str, phase: str, **extra: object) -> dict:
    return {
        "host": host,
        "rank": 0 if role == "master" else 1,
        "role": role,
        "phase": phase,
        "active": False,
        "unit": f"llama-r-rank{0 if role == 'master' else 1}",
        "log": f"/runs/r/logs/{host}.log",
        **extra,
    }


def _hostvars(**results: object) -> dict:
    return {host: {"__job_status": result} for host, result in results.items()}


def test_the_masters_verdict_speaks_for_the_job():
    hostvars = _hostvars(
        node1={"ranks": [_rank("node1", "master", "failed", reason=REASON, restarts=[])]},
        node2={"ranks": [_rank("node2", "worker", "failed", reason=REASON)]},
    )
    outcome = job_outcome(["node1", "node2"], hostvars, "node1", "__job_status")
    assert outcome["phase"] == "failed"
    assert (outcome["node"], outcome["exit_status"]) == ("node2", 1)
    assert outcome["unreachable"] == []
    message = job_failure_message(outcome, "r", {"node1": 0, "node2": 1})
    assert message.startswith("Job r failed on node2 (rank 1): its command ended, exit status 1.")
    assert "Every rank was stopped on node1, node2." in message
    assert "  RuntimeError: Expected a string, got None" in message


def test_a_dead_master_is_reported_from_the_workers_records():
    vanished = {
        **REASON,
        "node": "node1",
        "kind": "vanished",
        "exit_status": None,
        "message": "lost the master node1 (its runner has ended)",
        "errors": [],
    }
    hostvars = _hostvars(
        node1={"unreachable": True, "msg": "Failed to connect"},
        node2={"ranks": [_rank("node2", "worker", "failed", reason=vanished)]},
    )
    outcome = job_outcome(["node1", "node2"], hostvars, "node1", "__job_status")
    assert outcome["phase"] == "failed"
    assert outcome["node"] == "node1"
    assert outcome["unreachable"] == ["node1"]
    message = job_failure_message(outcome, "r", {"node1": 0, "node2": 1})
    assert "failed on node1 (rank 0): lost the master node1" in message
    assert "node1 did not answer." in message


def test_a_node_missing_from_the_play_counts_as_unreachable():
    hostvars = {"node1": {"__job_status": {"ranks": [_rank("node1", "master", "running")]}}}
    outcome = job_outcome(["node1", "node2"], hostvars, "node1", "__job_status")
    assert outcome["phase"] == "running"
    assert outcome["unreachable"] == ["node2"]


def test_resume_is_advised_only_when_every_node_that_needs_one_has_a_checkpoint():
    both = {"node1": ["/o/checkpoint-5", "/o/checkpoint-10"], "node2": ["/o/checkpoint-5"]}
    advice = job_resume_advice(both, ["node1", "node2"], "r")
    assert "continue from checkpoint-5 (on node1, node2)" in advice
    assert "-e resume=true -e run_id=r" in advice
    missing = {"node1": ["/o/checkpoint-5"], "node2": []}
    assert job_resume_advice(missing, ["node1", "node2"], "r").startswith(
        "No resume: node2 has no checkpoint"
    )
    shared = job_resume_advice(missing, ["node1"], "r")  # shared storage: the master's is enough
    assert "continue from checkpoint-5" in shared
    dead = job_resume_advice({"node1": ["/o/checkpoint-5"], "node2": None}, ["node1", "node2"], "r")
    assert dead.startswith("No resume yet: node2 did not answer")
    never = job_resume_advice(
        {"node1": [], "node2": []}, ["node1", "node2"], "r", {"reason": {"kind": "start"}}
    )
    assert "Fix what the message says" in never


def test_found_paths_say_none_for_a_node_that_did_not_answer():
    hostvars = {
        "node1": {"cp": {"files": [{"path": "/o/checkpoint-5"}]}},
        "node2": {"cp": {"unreachable": True}},
    }
    assert job_found_paths(["node1", "node2"], hostvars, "cp") == {
        "node1": ["/o/checkpoint-5"],
        "node2": None,
    }


def test_status_lines_say_step_loss_eta_and_restarts():
    restarts = [{"attempt": 2, "at": "2026-12-01T10:00:00Z", "after": REASON}]
    progress = {
        "current_steps": 12,
        "total_steps": 70,
        "loss": 1.23456,
        "remaining_time": "0:01:00",
    }
    hostvars = _hostvars(
        node1={
            "ranks": [
                _rank(
                    "node1",
                    "master",
                    "running",
                    progress=progress,
                    restarts=restarts,
                    max_restarts=2,
                    attempt=2,
                )
            ]
        },
        node2={"ranks": [_rank("node2", "worker", "running")]},
    )
    outcome = job_outcome(["node1", "node2"], hostvars, "node1", "__job_status")
    lines = job_status_lines(outcome, "r")
    assert lines[0] == "Run r: running, step 12/70, loss 1.2346, ETA 0:01:00"
    assert "  node2 rank 1: running" in lines
    assert any(
        line.startswith("  restart to attempt 2 at 2026-12-01T10:00:00Z, after node2")
        for line in lines
    )
