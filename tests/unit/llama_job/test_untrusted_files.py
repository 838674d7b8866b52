"""Files the job's user writes and root (or the agent) reads: an agent's state file and rank 0's
trainer log (issue 45). The training code runs as the job's user, so whatever those files hold,
`llama-job status` and `list` answer (a bad state file is skipped, with a warning naming it),
the stall clock keeps reading, and the trainer log's figures come out typed.

The issue's probes: a state file nested deep (RecursionError) or with "started_s": "soon"
(TypeError) made root's status and list fail, and with them the pre-start check of every new job
on that node (`llama-job list --active`); the stall clock's reader had the same hole.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils import trainer_log
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import control, logs, protocol
from ansible_collections.llama.cluster.plugins.modules.llama_job import (
    trainer_log as module_trainer_log,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.llama_job_support import Pair

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="status and list are root's verbs")
EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
STATE_KEYS = ["job", "phase", "attempt", "started_s", "restarts"]
STATE_KEYS += ["reason", "progress", "peers", "limits", "exit_status", "role", "ended"]
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["t", "running", "soon", "failed", "1e400"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(STATE_KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=16,
)
DEEP = st.builds(
    lambda opener, depth: (opener * depth).encode(),
    st.sampled_from(["[", '{"a":', '{"job":"t","progress":']),
    st.integers(1, 100_000),
)
STATES = st.one_of(
    st.dictionaries(st.sampled_from(STATE_KEYS), JSON, max_size=8).map(
        lambda d: json.dumps({"job": "t", **d}).encode()
    ),
    JSON.map(lambda v: json.dumps(v).encode()),
    DEEP,
    st.binary(max_size=300),
)


# -- root's status and list ---------------------------------------------------------------------
@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Root's record of job t on this node (its agent ended), its state file to be written."""
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setattr(control, "RECORDS", records)
    state = tmp_path / "state.json"
    (tmp_path / "node.log").write_text("Traceback: it died\n")
    record = {
        "job": "t", "host": "n", "rank": 0, "unit": "llama-t-rank0", "supervisor": "process",
        "uid": os.getuid(), "gid": os.getgid(), "user": "root", "state": str(state),
        "log": str(tmp_path / "node.log"), "boot_id": "another boot", "started_s": 1.0,
    }  # fmt: skip
    (records / "t@n.json").write_text(json.dumps(record))
    return state


def _answers(verb: str) -> dict:
    """What `llama-job status --job t` or `list` prints (one JSON document)."""
    out = io.StringIO()
    with redirect_stdout(out):
        if verb == "status":
            control.cmd_status(argparse.Namespace(job="t"))
        else:
            control.cmd_list(argparse.Namespace(active=False))
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def _rank(verb: str) -> tuple[dict, list[str]]:
    answer = _answers(verb)
    ranks = answer["ranks"] if verb == "status" else answer["jobs"]
    assert len(ranks) == 1, answer
    return ranks[0], answer.get("warnings", [])


@needs_root
@pytest.mark.parametrize(
    "content",
    [
        b"[" * 100_000,
        b'{"job": "t", "progress": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
        b'{"job": "t", "started_s": "soon", "phase": "running"}',
        b'{"job": "t", "started_s": NaN, "phase": "running"}',
        b'{"job": "t", "started_s": 5, "phase": "running", "progress": {"throughput": "x"}}',
    ],
    ids=["deep", "deep progress", "started_s soon", "started_s NaN", "throughput x"],
)
def test_status_and_list_answer_the_issues_state_files_naming_a_bad_one(
    node: Path, content: bytes
) -> None:
    node.write_bytes(content)
    for verb in ("status", "list"):
        rank, warnings = _rank(verb)
        assert rank["phase"] == "failed"  # its agent ended without an outcome: lost
        assert rank["reason"]["kind"] == "lost"
        assert rank["reason"]["errors"] == ["Traceback: it died"]
        assert protocol.RankStatus.from_dict(rank).progress_line() == "failed"
        if b"throughput" not in content:
            assert len(warnings) == 1, warnings
            assert warnings[0].startswith(f"skipped {node}: it holds no agent's state ("), warnings
    # A typed one: its progress keeps what has its type, and says a line.
    node.write_bytes(content.replace(b'"x"', b"12.5"))
    if b"throughput" in content:
        rank, warnings = _rank("status")
        assert (rank["progress"], warnings) == ({"throughput": 12.5}, [])


@needs_root
def test_status_and_list_answer_whatever_a_state_file_holds(node: Path) -> None:
    @FUZZ
    @given(content=STATES)
    def one_state(content: bytes) -> None:
        node.write_bytes(content)
        for verb in ("status", "list"):
            rank, warnings = _rank(verb)
            assert protocol.Phase(rank["phase"])
            assert protocol.RankStatus.from_dict(rank).progress_line()
            assert all(str(node) in warning for warning in warnings)

    started = time.monotonic()
    one_state()
    print(f"{EXAMPLES} state files in {time.monotonic() - started:.1f} s")


# -- rank 0's trainer log -------------------------------------------------------------------------
RECORD_KEYS = [*protocol.PROGRESS_COUNTS, *protocol.PROGRESS_NUMBERS, *protocol.PROGRESS_TEXTS]
LINES = st.one_of(
    st.dictionaries(st.sampled_from(RECORD_KEYS), JSON, max_size=6).map(json.dumps),
    JSON.map(json.dumps),
    DEEP.map(bytes.decode),
    st.text(max_size=200),
)


@FUZZ
@given(lines=st.lists(LINES, max_size=8))
def test_the_trainer_logs_figures_and_progress_line_come_out_typed_whatever_it_holds(
    lines: list[str],
) -> None:
    text = "\n".join(lines)
    figures = trainer_log.log_figures(trainer_log.parse_records(text))
    json.dumps(figures, allow_nan=False)  # JSON without NaN: what the controller reads back
    assert figures["total_steps"] is None or isinstance(figures["total_steps"], int)
    for record in trainer_log.parse_records(text):
        shown = protocol.progress_record(record)
        json.dumps(shown, allow_nan=False)
        status = protocol.RankStatus.from_dict({"phase": "running", "progress": record})
        assert status.progress_line()


def test_the_stall_clocks_reader_and_roots_figures_read_the_issues_logs(tmp_path: Path) -> None:
    log = tmp_path / "trainer_log.jsonl"
    good = {"current_steps": 3, "total_steps": 9, "loss": 1.5, "elapsed_time": "0:01"}
    deep, typeless = "[" * 100_000, '{"current_steps": "soon", "loss": NaN, "lr": 1e400}'
    # The stall clock reads the log's last 8 KiB: the deep line fills them; NaN is no JSON.
    for hostile, last in ((deep, {}), (typeless, good)):
        log.write_text(f"{json.dumps(good)}\n{hostile}\n")
        assert logs.last_record(str(log)) == last
        log.write_text(f"{hostile}\n{json.dumps(good)}\n")
        assert logs.last_record(str(log)) == good
    # Root's figures (the llama_job module): the deep line is skipped; the typeless one is the
    # last record, with no step, and its NaN loss is no final loss.
    for hostile, figures in ((deep, (3, 1.5)), (typeless, (None, None))):
        log.write_text(f"{json.dumps(good)}\n{hostile}\n")
        found = module_trainer_log(str(log))
        assert (found["last_step"], found["final_loss"]) == figures
        json.dumps(found, allow_nan=False)


def test_a_live_master_keeps_its_stall_clock_while_the_trainer_log_holds_hostile_lines(
    tmp_path: Path,
) -> None:
    pair = Pair(tmp_path, steps=40)
    try:
        pair.wait_step(3)
        with pair.progress.open("a") as out:
            # The deep line last: the clock's next look finds it at the log's end.
            for line in ('{"current_steps": "soon"}', '{"loss": NaN}', "\x00\xff", "[" * 200_000):
                out.write(line + "\n")
        pair.wait_ended(timeout=60)
        assert pair.state("m")["phase"] == "succeeded", pair.logs()
        assert pair.state("m")["progress"]["current_steps"] == 40
        assert "an error" not in pair.logs()
    finally:
        pair.close()
