"""One definition of a job's phases, status and outcome: every layer that reads a job's state
imports llama_job's protocol module, and the zipapp on the nodes carries the same definition."""

from __future__ import annotations

import json
import subprocess
import sys

from ansible_collections.llama.cluster.plugins.filter import job as job_filters
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import protocol
from ansible_collections.llama.cluster.plugins.modules import llama_job as job_module

import llama_runner
from llama_runner import results, status
from llama_runner.protocol import protocol as runner_protocol
from tests.test_llama_job import TOOL

NODE_PHASES = (
    "import json, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from llama_cluster.llama_job import protocol as p\n"
    "print(json.dumps({'phases': [x.value for x in p.Phase], 'terminal': list(p.TERMINAL),"
    " 'states': list(p.RUN_STATES), 'file': p.__file__}))\n"
)


def test_every_controller_layer_imports_the_one_protocol_module():
    assert runner_protocol() is protocol  # llama_runner
    assert llama_runner.RUN_STATES is protocol.RUN_STATES
    assert job_filters.protocol is protocol  # the filters (job_outcome, job_run_summary, ...)
    assert job_module.leading is protocol.leading  # the llama_job module
    assert job_module.progress_line is protocol.progress_line
    assert status.protocol() is protocol
    assert results.RUN_STATES is protocol.RUN_STATES
    assert results.ACTIVE_STATES is protocol.ACTIVE_STATES


def test_the_zipapp_on_the_nodes_carries_the_same_phases():
    shown = subprocess.run(
        [sys.executable, "-c", NODE_PHASES, str(TOOL)],
        capture_output=True,
        text=True,
        check=True,
    )
    node = json.loads(shown.stdout)
    assert node["file"].startswith(str(TOOL))  # read from inside the archive
    assert node["phases"] == [p.value for p in protocol.Phase]
    assert node["terminal"] == list(protocol.TERMINAL)
    assert node["states"] == list(protocol.RUN_STATES)


def test_terminal_phases_are_the_ones_a_job_ends_in():
    ended = {p.value for p in protocol.Phase if p.is_terminal()}
    assert ended == {"succeeded", "failed", "stopped"} == set(protocol.TERMINAL)
    assert all(protocol.is_terminal(p) for p in ended)
    assert not protocol.is_terminal("running")
    assert set(protocol.PHASE_STATES.values()) <= set(protocol.RUN_STATES)
    assert protocol.run_state("waiting") == "starting"
    assert protocol.run_state("no such phase") == "stopped"


def test_a_rank_status_the_module_reshapes_is_the_protocols_shape():
    record = {
        "job": "j", "host": "n1", "rank": 0, "supervisor": "process", "unit": "llama-j-rank0",
        "log": "/l", "state": "/s", "started": "2026-12-02T07:00:00Z",
    }  # fmt: skip
    state = {"phase": "running", "role": "master", "progress": {"current_steps": 3}}
    rank = protocol.rank_status(record, state, alive=True, left=[])
    reshaped = job_module.reshape(
        {"job": "j", "found": True, "ranks": [rank]},
        {"action": "status", "job": "j", "progress_file": ""},
    )
    assert (reshaped["phase"], reshaped["progress_data"]) == ("running", {"current_steps": 3})
    lost = protocol.rank_status(record, state, alive=False, left=[], errors=["boom"])
    assert (lost["phase"], lost["reason"]["kind"], lost["reason"]["errors"]) == (
        "failed",
        "lost",
        ["boom"],
    )
    outcome = protocol.job_outcome({"n1": {"ranks": [lost]}, "n2": {"unreachable": True}}, "n1")
    assert (outcome["phase"], outcome["node"], outcome["unreachable"]) == ("failed", "n1", ["n2"])
