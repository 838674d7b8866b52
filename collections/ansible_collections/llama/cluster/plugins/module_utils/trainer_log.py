"""Rank 0's trainer log (LLaMA-Factory's trainer_log.jsonl): its records and what they say.

After an automatic restart the log holds every attempt one after the other: attempt 2 starts
again at the step after its checkpoint, so the steps between that checkpoint and the failure
are there twice. Every reader that uses more than the last record reads `last_attempt`.

Standard library only: the controller's filters, the llama_job module on the nodes and
llama_runner (which loads this file from the checkout) all use it.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping, Sequence
from typing import Any

# The most of a trainer log read from its end: some thousands of records, far more than the
# figures below need (they come from the last attempt's last records).
TAIL_BYTES = 1024 * 1024


def parse_records(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines text; a partial or broken line, one nested too deep to
    parse, is skipped (the training code writes the log: whatever a line holds, never an
    error)."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _step(record: Mapping[str, Any]) -> int | None:
    value = record.get("current_steps")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def last_attempt(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records after the last place where current_steps goes back (all of them when it never
    does). The same step twice in a row is no restart: the Trainer's closing record repeats the
    last step."""
    start = 0
    previous: int | None = None
    for index, record in enumerate(records):
        step = _step(record)
        if step is None:
            continue
        if previous is not None and step < previous:
            start = index
        previous = step
    return list(records[start:])


def _finite(value: object) -> float | None:
    """A JSON number as a finite float (None for anything else: NaN, Infinity, 10**400)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _number(record: Mapping[str, Any], key: str) -> float | None:
    value = _finite(record.get(key))
    return value if value is not None and value > 0 else None


def tokens_per_second(records: Sequence[Mapping[str, Any]]) -> float | None:
    """The attempt's measured training speed, tokens per second over every rank, or None when
    its records count no tokens (include_num_input_tokens_seen off).

    LLaMA-Factory logs total_tokens (the Trainer's num_input_tokens_seen, summed over the ranks)
    and throughput (total_tokens over the seconds since training began) with every record, so
    each record's time is total_tokens / throughput, to the millisecond where elapsed_time has
    whole seconds. The speed is taken between the first record and the last: the first step's
    start-up (workers, allocator, compilation) stays out of it. One record gives its own
    throughput, start-up included."""
    counted = ((_number(r, "total_tokens"), _number(r, "throughput")) for r in records)
    timed = [
        (tokens, tokens / rate)
        for tokens, rate in counted
        if tokens is not None and rate is not None
    ]
    if not timed:
        return None
    (first_tokens, first_s), (last_tokens, last_s) = timed[0], timed[-1]
    if last_s > first_s and last_tokens > first_tokens:
        return (last_tokens - first_tokens) / (last_s - first_s)
    return last_tokens / last_s


def log_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the last attempt's records say: last_step, total_steps, final_loss (the last logged
    loss: the closing record has none), elapsed (the trainer's "H:MM:SS" since the attempt
    began), tokens_per_s (`tokens_per_second`) and records (how many the last attempt wrote)."""
    attempt = last_attempt(records)
    last = attempt[-1] if attempt else {}
    # The last logged loss; a NaN or Infinity there (a diverged run) is no figure.
    losses = [r["loss"] for r in attempt if isinstance(r.get("loss"), int | float)]
    total, elapsed = last.get("total_steps"), last.get("elapsed_time")
    return {
        "last_step": _step(last),
        "total_steps": total if _step({"current_steps": total}) is not None else None,
        "final_loss": _finite(losses[-1]) if losses else None,
        "elapsed": elapsed[:32] if isinstance(elapsed, str) else None,
        "tokens_per_s": tokens_per_second(attempt),
        "records": len(attempt),
    }


def read_tail(path: str, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a file as text, from its first whole line; the file is opened
    without following a link (the job's user writes it; root may read it). OSError when it
    cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        size = info.st_size
        handle.seek(max(0, size - limit))
        data = handle.read(limit)
    text = data.decode("utf-8", "replace")
    if size > limit:
        text = text.partition("\n")[2]
    return text
