"""A checkpoint counts only when whole (llama_job/whole.py), and a rotation deletes an older one
only once the newer ones count (llama_job/checkpoints.py: rotation). Checkpoints laid out as the
Trainer and DeepSpeed write them (torch's files are zip archives, as torch.save writes them;
safetensors files with their header), marked by the job's own callback code
(roles/run_config/files/llama_launcher.py), then damaged one kind of file at a time, as a crash
before the data reached the disk, or a disk that filled, leaves them."""

from __future__ import annotations

import json
import os
import runpy
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    checkpoints,
    whole,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.resume import resume_point

ROOT = Path(__file__).resolve().parents[3]
# The callback's own writers (stdlib at its top: the training stack is not needed here).
launcher = SimpleNamespace(**runpy.run_path(str(ROOT / "roles/run_config/files/llama_launcher.py")))


@pytest.fixture(autouse=True)
def _no_kept_verdicts() -> None:
    """Each test judges the files as they are now (a verdict is kept while a checkpoint's
    directory and trainer_state.json stay as they were: a damaged shard would not be seen)."""
    whole._verdicts.clear()


def _zip(path: Path, size: int) -> None:
    """A file as torch.save writes it: a zip archive (one entry of `size` bytes)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data/0", bytes(size))


def _safetensors(path: Path, size: int) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(size))


def _checkpoint(output: Path, step: int, *, deepspeed: bool = False, mark: bool = True) -> Path:
    """checkpoint-<step> of a node of two ranks (1 and 2), as the Trainer leaves it; with
    DeepSpeed's ZeRO-3 state, each rank's shards; marked as the job's callback marks it."""
    checkpoint = output / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    _safetensors(checkpoint / "model.safetensors", 4096)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_1.pth", "rng_state_2.pth"):
        _zip(checkpoint / name, 2048)
    _zip(checkpoint / "training_args.bin", 512)
    if deepspeed:
        state = checkpoint / f"global_step{step}"
        state.mkdir()
        for rank in (1, 2):
            _zip(state / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", 8192)
            _zip(state / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", 1024)
        (checkpoint / "latest").write_text(f"global_step{step}")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if mark:
        launcher.mark_saved(str(checkpoint), step)
    return checkpoint


def _output(tmp_path: Path, limit: int | None = 3) -> Path:
    output = tmp_path / "output"
    launcher.declare(str(output), limit)
    return output


def _cut(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        path = checkpoint / name
        os.truncate(path, path.stat().st_size // 2)

    return damage


def _empty(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        os.truncate(checkpoint / name, 0)

    return damage


def _gone(name: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        (checkpoint / name).unlink()

    return damage


OPTIM_1 = "global_step10/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
DAMAGES = {
    "optimizer cut": (_cut("optimizer.pt"), "optimizer.pt lacks its zip archive's end"),
    "optimizer empty": (_empty("optimizer.pt"), "optimizer.pt is empty (0 bytes"),
    "scheduler empty": (_empty("scheduler.pt"), "scheduler.pt is empty"),
    "rng state cut": (_cut("rng_state_2.pth"), "rng_state_2.pth lacks its zip archive's end"),
    "training args empty": (_empty("training_args.bin"), "training_args.bin is empty"),
    "weights cut": (_cut("model.safetensors"), "model.safetensors holds 2,"),
    "a rank's shard empty": (_empty(OPTIM_1), f"{OPTIM_1} is empty"),
    "a rank's shard cut": (_cut(OPTIM_1), f"{OPTIM_1} lacks its zip archive's end"),
    "a rank's model shard gone": (
        _gone("global_step10/zero_pp_rank_2_mp_rank_00_model_states.pt"),
        "global_step10 lacks a shard of rank 2",
    ),
    "a rank's shards gone": (
        lambda c: [p.unlink() for p in (c / "global_step10").glob("*rank_2_*")],
        "global_step10/bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt is missing (listed by",
    ),
    "no marker": (_gone(whole.MARKER), "no llama_job_saved.json (the save never finished"),
    "a file grown after the marker": (
        lambda c: (c / "trainer_state.json").write_text('{"global_step": 10, "more": 1}'),
        "trainer_state.json holds 30 bytes, not the 19 synced",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_a_checkpoint_with_any_file_cut_emptied_or_missing_does_not_count(
    tmp_path: Path, damage: str
) -> None:
    output = _output(tmp_path)
    checkpoint = _checkpoint(output, 10, deepspeed=True)
    assert whole.checkpoint_problem(str(checkpoint), marker=True) == ""
    harm, said = DAMAGES[damage]
    harm(checkpoint)
    whole._verdicts.clear()
    assert said in whole.checkpoint_problem(str(checkpoint), marker=True)


def test_a_node_continues_from_its_last_whole_checkpoint_not_from_one_whose_files_are_empty(
    tmp_path: Path,
) -> None:
    # What a node crash leaves when nothing was synced (issue 44): checkpoint-20's optimizer,
    # scheduler, RNG and DeepSpeed files all 0 bytes, its trainer_state.json and weights whole.
    # Its marker was never written (the callback writes it after syncing), and the files say so
    # too: checkpoint-10, whole, is where the run continues; 20 is set aside, with why.
    output = _output(tmp_path)
    _checkpoint(output, 10, deepspeed=True)
    latest = _checkpoint(output, 20, deepspeed=True, mark=False)
    for path in [*latest.glob("*.pt"), *latest.glob("*.pth"), *latest.glob("global_step20/*")]:
        os.truncate(path, 0)
    entries = checkpoints.listing(str(output))
    assert [e.get("problem", "") for e in entries if e["isdir"]] == [
        "",
        "optimizer.pt is empty (0 bytes: its data never reached the disk)",
    ]
    point = resume_point({"n1": entries}, "r", str(tmp_path), "T", sharded=True)
    assert (point["checkpoint"], point["set_aside"]) == ("checkpoint-10", {"n1": ["checkpoint-20"]})


def test_a_run_without_a_declaration_is_judged_without_markers(tmp_path: Path) -> None:
    # A run started before markers (or a job that is not a trainer's): its whole checkpoints
    # still count; one with an empty file still does not.
    output = tmp_path / "output"
    _checkpoint(output, 10, mark=False)
    _empty("optimizer.pt")(_checkpoint(output, 20, mark=False))
    problems = [e.get("problem", "") for e in checkpoints.listing(str(output)) if e["isdir"]]
    assert problems == ["", "optimizer.pt is empty (0 bytes: its data never reached the disk)"]


def test_rotation_never_deletes_the_last_whole_checkpoint(tmp_path: Path) -> None:
    # save_total_limit 1 on one node: checkpoint-30 is being written (no marker yet), so 20 is
    # the last whole one and stays; 10 goes. The Trainer's own rotation (switched off by the
    # job's callback) kept only the newest directory, whole or not.
    output = _output(tmp_path, limit=1)
    for step in (10, 20):
        _checkpoint(output, step)
    _checkpoint(output, 30, mark=False)
    assert checkpoints.rotation(str(output), nodes=1) == ["checkpoint-10"]
    assert checkpoints.rotate(str(output), nodes=1) == ["checkpoint-10"]
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-30"]
    launcher.mark_saved(str(output / "checkpoint-30"), 30)  # now 30 counts: 20 may go
    whole._verdicts.clear()
    assert checkpoints.rotate(str(output), nodes=1) == ["checkpoint-20"]


def test_rotation_keeps_two_on_several_nodes_and_deletes_nothing_without_a_limit(
    tmp_path: Path,
) -> None:
    # With 1 on several nodes, a node stopped during a save would share no checkpoint with the
    # others: two are kept. No save_total_limit: nothing is ever deleted.
    output = _output(tmp_path, limit=1)
    for step in (10, 20, 30):
        _checkpoint(output, step)
    assert checkpoints.rotation(str(output), nodes=2) == ["checkpoint-10"]
    unlimited = _output(tmp_path / "b", limit=None)
    for step in (10, 20, 30):
        _checkpoint(unlimited, step)
    assert checkpoints.rotation(str(unlimited), nodes=1) == []


def test_rotation_keeps_the_best_checkpoint(tmp_path: Path) -> None:
    output = _output(tmp_path, limit=1)
    for step in (10, 20, 30):
        _checkpoint(output, step)
    state = output / "checkpoint-30" / "trainer_state.json"
    state.write_text(json.dumps({"best_model_checkpoint": str(output / "checkpoint-10")}))
    launcher.mark_saved(str(output / "checkpoint-30"), 30)
    assert checkpoints.rotation(str(output), nodes=1) == ["checkpoint-20"]


def test_a_link_is_never_followed_nor_deleted(tmp_path: Path) -> None:
    output = _output(tmp_path, limit=1)
    elsewhere = _checkpoint(tmp_path / "elsewhere", 5)
    (output / "checkpoint-5").symlink_to(elsewhere)
    for step in (10, 20):
        _checkpoint(output, step)
    assert checkpoints.rotate(str(output), nodes=1) == ["checkpoint-10"]
    assert (elsewhere / whole.MARKER).exists()
