"""LLaMA-Factory's training, started the way `llamafactory-cli train` starts it, with the
trainer callback that tells llama-job (the node's supervisor) what it needs to know.

    <env>/bin/python llama_launcher.py RUN/train.yaml [key=value ...]

Without a rank's environment, this is LLaMA-Factory's own launcher (`llamafactory.launcher.
launch`): with FORCE_TORCHRUN it runs torchrun on NNODES, NODE_RANK, MASTER_ADDR, ... exactly as
`llamafactory-cli train` does, pointed at this file instead of its launcher.py. In each rank
torchrun starts, it is LLaMA-Factory's `run_exp` with one more callback (`run_exp(callbacks=)`,
its hook for extra Trainer callbacks). Training itself is LLaMA-Factory's, unchanged. A
callback is the sturdier way in: it needs no second copy of LLaMA-Factory's launch, and it
sees the Trainer's own events rather than guessing them from the files it writes.

What the callback does (the file names are llama_job/whole.py's and saves.py's):

- whole checkpoints: after every callback's on_save (so after every file of checkpoint-N is
  written: the Trainer's, DeepSpeed's shards of every rank, a processor LLaMA-Factory adds),
  every process waits for the others (a barrier), then each process that saves (a node's local
  rank 0 with save_on_each_node) fsyncs every file of the checkpoint and its directories and
  writes MARKER, listing each file with its size, synced too. The output directory declares
  this (MARKERS, before the first save) with the run's save_total_limit: llama-job rotates the
  checkpoints by it once the newer ones are whole, so the Trainer's own rotation, which deletes
  as soon as its save returns, is switched off.
- saves and evaluations are not stalls: rank 0 writes ACTIVITY in LLAMA_JOB_MARKS (the node's
  marks directory) when a save or an evaluation starts, as an evaluation goes (every few
  seconds) and when either ends.
- the end: every rank writes finished-rank<RANK>.json there when training ends, with its step,
  the last step and the checkpoint it saved last.

Stdlib at the top: the training stack is imported where it is used, so the tests read the
marker's writer without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

MARKERS = "llama_job_markers.json"
MARKER = "llama_job_saved.json"
ACTIVITY = "activity.json"
EVALUATION_EVERY_S = 5.0  # how often an evaluation rewrites ACTIVITY


def fsync(path: str) -> None:
    """Sync a file's or a directory's data and metadata to its disk."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, record: dict[str, Any]) -> None:
    """A JSON file written under a temporary name, synced, renamed, its directory synced."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(record, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync(os.path.dirname(path) or ".")


def sync_checkpoint(checkpoint: str) -> dict[str, int]:
    """Sync every file of a checkpoint (its own and those one directory down: DeepSpeed's
    global_stepN), then the directories; every file by its relative path, with its size."""
    files: dict[str, int] = {}
    folders = [checkpoint]
    for entry in sorted(os.scandir(checkpoint), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            folders.append(entry.path)
            for inner in sorted(os.scandir(entry.path), key=lambda e: e.name):
                if inner.is_file(follow_symlinks=False):
                    fsync(inner.path)
                    files[f"{entry.name}/{inner.name}"] = inner.stat(follow_symlinks=False).st_size
        elif entry.is_file(follow_symlinks=False) and entry.name != MARKER:
            fsync(entry.path)
            files[entry.name] = entry.stat(follow_symlinks=False).st_size
    for folder in reversed(folders):
        fsync(folder)
    return files


def mark_saved(checkpoint: str, step: int) -> None:
    """Sync the checkpoint and write its marker, synced: from here it counts."""
    files = sync_checkpoint(checkpoint)
    write_synced(os.path.join(checkpoint, MARKER), {"version": 1, "step": step, "files": files})


def declare(output_dir: str, save_total_limit: int | None) -> None:
    """The output directory's declaration: its checkpoints carry markers, rotated by llama-job."""
    os.makedirs(output_dir, exist_ok=True)
    record = {"version": 1, "marker": MARKER, "save_total_limit": save_total_limit}
    write_synced(os.path.join(output_dir, MARKERS), record)


def write_mark(name: str, record: dict[str, Any]) -> None:
    """A mark in LLAMA_JOB_MARKS (none without it: a run started by hand), replaced at once."""
    marks = os.environ.get("LLAMA_JOB_MARKS")
    if not marks:
        return
    with contextlib.suppress(OSError):  # a mark never stops training
        tmp = os.path.join(marks, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({**record, "at": time.time()}, handle)
        os.replace(tmp, os.path.join(marks, name))


class Marks:
    """What the callback writes, and when (the Trainer's events, without the training stack)."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.last_checkpoint: str | None = None
        self.evaluated = 0.0
        self.batches = 0

    def activity(self, what: str, step: int, **more: Any) -> None:  # noqa: ANN401
        """Rank 0's activity: saving, evaluating or training."""
        if self.rank == 0:
            write_mark(ACTIVITY, {"what": what, "step": step, **more})

    def train_begin(self, args: Any) -> None:  # noqa: ANN401 - transformers' TrainingArguments
        """Switch the Trainer's rotation off and declare the markers (processes that save)."""
        limit = args.save_total_limit
        args.save_total_limit = None
        if args.should_save:
            declare(args.output_dir, limit)

    def step_end(self, state: Any, control: Any) -> None:  # noqa: ANN401
        """A save or an evaluation is about to start (the flow callback has decided)."""
        if control.should_evaluate:
            self.activity("evaluating", state.global_step)
        elif control.should_save:
            self.activity("saving", state.global_step, checkpoint=f"checkpoint-{state.global_step}")

    def prediction_step(self, state: Any) -> None:  # noqa: ANN401
        """An evaluation goes on: said every EVALUATION_EVERY_S."""
        self.batches += 1
        if time.monotonic() - self.evaluated >= EVALUATION_EVERY_S:
            self.evaluated = time.monotonic()
            self.activity("evaluating", state.global_step, batches=self.batches)

    def evaluated_end(self, state: Any, control: Any) -> None:  # noqa: ANN401
        """An evaluation ended: a save may follow at once."""
        self.batches = 0
        step = state.global_step
        if control.should_save:
            self.activity("saving", step, checkpoint=f"checkpoint-{step}")
        else:
            self.activity("training", step)

    def saved(self, args: Any, state: Any) -> None:  # noqa: ANN401
        """Every callback's on_save has run: every rank's files are written once all are here."""
        barrier()
        name = f"checkpoint-{state.global_step}"
        if args.should_save:
            mark_saved(os.path.join(args.output_dir, name), state.global_step)
        barrier()
        self.last_checkpoint = name
        self.activity("training", state.global_step)

    def train_end(self, state: Any) -> None:  # noqa: ANN401
        """This rank reached the end of training."""
        record = {
            "rank": self.rank,
            "step": state.global_step,
            "max_steps": state.max_steps,
            "checkpoint": self.last_checkpoint,
        }
        write_mark(f"finished-rank{self.rank}.json", record)


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a run of one process)."""
    import torch.distributed as dist  # noqa: PLC0415 - the training stack, where it is used

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def make_callback(marks: Marks) -> Any:  # noqa: ANN401 - a transformers TrainerCallback
    """The Trainer callback over `marks`, and the on_save hook that runs after every other
    callback's (LLaMA-Factory adds one that writes into the checkpoint after ours)."""
    from transformers import TrainerCallback  # noqa: PLC0415
    from transformers.trainer_callback import CallbackHandler  # noqa: PLC0415

    handler_on_save = CallbackHandler.on_save

    def on_save(handler: Any, args: Any, state: Any, control: Any) -> Any:  # noqa: ANN401
        control = handler_on_save(handler, args, state, control)
        marks.saved(args, state)
        return control

    CallbackHandler.on_save = on_save

    class LlamaJobCallback(TrainerCallback):
        """llama-job's callback: marks, activity and the end of training."""

        def on_train_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
            marks.train_begin(args)

        def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
            marks.step_end(state, control)

        def on_prediction_step(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
            marks.prediction_step(state)

        def on_evaluate(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
            marks.evaluated_end(state, control)

        def on_train_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001, ANN003
            marks.train_end(state)

    return LlamaJobCallback()


def main() -> None:
    """A rank (torchrun's environment): LLaMA-Factory's run_exp with the callback. Otherwise:
    LLaMA-Factory's launcher, its torchrun pointed at this file."""
    if "LOCAL_RANK" in os.environ or not os.environ.get("FORCE_TORCHRUN"):
        from llamafactory.train.tuner import run_exp  # noqa: PLC0415

        run_exp(callbacks=[make_callback(Marks())])
        return
    from llamafactory import launcher  # noqa: PLC0415

    launcher.__file__ = os.path.abspath(__file__)  # what its torchrun starts in every rank
    sys.argv = [sys.argv[0], "train", *sys.argv[1:]]
    launcher.launch()


if __name__ == "__main__":
    main()
