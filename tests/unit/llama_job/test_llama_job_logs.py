"""llama-job's logs.py: what a node's log and rank 0's trainer log say (the error lines, the exit
status a launcher reports, the stall rule, environment files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    logs,
    protocol,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import spec as job_spec


def test_a_stall_needs_the_floor_or_ten_median_steps():
    timeouts = {**job_spec.DEFAULT_TIMEOUTS, "stall_floor": 600, "stall_factor": 10}
    assert logs.stall_limit([], timeouts, seen_any=False) == timeouts["stall_startup"]
    assert logs.stall_limit([1.0, 2.0, 100.0], timeouts, seen_any=True) == 600
    assert logs.stall_limit([90.0, 100.0, 110.0], timeouts, seen_any=True) == 1000


def test_first_error_lines_skip_the_supervisor_and_warnings():
    text = "\n".join(
        [
            "[llama-job m 10:00:00Z] attempt 1: starting x",
            "loading model",
            "  warnings.warn('deprecated')",
            "RuntimeError: Expected a string, got None",
            "subprocess.CalledProcessError: returned non-zero exit status 1.",
        ]
    )
    assert logs.first_error_lines(text) == [
        "RuntimeError: Expected a string, got None",
        "subprocess.CalledProcessError: returned non-zero exit status 1.",
    ]
    assert logs.first_error_lines("a\nb") == ["a", "b"]


def test_the_exit_status_a_launcher_reports_is_read_from_its_output():
    # torchrun, once a rank was killed: its elastic agent's line, then ChildFailedError's summary.
    text = (
        "E1201 11:32:46 api.py:986] failed (exitcode: -9) local_rank: 0 (pid: 8393) of binary\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "  exitcode  : -9 (pid: 8393)\n"
    )
    assert logs.reported_exit_status(text) == -9
    assert protocol.describe_exit(logs.reported_exit_status(text)) == "killed by signal 9 (SIGKILL)"
    assert logs.reported_exit_status("exitcode : 0\nChildFailedError") is None
    assert logs.reported_exit_status("ChildFailedError: rank 1 died") is None


def test_environment_files_read_as_systemd_reads_them():
    env = logs.read_env_file('# comment\nA="1 2"\nB=plain\nC=""\n')
    assert env == {"A": "1 2", "B": "plain", "C": ""}
    assert logs.expand("--nnodes=${A}/${MISSING}", env) == "--nnodes=1 2/"


# A node's log is rotated (issue 40: node logs grew without bound outside the disk budget): its
# content moves to <log>.1, the older ones shift up to <log>.<keep>, the oldest goes, and the
# log is emptied in place, so the command and the agent keep writing through their descriptor.


def test_a_rotated_log_keeps_its_newest_files_and_the_writers_descriptor(tmp_path: Path):
    path = tmp_path / "node1.log"
    writer = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        for round_ in range(1, 5):
            os.write(writer, f"round {round_}\n".encode())
            assert logs.rotate_log(str(path), writer, keep=2)
        os.write(writer, b"after\n")  # the same descriptor, at the start of the emptied log
    finally:
        os.close(writer)
    assert path.read_text() == "after\n"
    assert (tmp_path / "node1.log.1").read_text() == "round 4\n"
    assert (tmp_path / "node1.log.2").read_text() == "round 3\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node1.log", "node1.log.1", "node1.log.2"]


def test_a_rotation_writes_nothing_through_a_link(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    path = logs_dir / "node1.log"
    path.write_text("a line\n")
    (logs_dir / "node1.log.2").symlink_to(victim)  # shifted out: the link goes, not the file
    (logs_dir / "node1.log.1").symlink_to(victim)  # shifted to .2, never written through
    writer = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        assert logs.rotate_log(str(path), writer, keep=2)
    finally:
        os.close(writer)
    assert victim.read_text() == "keep me\n"
    assert (logs_dir / "node1.log.1").read_text() == "a line\n"
    assert not (logs_dir / "node1.log.1").is_symlink()
    os.unlink(path)
    path.symlink_to(victim)
    held = os.open(victim, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="symbolic links"):  # the log a link: nothing done
            logs.rotate_log(str(path), held, keep=2)
    finally:
        os.close(held)
    assert victim.read_text() == "keep me\n"


def test_the_spec_bounds_the_rotation(tmp_path: Path):
    raw = {
        "job": "t", "host": "m", "rank": 0, "nnodes": 1, "role": "master", "watchdog_port": 0,
        "max_restarts": 0, "cwd": "/", "log": "/l", "state": "/s", "env_file": "/e",
        "command": ["true"],
    }  # fmt: skip
    default = job_spec.parse_spec("spec", raw)
    assert (default.log_max_bytes, default.log_keep) == (64 << 20, 3)
    given = job_spec.parse_spec("spec", {**raw, "log_rotate": {"max_bytes": 4096, "keep": 1}})
    assert (given.log_max_bytes, given.log_keep) == (4096, 1)
    for bad in ({"max_bytes": 10}, {"keep": 0}, {"keep": True}):
        with pytest.raises(job_spec.Refused, match="log_rotate"):
            job_spec.parse_spec("spec", {**raw, "log_rotate": bad})


def test_the_rank_torchrun_names_as_the_first_to_fail_is_read_from_its_summary():
    # Issue 39, on the lab (two ranks per node): local rank 1 of node 2 killed; torchrun ended its
    # sibling (SIGTERM) and named the first failure last, under "Root Cause".
    text = "\n".join(
        [
            "Failures:",
            "[1]:",
            "  time      : 2026-12-05_04:07:48",
            "  host      : i39lab-node2",
            "  rank      : 2 (local_rank: 0)",
            "  exitcode  : -15 (pid: 4961)",
            "------------------------------------------------------------",
            "Root Cause (first observed failure):",
            "[0]:",
            "  time      : 2026-12-05_04:07:48",
            "  host      : i39lab-node2",
            "  rank      : 3 (local_rank: 1)",
            "  exitcode  : -9 (pid: 4962)",
        ]
    )
    assert logs.failed_rank(text) == "rank 3 (local rank 1)"
    assert logs.failed_rank("ChildFailedError: no summary") == ""
    # The summary's rank lines are error lines too: the failure names the processes.
    assert "  rank      : 3 (local_rank: 1)" in logs.first_error_lines(text)
