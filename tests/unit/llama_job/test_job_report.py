"""How a play reports a job from what each node's llama-job said (filter/job.py: the protocol's
JobStatus, unchanged): the verdict, an ended run's outcome and where to continue, a node's log
split per rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.filter import job as job_filters
from ansible_collections.llama.cluster.plugins.filter.job import (
    job_failure_message,
    job_found_files,
    job_gone,
    job_resume,
    job_run_summary,
    job_status_lines,
)
from ansible_collections.llama.cluster.plugins.filter.job import (
    job_status_of as job_status,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import protocol
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.checkpoints import (
    continue_plan,
)

from tests.support.llama_job_support import TOOL

ROOT = Path(__file__).resolve().parents[3]
REASON = {
    "node": "node2",
    "rank": 1,
    "kind": "exited",
    "exit_status": 1,
    "message": "its command ended, exit status 1",
    "errors": ["RuntimeError: Expected a string, got None"],
}


def _rank(host: str, role: str, phase: str, **extra: object) -> dict:
    return {
        "host": host,
        "rank": 0 if role == "master" else 1,
        "role": role,
        "phase": phase,
        "active": False,
        "unit": f"llama-r-rank{0 if role == 'master' else 1}",
        "log": f"/runs/r/logs/{host}.log",
        **extra,
    }


def _hostvars(**results: object) -> dict:
    return {host: {"__job_status": result} for host, result in results.items()}


def test_the_masters_verdict_speaks_for_the_job():
    hostvars = _hostvars(
        node1={"ranks": [_rank("node1", "master", "failed", reason=REASON, restarts=[])]},
        node2={"ranks": [_rank("node2", "worker", "failed", reason=REASON)]},
    )
    outcome = job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")
    assert outcome["phase"] == "failed"
    assert (outcome["reason"]["node"], outcome["reason"]["exit_status"]) == ("node2", 1)
    assert outcome["unreachable"] == []
    assert (outcome["resumable"], outcome["succeeded"], outcome["in_progress"]) == (
        True,
        False,
        False,
    )
    message = job_failure_message(outcome, {"node1": 0, "node2": 1})
    assert message.startswith("Job r failed on node2 (rank 1): its command ended, exit status 1.")
    assert "Every rank was stopped on node1, node2." in message
    assert "  RuntimeError: Expected a string, got None" in message


def test_a_dead_master_is_reported_from_the_workers_records():
    vanished = {
        **REASON,
        "node": "node1",
        "kind": "vanished",
        "exit_status": None,
        "message": "lost the master node1 (its agent has ended)",
        "errors": [],
    }
    hostvars = _hostvars(
        node1={"unreachable": True, "msg": "Failed to connect"},
        node2={"ranks": [_rank("node2", "worker", "failed", reason=vanished)]},
    )
    outcome = job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")
    assert outcome["phase"] == "failed"
    assert outcome["reason"]["node"] == "node1"
    assert outcome["unreachable"] == ["node1"]
    message = job_failure_message(outcome, {"node1": 0, "node2": 1})
    assert "failed on node1 (rank 0): lost the master node1" in message
    assert "node1 did not answer." in message


def test_a_node_missing_from_the_play_counts_as_unreachable():
    hostvars = {"node1": {"__job_status": {"ranks": [_rank("node1", "master", "running")]}}}
    outcome = job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")
    assert outcome["phase"] == "running"
    assert outcome["unreachable"] == ["node2"]


# A node that stopped answering is asked once (issue 40: after a worker lost power, every rank
# stopped in 29 s, but the watching play took 2 min 40 s more: status, stop, the log's fetch and
# the checkpoints' listing each waited about 30 s on the dead node). The master's verdict names
# the nodes its agent gave up (job_gone); every later node task skips them.
VANISHED = {
    **REASON,
    "kind": "vanished",
    "exit_status": None,
    "message": "stopped answering (no heartbeat for 30 s)",
    "errors": [],
    "silent": True,
}


def test_the_masters_verdict_names_the_nodes_it_gave_up():
    lost = _rank("node1", "master", "failed", reason=VANISHED)
    assert job_gone({"lead": lost, "done": True}, "node1") == ["node2"]
    # An agent that closed its connection (killed; issue 39's lab) ended on a machine that still
    # answers: it is asked for its log and its checkpoints.
    closed = {**VANISHED, "silent": False, "message": "its agent closed the connection"}
    assert job_gone({"lead": _rank("node1", "master", "failed", reason=closed)}, "node1") == []
    away = {**REASON, "kind": "exited", "away": ["node3", "node1"]}  # no comeback for a restart
    assert job_gone({"lead": _rank("node1", "master", "failed", reason=away)}, "node1") == ["node3"]
    exited = _rank("node1", "master", "failed", reason=REASON)  # a rank died: every node answers
    assert job_gone({"lead": exited}, "node1") == []
    assert job_gone({"lead": _rank("node1", "master", "succeeded")}, "node1") == []
    # The master itself could not be asked: it is the node the play gives up.
    assert job_gone({"unreachable": True, "msg": "Failed to connect"}, "node1") == ["node1"]


def test_a_node_not_asked_counts_as_unreachable_and_as_holding_nothing_known():
    hostvars = _hostvars(
        node1={"ranks": [_rank("node1", "master", "failed", reason=VANISHED)]},
        node2={"skipped": True, "changed": False},  # job_gone: not asked
    )
    outcome = job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")
    assert outcome["unreachable"] == ["node2"]
    message = job_failure_message(outcome, {"node1": 0, "node2": 1})
    assert message.startswith("Job r failed on node2 (rank 1): stopped answering")
    assert message.count("did not answer") == 1, message  # the node the verdict is about, once
    found = {"node1": {"cp": {"files": []}}, "node2": {"cp": {"skipped": True}}}
    assert job_found_files(["node1", "node2"], found, "cp") == {"node1": [], "node2": None}


DEAD_NODE_INVENTORY = """
cluster:
  children:
    master:
      hosts:
        n1: {ansible_connection: local, ansible_python_interpreter: %(python)s}
    workers:
      hosts:
        dead: {ansible_host: 192.0.2.1, ansible_user: nobody}
"""

# What follows the verdict in train.yml's Run play (roles/job's status and stop, a failed run's
# fetch and checkpoint listing), with the worker given up by the master's agent.
DEAD_NODE_PLAYBOOK = """
- name: Gone | After the verdict
  hosts: cluster
  gather_facts: false
  vars:
    job_id: r
    job_bin: %(tool)s
    job_gone: [dead]
    run_dir: %(tmp)s/run
    controller_dir: %(tmp)s/back
    run_sharded: false
  tasks:
    - name: Gone | Ask every node how the job stands
      ansible.builtin.include_role:
        name: job
        tasks_from: status
    - name: Gone | Stop the job on every node
      ansible.builtin.include_role:
        name: job
        tasks_from: stop
    - name: Gone | Bring back what the nodes have
      ansible.builtin.include_tasks: %(root)s/playbooks/tasks/fetch_run.yml
    - name: Gone | Look for checkpoints
      ansible.builtin.include_tasks: %(root)s/playbooks/tasks/ended_run.yml
      vars:
        job_status: {resumable: true, phase: failed, job: r}
"""


def test_the_tasks_after_the_verdict_never_ask_a_node_the_master_gave_up(tmp_path: Path):
    (tmp_path / "hosts.yml").write_text(DEAD_NODE_INVENTORY % {"python": sys.executable})
    playbook = tmp_path / "gone.yml"
    playbook.write_text(DEAD_NODE_PLAYBOOK % {"tool": TOOL, "tmp": tmp_path, "root": ROOT})
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(tmp_path / "hosts.yml"),
         str(playbook)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_TIMEOUT": "5"},
    )  # fmt: skip
    out = done.stdout
    assert "PLAY RECAP" in out, out[-3000:] + done.stderr[-2000:]
    assert "UNREACHABLE" not in out, out[-4000:]
    assert "-> dead]" not in out, "a task was delegated to the dead node"
    # Each task that reaches a node skipped the dead one (the role's argument checks and the
    # includes run on the controller).
    for task in re.split(r"^TASK ", out, flags=re.M)[1:]:
        name, results = task.split("\n", 1)
        if "Validating arguments" in name or "Gone |" in name:
            continue
        said = [line for line in results.splitlines() if "[dead]" in line]
        assert all(line.startswith("skipping: [dead]") for line in said), (name, said)
    assert re.search(r"^dead +: .*unreachable=0 +failed=0", out, re.M), out[-2000:]


def test_status_lines_say_step_loss_eta_and_restarts():
    restarts = [{"attempt": 2, "at": "2026-12-01T10:00:00Z", "after": REASON}]
    progress = {
        "current_steps": 12,
        "total_steps": 70,
        "loss": 1.23456,
        "remaining_time": "0:01:00",
    }
    hostvars = _hostvars(
        node1={
            "ranks": [
                _rank(
                    "node1",
                    "master",
                    "running",
                    progress=progress,
                    restarts=restarts,
                    max_restarts=2,
                    attempt=2,
                )
            ]
        },
        node2={"ranks": [_rank("node2", "worker", "running")]},
    )
    outcome = job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")
    lines = job_status_lines(outcome)
    assert lines[0] == "Run r: running, step 12/70, loss 1.2346, ETA 0:01:00"
    assert "  node2 rank 1: running" in lines
    assert lines[-2:] == [
        "  attempt 1: started at ?",
        "  attempt 2: restarted at 2026-12-01T10:00:00Z from the beginning, after attempt 1 "
        "ended at ? on node2: its command ended, exit status 1",
    ]


def test_status_and_failure_name_every_rank_of_a_node_that_runs_several():
    # Issue 39: two processes per node; the job's spec names their global ranks (torchrun's RANK).
    hostvars = _hostvars(
        node1={"ranks": [_rank("node1", "master", "failed", reason=REASON, ranks=[0, 1])]},
        node2={"ranks": [_rank("node2", "worker", "failed", reason=REASON, ranks=[2, 3])]},
    )
    outcome = job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")
    assert outcome["nodes"]["node2"]["ranks"] == [2, 3]
    lines = job_status_lines(outcome)
    assert "  node1 (node rank 0, ranks 0-1): failed" in lines
    assert "  node2 (node rank 1, ranks 2-3): failed" in lines
    message = job_failure_message(outcome, {"node1": 0, "node2": 1})
    assert message.startswith("Job r failed on node2 (node rank 1, ranks 2-3): its command ended")
    assert protocol.ranks_text([5]) == "rank 5"
    assert protocol.ranks_text([0, 2, 3]) == "ranks 0, 2, 3"
    # The node's status as llama-job prints it carries them back unchanged.
    back = protocol.JobStatus.from_dict(outcome)
    assert back.nodes["node1"].ranks == (0, 1)


# ---- an ended run: outcome, steps, final loss, time, restarts, where to continue -------------
OUT = "/runs/r/output"
KILLED = {**REASON, "exit_status": -9, "message": "its command ended, killed by signal 9"}


def _checkpoints(*steps: int, complete: bool = True) -> list[dict]:
    found = []
    for step in steps:
        found.append({"path": f"{OUT}/checkpoint-{step}", "isdir": True})
        if complete:
            found.append({"path": f"{OUT}/checkpoint-{step}/trainer_state.json", "isdir": False})
    return found


def _ended(phase: str, *, reason: dict | None = None, restarts: int = 0, **master: object) -> dict:
    after = [
        {"attempt": n + 2, "at": "2026-12-01T10:05:00Z", "after": REASON} for n in range(restarts)
    ]
    status = {
        "ranks": [
            _rank(
                "node1",
                "master",
                phase,
                reason=reason,
                restarts=after,
                max_restarts=2,
                attempt=restarts + 1,
                started="2026-12-01T10:00:00Z",
                ended="2026-12-01T10:12:40Z",
                progress={"current_steps": 90, "total_steps": 90, "elapsed_time": "0:07:40"},
                **master,
            )
        ],
        "trainer_log": {
            "last_step": 90 if phase == "succeeded" else 29,
            "total_steps": 90,
            "final_loss": 1.23456,
            "elapsed": "0:07:40",
            "records": 11,
        },
    }
    worker = {"ranks": [_rank("node2", "worker", phase, reason=reason)]}
    hostvars = _hostvars(node1=status, node2=worker)
    return job_status(["node1", "node2"], hostvars, "node1", "__job_status", "r")


def _summarised(outcome: dict, checkpoints: dict | None = None) -> dict:
    return {**outcome, "summary": job_run_summary(outcome, checkpoints, "/runs/r")}


def test_the_outcome_carries_the_jobs_times_and_the_masters_trainer_log():
    outcome = _ended("succeeded")
    assert (outcome["started"], outcome["ended"]) == (
        "2026-12-01T10:00:00Z",
        "2026-12-01T10:12:40Z",
    )
    assert outcome["trainer_log"]["final_loss"] == 1.23456


def test_a_succeeded_run_says_its_steps_final_loss_time_and_restarts():
    outcome = _summarised(_ended("succeeded", restarts=1))
    summary = outcome["summary"]
    assert summary == {
        "step": 90,
        "total_steps": 90,
        "final_loss": 1.23456,
        "time_s": 760.0,
        "time_from": "llama-job",
        "restarts": 1,
        "max_restarts": 2,
        "restarted_after": ["node2"],
        "resume": None,
    }
    lines = job_status_lines(outcome)
    assert lines[0] == "Run r: succeeded, step 90/90, final loss 1.2346, time 0:12:40"
    assert lines[1] == "  Restarts: 1 of 2 (node2 failed)"
    assert (
        "  attempt 2: restarted at 2026-12-01T10:05:00Z from the beginning, after attempt 1 ended "
        "at ? on node2: " + REASON["message"] in lines
    )
    assert not any("resume" in line for line in lines)


def test_a_failed_run_says_where_it_ended_and_the_checkpoint_to_continue_from():
    outcome = _ended("failed", reason=KILLED, restarts=2)
    found = {
        "node1": _checkpoints(20, 25),
        "node2": _checkpoints(20) + _checkpoints(25, complete=False),
    }
    outcome = _summarised(outcome, found)
    resume = outcome["summary"]["resume"]
    assert resume["checkpoint"] == "checkpoint-20"
    assert resume["command"] == "ansible-playbook train.yml -e resume=true -e run_id=r"
    lines = job_status_lines(outcome)
    assert lines[:4] == [
        "Run r: failed on node2: its command ended, killed by signal 9",
        "  Ended at step 29/90, final loss 1.2346, time 0:12:40",
        "  Restarts: 2 of 2 (node2, then node2 failed)",
        "  Continue from checkpoint-20: ansible-playbook train.yml -e resume=true -e run_id=r",
    ]
    assert "  | RuntimeError: Expected a string, got None" in lines


def test_a_stopped_run_without_a_common_checkpoint_says_why_not():
    stop = {"node": "node1", "kind": "stopped", "message": "stop requested", "exit_status": None}
    outcome = _ended("stopped", reason=stop)
    outcome["started"] = None  # no end recorded by llama-job: the trainer's elapsed stands in
    outcome = _summarised(outcome, {"node1": _checkpoints(5), "node2": []})
    summary = outcome["summary"]
    assert (summary["time_s"], summary["time_from"]) == (460.0, "trainer log")
    assert summary["resume"]["checkpoint"] is None
    lines = job_status_lines(outcome)
    assert lines[0] == "Run r: stopped on node1: stop requested"
    assert lines[1] == "  Ended at step 29/90, final loss 1.2346, time 0:07:40"
    assert lines[2] == "  Restarts: none (2 allowed)"
    assert lines[3].startswith("  No resume: Run r cannot resume: no checkpoint is on every node")


def test_a_node_that_did_not_answer_leaves_the_checkpoint_unknown():
    outcome = _summarised(
        _ended("failed", reason=KILLED), {"node1": _checkpoints(20), "node2": None}
    )
    resume = outcome["summary"]["resume"]
    assert resume["checkpoint"] is None
    assert resume["message"].startswith("node2 did not answer, so the checkpoint")
    assert resume["message"].endswith("-e resume=true -e run_id=r")


@pytest.mark.parametrize("sharded", [False, True])
def test_the_controllers_resume_check_and_llama_job_pick_the_same_checkpoint(sharded: bool):
    # resume.yml refuses early with the filter job_resume; the master's agent applies
    # continue_plan as the job starts: one rule, so one answer, one message.
    for found in (
        {
            "node1": _checkpoints(10, 20),
            "node2": _checkpoints(10) + _checkpoints(20, complete=False),
        },
        {"node1": _checkpoints(20), "node2": _checkpoints(10)},
        {"node1": [], "node2": []},
    ):
        early = job_resume(found, "r", "/runs/r", sharded)
        plan = continue_plan(
            found, "r", f"{OUT}", "resume-20261201-100000", sharded=sharded, from_scratch=False
        )
        assert early["checkpoint"] == plan["checkpoint"]
        if plan["ok"]:
            assert early["command"] == "ansible-playbook train.yml -e resume=true -e run_id=r"
        else:
            assert early["message"] == plan["message"]


def test_a_run_still_going_has_no_summary():
    hostvars = _hostvars(node1={"ranks": [_rank("node1", "master", "running")]})
    status = job_status(["node1"], hostvars, "node1", "__job_status", "r")
    assert job_run_summary(status, {}) is None


def test_found_files_keep_the_entries_and_none_for_a_silent_node():
    hostvars = {
        "node1": {"cp": {"files": _checkpoints(5)}},
        "node2": {"cp": {"unreachable": True}},
    }
    assert job_found_files(["node1", "node2"], hostvars, "cp") == {
        "node1": _checkpoints(5),
        "node2": None,
    }


ENDED_INVENTORY = """
all:
  children:
    cluster:
      children:
        master: {hosts: {node1: {ansible_connection: local, ansible_python_interpreter: %(py)s}}}
        workers: {hosts: {node2: {ansible_connection: local, ansible_python_interpreter: %(py)s}}}
"""
ENDED_PLAYBOOK = """
- name: Ended
  hosts: cluster
  gather_facts: false
  vars:
    run_dir: %(run)s
    run_sharded: false
    job_status: {job: r, phase: failed, resumable: true, nodes: {}}
  tasks:
    - name: Ended | Find the run, as find_run.yml does
      ansible.builtin.find:
        paths: %(runs)s
        file_type: directory
      register: __runs_found
    - name: Ended | Work out what it came to
      ansible.builtin.include_tasks: %(root)s/playbooks/tasks/ended_run.yml
    - name: Ended | Say it
      ansible.builtin.debug:
        msg: "RESUME {{ job_status.summary.resume.checkpoint }}"
      run_once: true
"""


def test_status_after_find_run_works_out_the_checkpoint_every_node_holds(tmp_path: Path):
    run = tmp_path / "runs" / "r"
    for step in (2, 4):
        (run / "output" / f"checkpoint-{step}").mkdir(parents=True)
        (run / "output" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "hosts.yml").write_text(ENDED_INVENTORY % {"py": sys.executable})
    playbook = tmp_path / "ended.yml"
    playbook.write_text(ENDED_PLAYBOOK % {"run": run, "runs": tmp_path / "runs", "root": ROOT})
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i",
         str(tmp_path / "hosts.yml"), str(playbook)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert "RESUME checkpoint-4" in done.stdout


def test_a_nodes_log_splits_into_one_log_per_rank_with_the_agents_lines_in_each():
    text = (
        "[llama-job 10:00:00] job r rank 1 (worker), attempt 1\n"
        "W1205 torchrun: Setting OMP_NUM_THREADS\n"
        "[rank2]:loading the model\n"
        "[rank3]:loading the model\n"
        "[rank3]:[rank3]: Traceback (most recent call last):\n"
        "[llama-job 10:00:09] restart: attempt 2 resumes from checkpoint-10\n"
        "[rank2]:Resuming training from checkpoint\n"
    )
    logs = job_filters.job_rank_logs(text)
    assert sorted(logs) == ["2", "3"]
    assert logs["2"].splitlines() == [
        "[llama-job 10:00:00] job r rank 1 (worker), attempt 1",
        "loading the model",
        "[llama-job 10:00:09] restart: attempt 2 resumes from checkpoint-10",
        "Resuming training from checkpoint",
    ]
    assert logs["3"].splitlines()[-2:] == [
        "[rank3]: Traceback (most recent call last):",
        "[llama-job 10:00:09] restart: attempt 2 resumes from checkpoint-10",
    ]
    assert "OMP_NUM_THREADS" not in "".join(logs.values())  # the launcher's line: the node's log
    assert job_filters.job_rank_logs("no rank printed anything\n") == {}


def test_the_status_status_yml_publishes_is_the_one_the_api_reads_back():
    outcome = _summarised(
        _ended("failed", reason=KILLED, restarts=1),
        {"node1": _checkpoints(20), "node2": _checkpoints(20)},
    )
    published = json.loads(json.dumps(outcome))  # set_stats: JSON on the way
    job = protocol.JobStatus.from_dict(published)
    assert job.to_dict() == outcome
    assert (job.phase, job.node, job.exit_status, job.step) == (
        protocol.Phase.FAILED,
        "node2",
        -9,
        29,
    )
    assert job.summary is not None
    assert job.summary.resume == protocol.Resume(
        "checkpoint-20",
        "ansible-playbook train.yml -e resume=true -e run_id=r",
        "Continue from checkpoint-20: ansible-playbook train.yml -e resume=true -e run_id=r",
    )
    assert job.restarts[0].after == protocol.Failure.from_dict(REASON)


# -- ansible-playbook's output: Ansible's default, then each play's time and the slowest tasks.
