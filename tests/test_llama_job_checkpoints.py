"""llama-job's checkpoints.py and master.py continue_run: one way to continue a run. Before an
automatic restart and before a resumed run's first attempt, the master applies the planner's
resume_point to what every node holds; every node sets newer checkpoints aside and continues
from that step. Real agent pairs (tests/llama_job_support.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    protocol,
)

from tests.llama_job_support import Pair

# One checkpoint rule for automatic restarts: before one, the master works out the latest step
# whose checkpoint is complete on every node (the planner's resume_point, the rule of
# `-e resume=true`), every node moves its newer checkpoints aside (never deleting one) and resumes
# from that step, passed to its command explicitly. Real agent pairs (tests/llama_job_support.py).

RESUME = "resume_from_checkpoint={checkpoint}"


def _checkpoints(tmp: Path, held: dict[str, dict[int, bool]]) -> dict[str, Path]:
    """Each node's output directory with checkpoint-N (complete: with trainer_state.json)."""
    out = {}
    for host, steps in held.items():
        out[host] = tmp / f"{host}-run" / "output"
        for step, complete in steps.items():
            directory = out[host] / f"checkpoint-{step}"
            directory.mkdir(parents=True)
            (directory / "weights").write_text(f"{host} {step}")
            if complete:
                (directory / "trainer_state.json").write_text("{}")
    return out


def _pair(tmp: Path, out: dict[str, Path]) -> Pair:
    extra = {h: {"checkpoints_dir": str(d), "resume_argument": RESUME} for h, d in out.items()}
    fail = {"FAIL_ONCE_AT": "3", "FAIL_ONCE_MARK": str(tmp / "failed-once")}
    return Pair(tmp, restarts=1, steps=8, worker_env=fail, spec_extra=extra)


# A resumed run (train.yml -e resume=true: the spec's `resume`) takes the restart's way in: the
# master gathers every node's checkpoints before its first attempt, applies the same rule
# (master.py continue_run), and every node sets the newer ones aside and resumes from that step.


def _resumed(tmp: Path, out: dict[str, Path]) -> Pair:
    extra = {
        h: {"checkpoints_dir": str(d), "resume_argument": RESUME, "resume": True}
        for h, d in out.items()
    }
    return Pair(tmp, steps=3, spec_extra=extra)


@pytest.mark.parametrize("resumed", [False, True], ids=["restart", "resume"])
def test_every_node_continues_from_the_latest_checkpoint_all_of_them_hold(
    tmp_path: Path, resumed: bool
):
    # node m holds 10, 20 and 30; node w 10 and 20, and a 30 cut off while being written. A
    # restart (after the worker's failure at step 3) and a resumed run pick the same checkpoint
    # and set the same ones aside: only the set-aside directory's name and the attempt differ.
    out = _checkpoints(
        tmp_path, {"m": {10: True, 20: True, 30: True}, "w": {10: True, 20: True, 30: False}}
    )
    pair = _resumed(tmp_path, out) if resumed else _pair(tmp_path, out)
    attempt, stamp = (1, r"resume-\d{8}-\d{6}") if resumed else (2, "restart-2")
    try:
        pair.wait_ended(timeout=90)
        master_state = pair.state("m")
        assert master_state["phase"] == "succeeded", pair.logs()
        assert master_state["attempt"] == attempt
        restarts = [r["checkpoint"] for r in master_state["restarts"]]
        assert restarts == ([] if resumed else ["checkpoint-20"])  # a resume is no restart
        for host, directory in out.items():
            log = (tmp_path / f"{host}.log").read_text()
            assert f"attempt {attempt} resumes from checkpoint-20" in log, log
            assert f"resume_from_checkpoint={directory}/checkpoint-20" in log, log
            assert sorted(p.name for p in directory.iterdir()) == ["checkpoint-10", "checkpoint-20"]
            (aside,) = (directory.parent / "set-aside").iterdir()
            assert re.fullmatch(stamp, aside.name)
            assert (aside / "checkpoint-30" / "weights").read_text() == f"{host} 30"  # not deleted
        assert "checkpoint-30 (not on every node) on m" in (tmp_path / "m.log").read_text()
    finally:
        pair.close()


@pytest.mark.parametrize("resumed", [False, True], ids=["restart", "resume"])
def test_without_a_checkpoint_on_every_node_the_run_fails_and_nothing_moves(
    tmp_path: Path, resumed: bool
):
    # The same rule and the same refusal for an automatic restart (after the worker's failure at
    # step 3) and for a resumed run (before its first attempt: no command runs anywhere).
    out = _checkpoints(tmp_path, {"m": {10: True}, "w": {20: True}})
    pair = _resumed(tmp_path, out) if resumed else _pair(tmp_path, out)
    try:
        pair.wait_ended(timeout=90)
        master_state = pair.state("m")
        assert master_state["phase"] == "failed", pair.logs()
        assert master_state["restarts"] == []
        reason = protocol.Failure.from_dict(master_state["reason"])
        assert reason is not None
        assert "Run t cannot resume: no checkpoint is on every node" in reason.message
        if resumed:
            assert reason.kind is protocol.FailureKind.START
            assert "attempt 1: starting" not in pair.logs()
        else:
            assert "no restart: Run t cannot resume" in reason.message
        assert [p.name for p in out["m"].iterdir()] == ["checkpoint-10"]
        assert [p.name for p in out["w"].iterdir()] == ["checkpoint-20"]
        assert pair.state("w")["phase"] == "failed"
    finally:
        pair.close()


# llama-job running a service: a job of one node (playbooks/serve.yml, playbooks/tensorboard.yml).
#
