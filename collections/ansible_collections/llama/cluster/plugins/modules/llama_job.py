#!/usr/bin/python
"""Ansible module: one node's side of the llama-job supervisor contract."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import (
    RankStatus,
    got_going,
    leading,
)
from ansible_collections.llama.cluster.plugins.module_utils.trainer_log import (
    log_figures,
    parse_records,
    read_tail,
)

DOCUMENTATION = r"""
module: llama_job
short_description: Start, stop, follow and list llama-cluster jobs through llama-job
description:
  - Runs the node-side command C(llama-job) (installed by the job_supervisor role) and returns
    what it printed, unchanged (each rank's status is llama-job's C(RankStatus), whose shape is
    plugins/module_utils/llama_job/protocol.py), plus, for C(status) and C(wait), the rank that
    speaks for the job on this node and a progress line for the play's output.
  - C(start) launches this node's agent of a job (a systemd transient unit, or a session of
    its own where systemd does not run); C(stop) ends it; C(status) and C(list) report;
    C(wait) returns once the job runs (O(until=running)) or has ended (O(until=ended)), or
    after O(timeout) seconds, so that a task can poll it with C(until) and print progress;
    C(ports) says who listens on TCP ports.
  - The role C(job) is the usual way in; the filter C(llama.cluster.job_status) turns every
    node's C(status) into the job's status across the cluster.
options:
  action:
    description: The verb.
    type: str
    required: true
    choices: [start, stop, status, list, wait, ports]
  job:
    description: The job id (stop, status, wait).
    type: str
  spec:
    description: The job's specification file on this node (start).
    type: path
  user:
    description: The account the job runs as (start).
    type: str
  group:
    description: Its group (start).
    type: str
    default: ""
  supervisor:
    description: systemd, process (a session of its own) or auto (systemd where it runs).
    type: str
    choices: [auto, systemd, process]
    default: auto
  until:
    description: What C(wait) waits for.
    type: str
    choices: [running, ended]
    default: ended
  timeout:
    description: Seconds C(wait) waits at most, or C(stop) gives the processes to end.
    type: float
    default: 15
  active:
    description: C(list) only the jobs that still run.
    type: bool
    default: false
  ports:
    description: TCP ports for C(ports).
    type: list
    elements: int
    default: []
  progress_file:
    description:
      - Rank 0's trainer log on this node, for C(status); its last attempt's figures come back
        as RV(trainer_log). Empty, or a file this node does not have, for none.
    type: path
    default: ""
  bin:
    description: Path of llama-job on the node.
    type: path
    default: /usr/local/sbin/llama-job
author: llama-cluster
"""

EXAMPLES = r"""
- name: Start this node's part of a job (root)
  llama.cluster.llama_job:
    action: start
    spec: /opt/llama-cluster/runs/r1/env/node1.job.json
    user: llama
    group: llama

- name: Follow the job from its master until it has ended, a progress line per poll
  llama.cluster.llama_job:
    action: wait
    job: r1
    until: ended
    timeout: 15
  register: watched
  until: watched.done
  retries: 40320
  delay: 0

- name: Ask this node how the job stands
  llama.cluster.llama_job:
    action: status
    job: r1
    progress_file: /opt/llama-cluster/runs/r1/output/trainer_log.jsonl
  register: status
# status.lead.phase: running; status.progress: "step 12/70 (17%)  loss 1.2346  eta 0:01:00"

- name: Who holds the master's ports
  llama.cluster.llama_job:
    action: ports
    ports: [29500, 29499]
"""

RETURN = r"""
ranks:
  description:
    - Each rank of the job on this node, as llama-job printed it (status, wait, stop); the
      shape is roles/job/README.md's RANK (protocol.py RankStatus).
  type: list
  elements: dict
  returned: when action is status, wait or stop
jobs:
  description: Every job on this node, a RANK each (list).
  type: list
  elements: dict
  returned: when action is list
lead:
  description:
    - The rank whose view speaks for the job on this node (the master's, else the first), as
      in RV(ranks); null when the job is not here.
  type: dict
  returned: when action is status or wait
progress:
  description: One human-readable line from RV(lead) (status and wait).
  type: str
  returned: when action is status or wait
got_going:
  description:
    - Whether the job is here and did not fail or stop before it ran (what the role checks after
      C(wait) with O(until=running)).
  type: bool
  returned: when action is status or wait
done:
  description: For wait, whether what was waited for happened.
  type: bool
  returned: when action is status or wait
trainer_log:
  description:
    - For status with O(progress_file), what the last attempt's records of the trainer log say
      (last_step, total_steps, final_loss, elapsed, records); {} without one.
  type: dict
  returned: when action is status
free:
  description: For ports, whether every port is free; RV(listeners) and RV(busy) say who holds one.
  type: bool
  returned: when action is ports
listeners:
  description: For ports, each listener (port, pid, user, command).
  type: list
  elements: dict
  returned: when action is ports
busy:
  description: For ports, one line per taken port as C(start) would refuse it.
  type: list
  elements: str
  returned: when action is ports
"""


def trainer_log(path: str) -> dict[str, Any]:
    """The last attempt's figures of the trainer log at `path`; {} when there is none here."""
    if not path:
        return {}
    try:
        text = read_tail(path)
    except OSError:
        return {}
    return log_figures(parse_records(text))


def main() -> None:
    """Entry point."""
    module = AnsibleModule(
        argument_spec={
            "action": {
                "type": "str",
                "required": True,
                "choices": ["start", "stop", "status", "list", "wait", "ports"],
            },
            "job": {"type": "str"},
            "spec": {"type": "path"},
            "user": {"type": "str"},
            "group": {"type": "str", "default": ""},
            "supervisor": {
                "type": "str",
                "choices": ["auto", "systemd", "process"],
                "default": "auto",
            },
            "until": {"type": "str", "choices": ["running", "ended"], "default": "ended"},
            "timeout": {"type": "float", "default": 15},
            "active": {"type": "bool", "default": False},
            "ports": {"type": "list", "elements": "int", "default": []},
            "progress_file": {"type": "path", "default": ""},
            "bin": {"type": "path", "default": "/usr/local/sbin/llama-job"},
        },
        required_if=[
            ("action", "start", ("spec", "user")),
            ("action", "stop", ("job",)),
            ("action", "status", ("job",)),
            ("action", "wait", ("job",)),
            ("action", "ports", ("ports",)),
        ],
        supports_check_mode=False,
    )
    params = module.params
    try:
        done = subprocess.run(argv_for(params), capture_output=True, text=True, check=False)
    except OSError as err:
        module.fail_json(
            msg=f"cannot run {params['bin']} on this node ({err}): jobs run under llama-job, "
            "which provisioning installs (ansible-playbook provision.yml, or --tags job_supervisor)"
        )
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    except ValueError:
        result = {}
    action = params["action"]
    if done.returncode != 0 or "error" in result:
        module.fail_json(
            msg=result.get("error") or f"llama-job {action} failed: {done.stderr.strip()[-2000:]}",
            rc=done.returncode,
        )
    module.exit_json(**reshape(result, params))


def argv_for(params: dict[str, Any]) -> list[str]:
    """The llama-job command line of a task's parameters."""
    action = params["action"]
    argv = [params["bin"], action]
    if action == "start":
        argv += ["--spec", params["spec"], "--user", params["user"]]
        argv += ["--group", params["group"], "--supervisor", params["supervisor"]]
    elif action in ("stop", "status", "wait"):
        argv += ["--job", params["job"]]
    if action == "wait":
        argv += ["--until", params["until"], "--timeout", str(params["timeout"])]
    if action == "stop":
        argv += ["--timeout", str(params["timeout"])]
    if action == "list" and params["active"]:
        argv.append("--active")
    for port in params["ports"] if action == "ports" else ():
        argv += ["--port", str(port)]
    return argv


def reshape(result: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """What llama-job printed, unchanged, with the task's changed; for status and wait the
    leading rank (the master's, protocol.leading) and its progress line, for wait whether the
    job got going, for status the trainer log's figures."""
    action = params["action"]
    result["changed"] = action == "start" or bool(action == "stop" and result.get("stopped"))
    if action in ("status", "wait"):
        ranks = [RankStatus.from_dict(r) for r in result.get("ranks") or [] if isinstance(r, dict)]
        lead = leading(ranks)
        result["lead"] = lead.to_dict() if lead else None
        result["progress"] = lead.progress_line() if lead else f"no job {params['job']} here"
        result["done"] = bool(result.get("reached")) if action == "wait" else True
        result["got_going"] = got_going(lead)
    if action == "status":
        result["trainer_log"] = trainer_log(params["progress_file"])
    return result


if __name__ == "__main__":
    main()
