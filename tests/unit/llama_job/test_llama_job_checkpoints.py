"""llama-job's checkpoints.py and master.py continue_run: one way to continue a run. Before an
automatic restart and before a resumed run's first attempt, the master applies the planner's
resume_point to what every node holds; every node sets newer checkpoints aside and continues
from that step. Real agent pairs (tests/support/llama_job_support.py)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter.job import job_status_lines
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    checkpoints,
    protocol,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.resume import (
    resume_point,
)

from tests.support.llama_job_support import Pair

# One checkpoint rule for automatic restarts: before one, the master works out the latest step
# whose checkpoint is complete on every node (the planner's resume_point, the rule of
# `-e resume=true`), every node moves its newer checkpoints aside (never deleting one) and resumes
# from that step, passed to its command explicitly. Real agent pairs
# (tests/support/llama_job_support.py).

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


# A checkpoint counts as complete only when its files parse and match their index: a full disk
# during a save leaves a trainer_state.json that is empty, which the rule once took as complete,
# so that every restart failed on it. Real files, as transformers writes them (safetensors: an
# 8-byte header length, a JSON header whose data_offsets end where the file ends).


def _safetensors(path: Path, sizes: dict[str, int]) -> None:
    """A safetensors file with tensors of those byte sizes (uint8, zeros)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, size in sizes.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


def _complete(directory: Path, step: int = 10) -> Path:
    """checkpoint-<step> as a two-shard save left it, complete."""
    checkpoint = directory / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    shards = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for shard, tensor in shards.items():
        _safetensors(checkpoint / shard, {tensor: 64})
    index = {"metadata": {"total_size": 128}, "weight_map": {t: s for s, t in shards.items()}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return checkpoint


def _cut_state(checkpoint: Path) -> None:
    (checkpoint / "trainer_state.json").write_text("")  # the full disk: opened, nothing written


def _half_state(checkpoint: Path) -> None:
    (checkpoint / "trainer_state.json").write_text('{"global_step": 10, "log_hist')


def _no_state(checkpoint: Path) -> None:
    (checkpoint / "trainer_state.json").unlink()


def _missing_shard(checkpoint: Path) -> None:
    (checkpoint / "model-00002-of-00002.safetensors").unlink()


def _short_shard(checkpoint: Path) -> None:
    shard = checkpoint / "model-00001-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 10)


def _cut_index(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-0')


def _linked_state(checkpoint: Path) -> None:
    elsewhere = checkpoint.parent / "elsewhere.json"
    elsewhere.write_text("{}")
    _no_state(checkpoint)
    (checkpoint / "trainer_state.json").symlink_to(elsewhere)


def _deepspeed_without_state(checkpoint: Path) -> None:
    (checkpoint / "latest").write_text("global_step10")


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_cut_state, "trainer_state.json is empty or does not parse (a save cut off, e.g. by a "),
        (_half_state, "trainer_state.json is empty or does not parse"),
        (_no_state, "no trainer_state.json (cut off while being written)"),
        (_missing_shard, "model.safetensors.index.json names model-00002-of-00002.safetensors, "),
        (_short_shard, "model-00001-of-00002.safetensors holds 158 of its 168 bytes (cut off)"),
        (_cut_index, "model.safetensors.index.json does not parse (cut off)"),
        (_linked_state, "no trainer_state.json"),
        (_deepspeed_without_state, "latest names global_step10, which is missing"),
    ],
)
def test_a_checkpoint_whose_files_do_not_parse_or_match_their_index_is_incomplete(
    tmp_path: Path, damage, said: str
):
    checkpoint = _complete(tmp_path / "output")
    assert checkpoints.checkpoint_problem(str(checkpoint)) == ""
    damage(checkpoint)
    os.utime(checkpoint, ns=(1, 1))  # a verdict is kept while the directory stays as it was
    assert said in checkpoints.checkpoint_problem(str(checkpoint))


def test_a_node_lists_an_incomplete_checkpoint_with_why_and_a_link_not_at_all(tmp_path: Path):
    out = tmp_path / "output"
    _complete(out, 10)
    _cut_state(_complete(out, 20))
    (out / "checkpoint-30").symlink_to(_complete(tmp_path / "elsewhere", 30))
    entries = checkpoints.listing(str(out))
    assert entries == [
        {"path": f"{out}/checkpoint-10", "isdir": True},
        {"path": f"{out}/checkpoint-10/trainer_state.json", "isdir": False},
        {
            "path": f"{out}/checkpoint-20",
            "isdir": True,
            "problem": "trainer_state.json is empty or does not parse (a save cut off, e.g. by a "
            "full disk)",
        },
    ]
    point = resume_point({"n1": entries}, "r", str(tmp_path), "T")
    assert (point["ok"], point["checkpoint"], point["set_aside"]) == (
        True,
        "checkpoint-10",
        {"n1": ["checkpoint-20"]},
    )
    assert "checkpoint-20 (trainer_state.json is empty or does not parse" in point["message"]


def test_with_no_complete_checkpoint_the_refusal_names_what_is_wrong_with_each(tmp_path: Path):
    out = tmp_path / "output"
    _missing_shard(_complete(out, 10))
    point = resume_point({"n1": checkpoints.listing(str(out))}, "r", str(tmp_path), "T")
    assert not point["ok"]
    assert (
        "checkpoint-10 on n1 is incomplete: model.safetensors.index.json names "
        "model-00002-of-00002.safetensors, which is missing" in point["message"]
    )


def test_a_restart_sets_a_half_written_checkpoint_aside_and_names_it(tmp_path: Path):
    # The worker's checkpoint-20 was cut off by a full disk (its trainer_state.json empty), the
    # master's lost a shard: both are set aside, each node's log saying why, and every node
    # continues from checkpoint-10, complete on both.
    out = {h: tmp_path / f"{h}-run" / "output" for h in ("m", "w")}
    for directory in out.values():
        _complete(directory, 10)
        _complete(directory, 20)
    _cut_state(out["w"] / "checkpoint-20")
    _missing_shard(out["m"] / "checkpoint-20")
    pair = _pair(tmp_path, out)
    try:
        pair.wait_ended(timeout=90)
        master_state = pair.state("m")
        assert master_state["phase"] == "succeeded", pair.logs()
        assert [r["checkpoint"] for r in master_state["restarts"]] == ["checkpoint-10"]
        logs = {h: (tmp_path / f"{h}.log").read_text() for h in out}
        assert "set aside checkpoint-20 (trainer_state.json is empty or does not parse" in logs["w"]
        assert (
            "set aside checkpoint-20 (model.safetensors.index.json names "
            "model-00002-of-00002.safetensors, which is missing)" in logs["m"]
        )
        for host, directory in out.items():
            assert f"resume_from_checkpoint={directory}/checkpoint-10" in logs[host]
            assert [p.name for p in directory.iterdir()] == ["checkpoint-10"]
    finally:
        pair.close()


# llama-job running a service: a job of one node (playbooks/serve.yml, playbooks/tensorboard.yml).
#


def test_a_resumed_run_shows_every_attempt_of_the_launches_before_it(tmp_path: Path):
    # Issue 48: status.yml of a resumed run said nothing of the failure and the resume before
    # it. Launch 1: the worker runs out of memory at step 3, is restarted once from
    # checkpoint-20 and fails again; launch 2 (-e resume=true) continues from checkpoint-20
    # and succeeds. Its state holds all three attempts, and status says when each began, from
    # which checkpoint and why the one before ended.
    out = _checkpoints(tmp_path, {"m": {10: True, 20: True}, "w": {10: True, 20: True}})
    extra = {h: {"checkpoints_dir": str(d), "resume_argument": RESUME} for h, d in out.items()}
    first = Pair(tmp_path, restarts=1, steps=8, worker_env={"OOM_AT": "3"}, spec_extra=extra)
    try:
        first.wait_ended(timeout=90)
        assert first.state("m")["phase"] == "failed", first.logs()
    finally:
        first.close()
    resumed = {h: {**e, "resume": True} for h, e in extra.items()}
    second = Pair(tmp_path, steps=3, spec_extra=resumed)
    try:
        second.wait_ended(timeout=90)
        state = second.state("m")
        assert state["phase"] == "succeeded", second.logs()
    finally:
        second.close()
    assert state["attempt"] == 3
    assert state["restarts"] == []  # this launch's own: a resume is no restart
    history = [protocol.Restart.from_dict(item) for item in state["history"]]
    assert [(r.attempt, r.checkpoint, r.resumed) for r in history] == [
        (1, None, False),
        (2, "checkpoint-20", False),
        (3, "checkpoint-20", True),
    ]
    assert [(r.after.node, r.after.attempt) for r in history[1:]] == [("w", 1), ("w", 2)]
    assert all("ran out of GPU memory" in r.after.message for r in history[1:])
    lines = job_status_lines({"job": "t", "phase": "succeeded", "history": state["history"]})
    assert lines[1] == f"  attempt 1: started at {history[0].at}"
    assert lines[2].startswith("  attempt 2: restarted at ")
    assert lines[3].startswith(f"  attempt 3: resumed (-e resume=true) at {history[2].at} from ")
    assert f"from checkpoint-20, after attempt 2 ended at {history[2].after.at} on w: " in lines[3]
