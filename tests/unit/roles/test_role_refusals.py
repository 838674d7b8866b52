"""The roles' own refusals that had no test: roles/job's checks of its parameters and its
environment, roles/service's checks of its request and its secrets (roles/firewall's are in
tests/unit/roles/test_firewall.py). Each case is a host of its own on the local connection, its
settings
host variables over the project's defaults, in a play of its own (the service runs on a play of
one host); one ansible-playbook run for them all.

A refusal is the role's first task: nothing runs before it. The cases that pass the checks go on
to the role's next step, which fails on this controller for a reason of its own (no cluster
groups, no llama-job); their message is not a refusal's, which proves the checks let them by.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.support.role_cases import LOCAL, ROOT, run_cases

# One worker takes the whole module, so its module-scoped fixture (ansible-playbook runs)
# runs once, not once per worker.
pytestmark = pytest.mark.xdist_group("role-refusals")

SECRET = "FAKE-secret-value-9f2c"  # must never show in a message

JOB = {"role": "job", "job_id": "run-1", "job_dir": "/nonexistent/run-1", "job_command": ["true"]}
JOB_CASES: dict[str, dict] = {
    "job_good": {},
    "job_bad_id": {"job_id": "run 1"},
    "job_relative_dir": {"job_dir": "runs/run-1"},
    "job_no_command": {"job_command": []},
    "job_negative_restarts": {"job_max_restarts": -1},
    "job_peer_timeout_short": {"job_peer_timeout": 2, "job_heartbeat_interval": 2},
    "job_relative_checkpoints": {"job_checkpoints_dir": "output"},
    "job_resume_argument_without_checkpoint": {"job_resume_argument": "--resume"},
    "job_resume_without_checkpoints": {
        "job_resume": True,
        "job_checkpoints_dir": "",
        "job_resume_argument": "",
    },
    "job_env_bad_name": {"job_environment": {"BAD-NAME": "1"}},
    "job_env_line_break": {"job_environment": {"X": f"{SECRET}\nY=2"}},
    "job_cluster_env_line_break": {"cluster_environment": {"NCCL_DEBUG": "INFO\nLD_PRELOAD=x"}},
}
SERVICE = {
    "role": "service",
    "service_name": "serve-1",
    "service_port": 8000,
    "service_command": ["true"],
}
SERVICE_CASES: dict[str, dict] = {
    "service_good": {},
    "service_bad_name": {"service_name": "serve 1"},
    "service_port_zero": {"service_port": 0},
    "service_no_command": {"service_command": []},
    "service_env_line_break": {"service_environment": {"A": "1\n2"}},
}
SECRETS_CASES: dict[str, dict] = {
    "secrets_good": {},
    "secrets_relative_file": {"service_secret_file": "serve-1.env"},
    "secrets_bad_name": {"service_secret_environment": {"hf-token": SECRET}},
    "secrets_line_break": {"service_secret_environment": {"HF_TOKEN": f"{SECRET}\nX=1"}},
}


def _plays(hosts: dict[str, dict]) -> list[dict]:
    """One play per case (per pair, for the job of one node in a play of two): the role in a
    block whose rescue reports the task that failed and its message, so that the next play runs
    (a play whose hosts all failed would end the playbook)."""
    plays = {}
    for name, settings in hosts.items():
        entry = {"name": settings["role"]}
        if settings.get("tasks_from"):
            entry["tasks_from"] = settings["tasks_from"]
        failed = {
            "task": "{{ ansible_failed_task.name }}",
            "msg": "{{ ansible_failed_result.msg }}",
        }
        plays[settings.get("play", name)] = {
            "name": f"Case {name}",
            "hosts": settings.get("play", name),
            "gather_facts": False,
            "tasks": [
                {
                    "block": [{"ansible.builtin.include_role": entry}],
                    "rescue": [{"name": "Failed", "ansible.builtin.debug": {"msg": failed}}],
                }
            ],
        }
    return list(plays.values())


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each case's failure message ('' for a case that passed)."""
    tmp = tmp_path_factory.mktemp("role-refusals")
    secrets = {
        "role": "service",
        "tasks_from": "secrets",
        "service_secret_file": str(tmp / "secrets" / "serve-1.env"),
        "service_user": os.environ.get("USER", "root"),
    }
    hosts = {name: {**LOCAL, **JOB, **case} for name, case in JOB_CASES.items()}
    # A job of one node in a play of two hosts.
    hosts |= {
        f"job_single_node_{n}": {**LOCAL, **JOB, "job_single_node": True, "play": "single"}
        for n in (1, 2)
    }
    hosts |= {name: {**LOCAL, **SERVICE, **case} for name, case in SERVICE_CASES.items()}
    hosts |= {name: {**LOCAL, **secrets, **case} for name, case in SECRETS_CASES.items()}
    groups = {"single": {"hosts": {h: {} for h in hosts if h.startswith("job_single_node")}}}
    out = run_cases(tmp, {"all": {"hosts": hosts, "children": groups}}, _plays(hosts))
    assert SECRET not in out
    rescued = re.findall(r"^ok: \[(\S+)\] => (\{.*\})$", out, re.M)
    failed = {host: json.loads(result)["msg"] for host, result in rescued}
    return {
        name: f"{failed[name]['task']}: {' '.join(failed[name]['msg'].split())}"
        if name in failed
        else ""
        for name in hosts
    }


JOB_REFUSED = "Job | Check the job's parameters: The job needs job_id (letters, digits"
ENV_REFUSED = "Job | Check the job's environment: The job's environment cannot be written:"
SERVICE_REFUSED = "Service | Check the request: A service needs a name (letters, digits"


def test_good_requests_pass_the_checks(refusals: dict[str, str]) -> None:
    # They fail later, on this controller, for reasons of its own: not a refusal.
    assert refusals["job_good"].startswith("Job | Work out this node's place in the cluster: ")
    assert refusals["service_good"].startswith("Service | Ask llama-job whether the service runs: ")
    assert refusals["secrets_good"] == ""


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("job_bad_id", 'got "run 1"'),
        ("job_relative_dir", 'an absolute job_dir (got "runs/run-1")'),
        ("job_no_command", "a job_command"),
        ("job_negative_restarts", "max_restarts >= 0 (got -1)"),
        ("job_peer_timeout_short", "job_peer_timeout > job_heartbeat_interval > 0"),
        ("job_single_node_1", "a job of one node (job_single_node) in a play of one host (got 2)"),
        ("job_relative_checkpoints", 'an absolute job_checkpoints_dir or none (got "output")'),
        ("job_resume_argument_without_checkpoint", 'holds {checkpoint} or none (got "--resume")'),
        ("job_resume_without_checkpoints", "and both for job_resume (got true)"),
    ],
)
def test_the_job_refuses_bad_parameters(refusals: dict[str, str], case: str, said: str) -> None:
    assert refusals[case].startswith(JOB_REFUSED), refusals[case]
    assert said in refusals[case]


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("job_env_bad_name", "job_environment has names an environment variable cannot have: "),
        ("job_env_line_break", "job_environment.X holds a line break (or a NUL)"),
        ("job_cluster_env_line_break", "cluster_environment.NCCL_DEBUG holds a line break"),
    ],
)
def test_the_job_refuses_an_environment_its_env_file_cannot_hold(
    refusals: dict[str, str], case: str, said: str
) -> None:
    assert refusals[case].startswith(ENV_REFUSED), refusals[case]
    assert said in refusals[case]


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("service_bad_name", 'got "serve 1"'),
        ("service_port_zero", "a port 1-65535 (got 0)"),
        ("service_no_command", "a command to run"),
        ("service_env_line_break", "service_environment.A holds a line break"),
    ],
)
def test_the_service_refuses_a_bad_request(refusals: dict[str, str], case: str, said: str) -> None:
    assert refusals[case].startswith(SERVICE_REFUSED), refusals[case]
    assert said in refusals[case]


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("secrets_relative_file", 'Secrets for "serve-1.env" (an absolute path)'),
        ("secrets_bad_name", "service_secret_environment has names an environment variable"),
        ("secrets_line_break", "service_secret_environment.HF_TOKEN holds a line break"),
    ],
)
def test_the_service_refuses_secrets_it_cannot_write_naming_no_value(
    refusals: dict[str, str], case: str, said: str
) -> None:
    assert said in refusals[case], refusals[case]
    assert SECRET not in refusals[case]


# ---- the master's ports: one list for the check before anything is written and for launch ----
PORT_CASES = {
    "several_nodes": ({"job_single_node": False}, [29500, 29499]),
    "one_node_job": ({"job_single_node": True}, [29500]),
    "no_watchdog": ({"job_single_node": False, "job_watchdog_port": 0}, [29500]),
}


def test_the_ports_checked_before_writing_are_the_ones_the_job_listens_on(
    tmp_path: Path,
) -> None:
    # roles/job's tasks_from: ports refused a busy watchdog port only at launch on a cluster of
    # one node (it checked master_port alone there, the job's specification both).
    hosts = {
        name: {**LOCAL, "job_master_port": 29500, "job_watchdog_port": 29499, **case}
        for name, (case, _) in PORT_CASES.items()
    }
    play = {
        "name": "The job's master ports",
        "hosts": "all",
        "gather_facts": False,
        "vars_files": [str(ROOT / "roles" / "job" / "vars" / "main.yml")],
        "tasks": [{"name": "Show", "ansible.builtin.debug": {"msg": "{{ __job_master_ports }}"}}],
    }
    out = run_cases(tmp_path, {"all": {"hosts": hosts}}, [play])
    shown = dict(re.findall(r"^ok: \[(\S+)\] => (\{.*\})$", out, re.M))
    assert {name: json.loads(shown[name])["msg"] for name in PORT_CASES} == {
        name: ports for name, (_, ports) in PORT_CASES.items()
    }
