"""One definition of a job's phases, failure kinds and status (llama_job/protocol.py): every
layer imports it, the zipapp carries it, and a status reaches the API unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys

from ansible_collections.llama.cluster.plugins.filter import job as job_filters
from ansible_collections.llama.cluster.plugins.module_utils import job_view
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import protocol
from ansible_collections.llama.cluster.plugins.modules import llama_job as job_module

import llama_runner
from llama_runner import api, cli, events, results
from tests.support.llama_job_support import TOOL

REASON = {
    "node": "node2",
    "rank": 1,
    "kind": "exited",
    "exit_status": 1,
    "message": "its command ended, exit status 1",
    "errors": ["RuntimeError: Expected a string, got None"],
}


# One definition of a job's phases, failure kinds and status: every layer that reads a job's
# state imports llama_job's protocol module, and the zipapp on the nodes carries the same
# definition. A status is carried unchanged: what llama-job prints is what the module hands on,
# what the filters make is what status.yml publishes and what the API reads back.

NODE_PHASES = (
    "import json, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from llama_cluster.llama_job import protocol as p\n"
    "print(json.dumps({'phases': [x.value for x in p.Phase],"
    " 'kinds': [x.value for x in p.FailureKind], 'file': p.__file__}))\n"
)


def test_every_controller_layer_imports_the_one_protocol_module():
    assert llama_runner.JobStatus is protocol.JobStatus  # the API
    assert llama_runner.Phase is protocol.Phase
    assert llama_runner.FailureKind is protocol.FailureKind
    assert api.JobStatus is results.JobStatus is cli.JobStatus is protocol.JobStatus
    assert events.RankStatus is protocol.RankStatus
    assert job_filters.JobStatus is protocol.JobStatus  # the filters
    assert job_filters.job_status is job_view.job_status
    assert job_module.RankStatus is protocol.RankStatus  # the llama_job module
    assert job_module.leading is protocol.leading


def test_the_zipapp_on_the_nodes_carries_the_same_phases_and_kinds():
    shown = subprocess.run(
        [sys.executable, "-c", NODE_PHASES, str(TOOL)],
        capture_output=True,
        text=True,
        check=True,
    )
    node = json.loads(shown.stdout)
    assert node["file"].startswith(str(TOOL))  # read from inside the archive
    assert node["phases"] == [p.value for p in protocol.Phase]
    assert node["kinds"] == [k.value for k in protocol.FailureKind]


def test_phases_and_failure_kinds_are_closed_and_say_what_they_allow():
    ended = {p for p in protocol.Phase if p.is_terminal()}
    assert ended == {protocol.Phase.SUCCEEDED, protocol.Phase.FAILED, protocol.Phase.STOPPED}
    going = {p for p in protocol.Phase if p.in_progress()}
    assert going.isdisjoint({protocol.Phase.UNKNOWN, protocol.Phase.ABSENT})
    assert going >= {protocol.Phase.WAITING, protocol.Phase.RESTARTING}
    assert {p for p in protocol.Phase if p.resumable()} == {
        protocol.Phase.FAILED,
        protocol.Phase.STOPPED,
    }
    assert protocol.Phase.of("no such phase") is protocol.Phase.UNKNOWN
    assert protocol.Phase.of("running") is protocol.Phase.RUNNING
    kinds = protocol.FailureKind
    assert {k for k in kinds if k.restartable()} == {
        kinds.EXITED,
        kinds.VANISHED,
        kinds.STALLED,
        kinds.LOST,
    }
    assert protocol.FailureKind.of("no such kind") is kinds.EXITED


RECORD = {
    "job": "j", "host": "n1", "rank": 0, "supervisor": "process", "unit": "llama-j-rank0",
    "log": "/l", "state": "/s", "started": "2026-12-02T07:00:00Z",
}  # fmt: skip


def test_a_rank_status_reaches_the_play_unchanged_with_its_lead_and_line():
    state = {"phase": "running", "role": "master", "progress": {"current_steps": 3}}
    rank = protocol.rank_status(RECORD, state, alive=True, left=[])
    printed = {"job": "j", "found": True, "ranks": [rank.to_dict()]}
    params = {"action": "status", "job": "j", "progress_file": ""}
    handed = job_module.reshape(dict(printed), params)
    assert handed["ranks"] == printed["ranks"]  # what llama-job printed, unchanged
    assert handed["lead"] == rank.to_dict()
    assert protocol.RankStatus.from_dict(handed["lead"]) == rank
    assert handed["progress"] == "step 3/?"
    assert handed["got_going"] is True
    progress = results.TrainProgress.from_result("n1", handed)
    assert progress is not None
    assert progress.step == 3


def test_an_agent_that_ended_without_a_word_is_a_lost_rank_and_a_failed_job():
    state = {"phase": "running", "role": "master"}
    lost = protocol.rank_status(RECORD, state, alive=False, left=[], errors=["boom"])
    assert lost.phase is protocol.Phase.FAILED
    assert lost.reason is not None
    assert (lost.reason.kind, lost.reason.errors) == (protocol.FailureKind.LOST, ("boom",))
    status = job_view.job_status(
        {"n1": {"ranks": [lost.to_dict()]}, "n2": {"unreachable": True}}, "n1", "j"
    )
    assert (status.phase, status.node, status.unreachable) == (
        protocol.Phase.FAILED,
        "n1",
        ("n2",),
    )
    assert status.nodes["n2"] == protocol.NodeStatus(
        protocol.Phase.UNKNOWN, reachable=False, active=None
    )
