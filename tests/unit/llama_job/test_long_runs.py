"""What long runs meet, met by real agent pairs (tests/support/llama_job_support.py): a save
slower than the stall floor, a hang during a save, a failure in teardown after every rank
finished, and a node lost for good with min_nodes (issue 44)."""

from __future__ import annotations

import os
import signal
import time

from ansible_collections.llama.cluster.plugins.module_utils.llama_job import protocol

# The pair's clocks (Pair): a step every 0.2 s, so the stall limit is the floor, 2 s.
STALL_FLOOR_S = 2.0
# A checkpoint planned at 100 MB on a disk measured at 50 MB/s: a save may take
# 3 x 2 s = 6 s beyond the stall limit (saves.py: SAVE_FACTOR).
SAVES = {"checkpoint_bytes": 100_000_000, "disk_write_bps": 50_000_000}
SAVE_ALLOWANCE_S = 6.0


def test_a_save_slower_than_the_stall_floor_is_not_a_stall(pair_factory) -> None:
    # Rank 0 saves for 5 s (2.5 x the stall floor) at step 4: within the save's allowance.
    pair = pair_factory(steps=8, SAVE_AT="4", SAVE_S="5", spec_extra={"m": SAVES})
    pair.wait_ended(timeout=60)
    assert pair.state("m")["phase"] == "succeeded", pair.logs()
    assert "may take 6 s beyond the stall limit" in (pair.tmp / "m.log").read_text()


def test_an_evaluation_longer_than_the_stall_floor_that_goes_on_is_not_a_stall(
    pair_factory,
) -> None:
    # Rank 0 evaluates for 6 s (3 x the stall floor) at step 4, rewriting its activity every
    # second as its batches go (the callback: every 5 s); no save allowance is planned.
    pair = pair_factory(steps=8, EVAL_AT="4", EVAL_S="6")
    pair.wait_ended(timeout=60)
    assert pair.state("m")["phase"] == "succeeded", pair.logs()


def test_a_hang_during_a_save_is_caught_within_the_stall_limit_and_the_saves_allowance(
    pair_factory,
) -> None:
    pair = pair_factory(steps=30, SAVE_AT="4", SAVE_HANG="1", spec_extra={"m": SAVES})
    pair.wait_step(3)
    saving = time.monotonic()
    pair.wait_ended(timeout=60)
    elapsed = time.monotonic() - saving
    reason = pair.state("m")["reason"]
    assert reason["kind"] == "stalled", pair.logs()
    assert "6 s of it for saving checkpoint-4)" in reason["message"], reason["message"]
    # Bound: the stall limit + the allowance, then the stop (2 s) and the loop's ticks.
    assert STALL_FLOOR_S + SAVE_ALLOWANCE_S - 1 < elapsed < STALL_FLOOR_S + SAVE_ALLOWANCE_S + 5
    assert pair.leftovers() == []


def test_a_failure_in_teardown_after_every_rank_finished_is_a_warning_not_a_failed_run(
    pair_factory,
) -> None:
    # The worker's ranks reach the last step, say so, then abort (SIGABRT, as a rank once did
    # in gloo's teardown on the lab) while rank 0 is still finishing (1.5 s more): the master
    # lets it finish, and the run succeeds, the worker's abort said as a warning.
    ranks = {"m": {"ranks": [0]}, "w": {"ranks": [1]}}
    pair = pair_factory(
        steps=6,
        master_env={"MARK_RANKS": "0", "END_S": "1.5"},
        worker_env={"MARK_RANKS": "1", "TEARDOWN_ABORT": "1"},
        spec_extra=ranks,
    )
    pair.wait_ended(timeout=60)
    master = pair.state("m")
    assert master["phase"] == "succeeded", pair.logs()
    assert master["reason"] is None
    (warning,) = master["warnings"]
    assert warning.startswith("w: its command ended, killed by signal 6 (SIGABRT), after every ")
    assert "rank reached the last step (6)" in warning
    assert "(a failure in teardown)" in warning
    assert pair.state("w")["phase"] == "succeeded"


def test_a_rank_that_aborts_before_it_finished_still_fails_the_run(pair_factory) -> None:
    pair = pair_factory(
        steps=6,
        worker_env={"TEARDOWN_ABORT": "1"},  # no finished marks: it did not reach the end
        spec_extra={"m": {"ranks": [0]}, "w": {"ranks": [1]}},
    )
    pair.wait_ended(timeout=60)
    master = pair.state("m")
    assert master["phase"] == "failed", pair.logs()
    assert master["reason"]["node"] == "w"
    assert master["warnings"] == []


def test_a_node_lost_for_good_leaves_the_run_to_the_others_with_min_nodes(pair_factory) -> None:
    # Two nodes, min_nodes 1: the worker's agent and command killed for good at step 4. After
    # the restart window (8 s), the master continues alone, its command given the plan for one
    # node and NNODES=1; the run finishes, and its state says it ran without the worker.
    fewer = {"1": {"args": ["gradient_accumulation_steps=16"], "note": "accumulation 8 -> 16"}}
    spec = {"min_nodes": 1, "fewer_nodes": fewer}
    pair = pair_factory(restarts=1, steps=12, spec_extra={"m": spec})
    pair.wait_step(4)
    os.killpg(pair.procs["w"].pid, signal.SIGKILL)  # the node's agent and its command at once
    pair.wait_ended(("m",), timeout=90)
    master = pair.state("m")
    assert master["phase"] == "succeeded", pair.logs()
    assert master["left_out"] == ["w"]
    (restart,) = master["restarts"]
    assert (restart["after"]["node"], restart["left_out"]) == ("w", ["w"])
    assert restart["note"] == "accumulation 8 -> 16"
    log = (pair.tmp / "m.log").read_text()
    assert "w did not come back within 8 s: the run continues without them (min_nodes 1)" in log
    assert "attempt 2 runs on 1 of 2 nodes (m), without w: accumulation 8 -> 16" in log
    assert "job m NNODES 1 NODE_RANK 0 args gradient_accumulation_steps=16" in log


def test_without_min_nodes_a_node_lost_for_good_fails_the_run_naming_it(pair_factory) -> None:
    pair = pair_factory(restarts=1, steps=12)
    pair.wait_step(4)
    os.killpg(pair.procs["w"].pid, signal.SIGKILL)
    pair.wait_ended(("m",), timeout=90)
    master = pair.state("m")
    assert master["phase"] == "failed", pair.logs()
    assert master["reason"]["away"] == ["w"]
    assert "no restart: w did not come back within 8 s" in master["reason"]["message"]


def test_the_plays_ask_a_node_the_run_went_on_without_no_more() -> None:
    # After a run that succeeded on fewer nodes, the play's report skips the node left out
    # (job_gone) rather than wait on a machine that is gone.
    lead = protocol.RankStatus(
        job="t", host="m", rank=0, role="master", phase=protocol.Phase.SUCCEEDED, left_out=("w",)
    )
    assert lead.given_up() == ("w",)
