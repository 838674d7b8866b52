"""One checkpoint rule for automatic restarts: before one, the master works out the latest step
whose checkpoint is complete on every node (the planner's resume_point, the rule of
`-e resume=true`), every node moves its newer checkpoints aside (never deleting one) and resumes
from that step, passed to its command explicitly. Real runner pairs (tests/test_llama_job.py)."""

from __future__ import annotations

from pathlib import Path

from tests.test_llama_job import Pair

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


def test_every_node_resumes_from_the_latest_checkpoint_all_of_them_hold(tmp_path: Path):
    # node m holds 10, 20 and 30; node w 10 and 20, and a 30 cut off while being written.
    out = _checkpoints(
        tmp_path, {"m": {10: True, 20: True, 30: True}, "w": {10: True, 20: True, 30: False}}
    )
    pair = _pair(tmp_path, out)
    try:
        pair.wait_ended(timeout=90)
        master = pair.state("m")
        assert master["phase"] == "succeeded", pair.logs()
        assert [r["checkpoint"] for r in master["restarts"]] == ["checkpoint-20"]
        for host, directory in out.items():
            log = (tmp_path / f"{host}.log").read_text()
            assert f"{RESUME.split('{', maxsplit=1)[0]}{directory}/checkpoint-20" in log, log
            assert sorted(p.name for p in directory.iterdir()) == ["checkpoint-10", "checkpoint-20"]
            aside = directory.parent / "set-aside" / "restart-2" / "checkpoint-30"
            assert (aside / "weights").read_text() == f"{host} 30"  # moved, not deleted
        assert "checkpoint-30 (not on every node) on m" in (tmp_path / "m.log").read_text()
    finally:
        pair.close()


def test_without_a_checkpoint_on_every_node_the_restart_is_refused_and_nothing_moves(
    tmp_path: Path,
):
    out = _checkpoints(tmp_path, {"m": {10: True}, "w": {20: True}})
    pair = _pair(tmp_path, out)
    try:
        pair.wait_ended(timeout=90)
        master = pair.state("m")
        assert master["phase"] == "failed", pair.logs()
        assert master["restarts"] == []
        assert (
            "no restart: Run t cannot resume: no checkpoint is on every node"
            in (master["reason"]["message"])
        )
        assert [p.name for p in out["m"].iterdir()] == ["checkpoint-10"]
        assert [p.name for p in out["w"].iterdir()] == ["checkpoint-20"]
    finally:
        pair.close()
