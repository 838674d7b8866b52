"""Rank 0's trainer log after restarts (module_utils/trainer_log.py): every reader uses the last
attempt's records, the measured speed, a tail read that follows no link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.trainer_log import (
    last_attempt,
    log_figures,
    parse_records,
    read_tail,
    tokens_per_second,
)
from ansible_collections.llama.cluster.plugins.modules.llama_job import trainer_log

# ---------------------------------------------------------------------------------------------
# The trainer log after restarts (issue 24).
# ---------------------------------------------------------------------------------------------


def _log(*steps: int, total: int = 10) -> list[dict]:
    return [{"current_steps": s, "total_steps": total, "loss": 10.0 - s / 10} for s in steps]


def _closing(step: int, total: int = 10) -> dict:
    """The record the Trainer writes once training ends: the last step again, no loss."""
    return {"current_steps": step, "total_steps": total, "elapsed_time": "0:01:05"}


def test_a_log_without_restart_is_its_own_last_attempt():
    records = [*_log(1, 2, 3, 4), _closing(4)]
    assert last_attempt(records) == records


def test_one_restart_keeps_the_records_from_the_checkpoint_on():
    # Checkpoint at 5, killed at 7; attempt 2 logs 6 to 10 again.
    records = [*_log(1, 2, 3, 4, 5, 6, 7), *_log(6, 7, 8, 9, 10), _closing(10)]
    kept = last_attempt(records)
    assert [r["current_steps"] for r in kept] == [6, 7, 8, 9, 10, 10]
    assert kept[0] is records[7]


def test_two_restarts_keep_only_the_last_attempt():
    records = [*_log(1, 2, 3, 4), *_log(3, 4, 5, 6, 7), *_log(5, 6, 7, 8)]
    assert [r["current_steps"] for r in last_attempt(records)] == [5, 6, 7, 8]


def test_records_without_a_step_do_not_hide_a_restart():
    records = [*_log(1, 2, 3), {"eval_loss": 1.0}, *_log(2, 3)]
    assert [r.get("current_steps") for r in last_attempt(records)] == [2, 3]
    assert last_attempt([]) == []


def test_figures_come_from_the_last_attempt_and_the_last_logged_loss():
    # 100 records for 90 steps: the GPU run of issue 24, checkpoint 80, killed at 90.
    first = _log(*range(1, 91), total=90)
    second = [
        {"current_steps": s, "total_steps": 90, "loss": 0.5, "elapsed_time": "0:00:30"}
        for s in range(81, 91)
    ]
    second[-1]["loss"] = 0.25
    records = [*first, *second, _closing(90, total=90)]
    assert len(records) == 101
    figures = log_figures(records)
    assert figures == {
        "last_step": 90,
        "total_steps": 90,
        "final_loss": 0.25,
        "elapsed": "0:01:05",
        "tokens_per_s": None,  # no total_tokens: include_num_input_tokens_seen was off
        "records": 11,
    }
    assert log_figures([])["last_step"] is None


def _timed(step: int, tokens: int, seconds: float) -> dict:
    """A record as LLaMA-Factory writes it with include_num_input_tokens_seen on."""
    return {
        "current_steps": step,
        "total_tokens": tokens,
        "throughput": round(tokens / seconds, 2),
        "elapsed_time": f"0:00:{int(seconds):02d}",
    }


def test_speed_is_taken_between_the_first_record_and_the_last():
    # Step 1 takes 9 s (start-up), then 1,000 tokens per 0.5 s: 2,000 tokens/s from step 1 on,
    # where the last record's throughput (since the start) says 640.
    records = [_timed(s, 1000 * s, 9.0 + 0.5 * (s - 1)) for s in range(1, 9)]
    assert records[-1]["throughput"] == 640.0
    assert tokens_per_second(records) == pytest.approx(2000.0, rel=1e-4)
    assert log_figures(records)["tokens_per_s"] == pytest.approx(2000.0, rel=1e-4)


def test_speed_of_one_record_is_its_throughput_and_none_without_tokens():
    assert tokens_per_second([_timed(1, 1000, 4.0)]) == pytest.approx(250.0)
    assert tokens_per_second(_log(1, 2, 3)) is None
    assert tokens_per_second([]) is None


def test_speed_after_a_restart_is_the_last_attempts():
    # Attempt 2 resumes at step 5 with the checkpoint's token count and its own clock.
    first = [_timed(s, 1000 * s, 1.0 * s) for s in range(1, 8)]
    second = [_timed(s, 1000 * s, 20.0 + 0.25 * (s - 5)) for s in range(5, 11)]
    assert log_figures([*first, *second])["tokens_per_s"] == pytest.approx(4000.0, rel=1e-3)


def test_a_partial_last_line_is_skipped():
    text = json.dumps({"current_steps": 1}) + "\n" + '{"current_steps": 2, "lo'
    assert parse_records(text) == [{"current_steps": 1}]


def test_the_tail_starts_at_a_whole_line_and_a_link_is_not_followed(tmp_path: Path):
    log = tmp_path / "trainer_log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in _log(*range(1, 200))))
    tail = parse_records(read_tail(str(log), limit=500))
    assert tail
    assert tail[-1]["current_steps"] == 199
    assert len(tail) < 199
    link = tmp_path / "link.jsonl"
    os.symlink(log, link)
    with pytest.raises(OSError, match="symbolic links"):
        read_tail(str(link))


def test_the_status_module_reports_the_last_attempt_of_the_masters_log(tmp_path: Path):
    log = tmp_path / "trainer_log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [*_log(1, 2, 3), *_log(2, 3, 4)]))
    figures = trainer_log(str(log))
    assert (figures["last_step"], figures["records"], figures["final_loss"]) == (4, 3, 9.6)
    assert trainer_log("") == {}
    assert trainer_log(str(tmp_path / "absent.jsonl")) == {}
