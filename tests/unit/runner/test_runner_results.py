"""What the API reads back of a run (llama_runner/results.py): a failed run's status, the summary
from the files a run brought back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# train_runner.py and llama_runner/ sit at the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train_runner
from llama_runner.results import summary_of_files
from train_runner import (
    PROJECT_DIR,
    FailureKind,
    JobStatus,
    Phase,
)

TRAIN_PLAYBOOK = PROJECT_DIR / "train.yml"
needs_train = pytest.mark.skipif(
    not TRAIN_PLAYBOOK.is_file(), reason="train.yml is not in this checkout yet"
)


def test_a_failed_runs_status_says_where_it_ended_and_where_to_continue():
    published = {
        "job": "train-1-tiny",
        "phase": "failed",
        "reason": {"node": "node2", "kind": "exited", "exit_status": -9, "message": "killed"},
        "progress": {"current_steps": 29, "total_steps": 90},  # no loss: the closing record
        "nodes": {"node1": {"phase": "failed"}, "node2": {"phase": "failed"}},
        "summary": {
            "step": 29,
            "total_steps": 90,
            "final_loss": 1.25,
            "time_s": 760.0,
            "time_from": "llama-job",
            "restarts": 2,
            "max_restarts": 2,
            "restarted_after": ["node2", "node1"],
            "resume": {
                "checkpoint": "checkpoint-20",
                "command": "ansible-playbook train.yml -e resume=true -e run_id=train-1-tiny",
                "message": "Continue from checkpoint-20: ...",
            },
        },
    }
    job = JobStatus.from_dict(published)
    assert (job.phase, job.node, job.exit_status, job.step) == (Phase.FAILED, "node2", -9, 29)
    assert job.reason is not None
    assert job.reason.kind is FailureKind.EXITED
    assert job.summary is not None
    assert (job.summary.final_loss, job.summary.restarted_after) == (1.25, ("node2", "node1"))
    assert job.summary.resume is not None
    assert job.summary.resume.checkpoint == "checkpoint-20"
    progress = train_runner.TrainProgress.of_job(job)
    assert (progress.step, progress.total_steps, progress.text) == (29, 90, "failed step 29/90")
    assert not job.phase.in_progress()


def test_the_summary_from_the_controller_dir_reads_the_last_attempt(tmp_path: Path):
    # Killed at step 7 after checkpoint-5: attempt 2 logs 6 and 7 again, then 8, then closes.
    attempt1 = [{"current_steps": s, "total_steps": 8, "loss": 9.0} for s in range(1, 8)]
    attempt2 = [{"current_steps": s, "total_steps": 8, "loss": float(s)} for s in (6, 7, 8)]
    closing = {"current_steps": 8, "total_steps": 8}
    records = [*attempt1, *attempt2, closing]
    (tmp_path / "trainer_log.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in records))
    (tmp_path / "all_results.json").write_text('{"train_runtime": 12.5}')
    summary = summary_of_files("r", tmp_path)
    assert (summary.last_step, summary.final_loss, summary.runtime_s) == (8, 8.0, 12.5)
    empty = summary_of_files("r", tmp_path / "absent")
    assert (empty.last_step, empty.final_loss) == (None, None)
