"""torchrun entry point: LLaMA-Factory's own training run plus a measuring callback.

`llamafactory-cli train cfg.yaml` with FORCE_TORCHRUN=1 starts
`torchrun ... llamafactory/launcher.py cfg.yaml`, and launcher.py calls `run_exp()`. This file is
that launcher with one difference: it passes `BenchCallback` to `run_exp(callbacks=[...])`, the
documented hook for extra Trainer callbacks. The training itself (argument parsing, data pipeline,
model patches, Trainer) is LLaMA-Factory's, unchanged.

What the callback measures, per rank, written to ``$BENCH_OUT/rank<r>.json``:

- real tokens: a forward pre-hook on the model adds ``(input_ids != pad_token_id).sum()`` into a
  GPU counter (no host sync). Padding added by the collator and the filler of packed rows are
  pad tokens, so they are not counted; prompt and response tokens are.
- the time window: from the end of step ``BENCH_WARMUP_STEPS`` to the end of the last step, each
  boundary after ``torch.cuda.synchronize()``.
- peak memory: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the whole run.
- rank 0 also writes the Trainer's log history (loss per logging step).

With ``BENCH_SKIP_SAVE=1`` every rank leaves right after the last step (after a barrier), so the
final checkpoint that LLaMA-Factory would write is skipped: it is not part of the measurement.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback


def _sync() -> None:
    """Wait for queued GPU work (no-op on a CPU-only smoke test)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _cuda(fn_name: str) -> int:
    """Return a torch.cuda memory statistic, or 0 without a GPU."""
    return int(getattr(torch.cuda, fn_name)()) if torch.cuda.is_available() else 0


class BenchCallback(TrainerCallback):
    """Count real tokens and time the steps after warm-up; record peak memory."""

    def __init__(self, out_dir: Path, warmup_steps: int, skip_save: bool) -> None:
        """Set where to write and how many optimizer steps to leave out as warm-up."""
        self.out_dir = out_dir
        self.warmup_steps = warmup_steps
        self.skip_save = skip_save
        self.pad_id: int | None = None
        self.real = torch.zeros((), dtype=torch.int64)
        self.slots = torch.zeros((), dtype=torch.int64)
        self.t0: float | None = None
        self.real0 = 0
        self.slots0 = 0
        self.step_times: list[float] = []
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))

    def _count(self, _module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is None or self.pad_id is None:
            return
        self.real += (ids != self.pad_id).sum()
        self.slots += ids.numel()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Attach the token counter to the model."""
        model = kwargs["model"]
        tokenizer = kwargs.get("processing_class")
        self.pad_id = getattr(tokenizer, "pad_token_id", None)
        device = next(model.parameters()).device
        self.real = self.real.to(device)
        self.slots = self.slots.to(device)
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Open the timing window after the warm-up steps."""
        self.step_times.append(time.perf_counter())
        if state.global_step == self.warmup_steps:
            _sync()
            self.t0 = time.perf_counter()
            self.real0 = int(self.real.item())
            self.slots0 = int(self.slots.item())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:  # noqa: ANN401
        """Close the window, write this rank's numbers, and optionally leave before saving."""
        _sync()
        t1 = time.perf_counter()
        real, slots = int(self.real.item()), int(self.slots.item())
        steps = state.global_step
        result: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "steps": steps,
            "warmup_steps": self.warmup_steps,
            "window_steps": steps - self.warmup_steps if self.t0 is not None else 0,
            "window_s": t1 - self.t0 if self.t0 is not None else None,
            "window_real_tokens": real - self.real0,
            "window_slot_tokens": slots - self.slots0,
            "total_real_tokens": real,
            "total_slot_tokens": slots,
            "max_memory_allocated": _cuda("max_memory_allocated"),
            "max_memory_reserved": _cuda("max_memory_reserved"),
            "step_times": self.step_times,
        }
        if self.rank == 0:
            result["log_history"] = state.log_history
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(result))
        if self.skip_save:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def main() -> None:
    """Run LLaMA-Factory's training with the bench callback; the YAML path is argv[1]."""
    from llamafactory.train.tuner import run_exp  # noqa: PLC0415  (heavy; only in workers)

    out_dir = Path(os.environ.get("BENCH_OUT", "bench-out"))
    warmup = int(os.environ.get("BENCH_WARMUP_STEPS", "20"))
    skip_save = os.environ.get("BENCH_SKIP_SAVE", "0") == "1"
    run_exp(callbacks=[BenchCallback(out_dir, warmup, skip_save)])


if __name__ == "__main__":
    main()
