#!/usr/bin/python
"""Ansible module: watch one distributed job from its master node."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_job_watch
short_description: Watch a llama-cluster job on every node from the master node
description:
  - Runs on the master node. Reads the state of the job's systemd unit on this node and, over
    the cluster's own SSH mesh, on every other node, and the progress that rank 0 writes.
  - Returns after O(report_every) seconds, or as soon as the job finished, a node failed or a
    node stopped answering, so that a task can poll it with C(until) and print progress.
  - With O(wait_port), returns as soon as the port listens on this node (rank 0 is up) or the
    local unit has failed.
options:
  host:
    description: This node's inventory name, used as its key in the result.
    type: str
    required: true
  unit:
    description: This node's systemd unit, or its state file when O(supervisor=process).
    type: str
    required: true
  supervisor:
    description: How the job is supervised on every node.
    type: str
    choices: [systemd, process]
    default: systemd
  peers:
    description:
      - The other nodes, each with C(host) (inventory name), C(address) and C(unit).
      - A peer whose C(address) is a loopback address shares this machine and is read locally.
    type: list
    elements: dict
    default: []
  wait_port:
    description: Return once this TCP port accepts connections here.
    type: int
  progress_file:
    description: JSON-lines trainer log of rank 0 (LLaMA-Factory's trainer_log.jsonl).
    type: path
  report_every:
    description: Seconds after which to return with the current progress.
    type: int
    default: 15
  interval:
    description: Seconds between two looks at the nodes.
    type: int
    default: 2
  ssh_timeout:
    description: Seconds to wait for a peer over SSH before calling it unreachable.
    type: int
    default: 10
author: llama-cluster
"""

RETURN = r"""
done:
  description: True when every node finished or one of them failed or disappeared.
  type: bool
failed_hosts:
  description: Nodes whose unit failed or that could not be reached.
  type: list
states:
  description: Per node, the unit's state (running, succeeded, failed, missing, unreachable).
  type: dict
progress:
  description: One human-readable progress line, or an empty string.
  type: str
progress_data:
  description: The last trainer log record (step, total_steps, loss, lr, epoch, ...).
  type: dict
"""

UNIT_PROPERTIES = (
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainStatus",
    "ExecMainExitTimestamp",
)


def parse_show(text: str) -> dict[str, str]:
    """Parse `systemctl show -p ...` output into a dict."""
    props = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props[key] = value
    return props


def classify(props: dict[str, str]) -> str:
    """Map systemd unit properties to one job state."""
    if props.get("LoadState") != "loaded":
        return "missing"
    active, sub = props.get("ActiveState"), props.get("SubState")
    if active == "failed" or props.get("Result", "success") != "success":
        return "failed"
    if active == "active" and sub == "exited":
        return "succeeded" if props.get("ExecMainStatus", "0") == "0" else "failed"
    if active in {"active", "activating", "reloading"}:
        return "running"
    if active == "deactivating":
        return "stopping"
    return "missing"


def show_command(unit: str) -> list[str]:
    """The read-only systemctl call that reports a unit's state."""
    props = (f"--property={p}" for p in UNIT_PROPERTIES)
    return ["systemctl", "show", unit, "--no-pager", "--timestamp=us+utc", *props]


# Reads a llama-supervise state file and notices a supervisor that died without a word.
PROCESS_PROBE = """
import json, os, sys
try:
    state = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    state = {}
if state.get("state") == "running" and not os.path.exists("/proc/%d" % state["pid"]):
    state.update(state="failed", error="its supervisor vanished")
print(json.dumps(state))
"""


def probe_command(unit: str, supervisor: str) -> list[str]:
    """The read-only command that reports a job's state on a node."""
    if supervisor == "process":
        return ["python3", "-c", PROCESS_PROBE, unit]
    return show_command(unit)


def interpret(stdout: str, supervisor: str) -> dict[str, Any]:
    """One node's state from its probe's output."""
    if supervisor == "process":
        try:
            info = json.loads(stdout or "{}")
        except ValueError:
            info = {}
        result = {"state": info.get("state", "missing")}
        if "exit_status" in info:
            result["ExecMainStatus"] = str(info["exit_status"])
        if "ended" in info:
            result["ExecMainExitTimestamp"] = info["ended"]
        if "error" in info:
            result["error"] = info["error"]
        return result
    props = parse_show(stdout)
    return {"state": classify(props), **props}


def local_state(unit: str, supervisor: str) -> dict[str, Any]:
    """State of the job on this node."""
    out = subprocess.run(
        probe_command(unit, supervisor), capture_output=True, text=True, check=False
    )
    return interpret(out.stdout, supervisor)


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1: a logical node on this very machine."""
    return address.startswith("127.") or address in {"::1", "localhost"}


def peer_state(peer: dict[str, Any], ssh_timeout: int, supervisor: str) -> dict[str, Any]:
    """State of a peer's job, read over the cluster SSH mesh."""
    if is_loopback(peer["address"]):
        return local_state(peer["unit"], supervisor)
    ssh = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={ssh_timeout}",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=2",
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath=/tmp/llama-watch-{os.getuid()}-%C",
        "-o",
        "ControlPersist=120",
        peer["address"],
        "--",
        *(shlex.quote(arg) for arg in probe_command(peer["unit"], supervisor)),
    ]
    try:
        out = subprocess.run(
            ssh, capture_output=True, text=True, check=False, timeout=ssh_timeout * 3
        )
    except subprocess.TimeoutExpired:
        return {"state": "unreachable", "error": "ssh timed out"}
    if out.returncode != 0:
        return {"state": "unreachable", "error": out.stderr.strip()[-300:]}
    return interpret(out.stdout, supervisor)


def exit_order(state: dict[str, Any]) -> str:
    """Sort key that puts the node that failed first first (vanished nodes before all)."""
    stamp = state.get("ExecMainExitTimestamp", "")
    # "Mon 2026-11-30 01:02:03.123456 UTC": drop the weekday so the text sorts by time.
    return stamp.split(" ", 1)[1] if " " in stamp else ""


def port_listens(port: int) -> bool:
    """True when something accepts TCP connections on this node's port."""
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(1)
                if sock.connect_ex((address, port)) == 0:
                    return True
        except OSError:
            continue
    return False


def last_record(path: str | None) -> dict[str, Any]:
    """The last complete JSON line of the trainer log, or {}."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 8192))
        lines = handle.read().decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def describe(record: dict[str, Any]) -> str:
    """One progress line from a trainer log record."""
    if not record:
        return ""
    parts = [f"step {record.get('current_steps', '?')}/{record.get('total_steps', '?')}"]
    if "percentage" in record:
        parts[0] += f" ({record['percentage']:.0f}%)"
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.2e}")
    if record.get("throughput"):
        parts.append(f"{record['throughput']:.0f} tokens/s")
    if record.get("elapsed_time"):
        parts.append(f"elapsed {record['elapsed_time']}")
    if record.get("remaining_time"):
        parts.append(f"eta {record['remaining_time']}")
    return "  ".join(parts)


def look(module: AnsibleModule, pool: ThreadPoolExecutor) -> dict[str, dict[str, Any]]:
    """The state of every node's unit, this one included."""
    params = module.params
    supervisor = params["supervisor"]
    states = {params["host"]: local_state(params["unit"], supervisor)}
    futures = {
        peer["host"]: pool.submit(peer_state, peer, params["ssh_timeout"], supervisor)
        for peer in params["peers"]
    }
    for host, future in futures.items():
        states[host] = future.result()
    return states


def main() -> None:
    """Entry point."""
    module = AnsibleModule(
        argument_spec={
            "host": {"type": "str", "required": True},
            "unit": {"type": "str", "required": True},
            "supervisor": {
                "type": "str",
                "choices": ["systemd", "process"],
                "default": "systemd",
            },
            "peers": {"type": "list", "elements": "dict", "default": []},
            "wait_port": {"type": "int"},
            "progress_file": {"type": "path"},
            "report_every": {"type": "int", "default": 15},
            "interval": {"type": "int", "default": 2},
            "ssh_timeout": {"type": "int", "default": 10},
        },
        supports_check_mode=False,
    )
    params = module.params
    deadline = time.monotonic() + params["report_every"]
    wait_port = params["wait_port"]
    with ThreadPoolExecutor(max_workers=min(16, len(params["peers"]) + 1)) as pool:
        while True:
            if wait_port is not None:
                states = {params["host"]: local_state(params["unit"], params["supervisor"])}
                listening = port_listens(wait_port)
            else:
                states = look(module, pool)
                listening = False
            values = [s["state"] for s in states.values()]
            failed = [h for h, s in states.items() if s["state"] in {"failed", "unreachable"}]
            if wait_port is None and "missing" in values:
                # A unit that vanished while others still run was stopped or never started.
                failed += [h for h, s in states.items() if s["state"] == "missing"]
            failed.sort(key=lambda host: exit_order(states[host]))
            finished = all(v == "succeeded" for v in values)
            done = bool(failed) or finished or listening
            if wait_port is not None and states[params["host"]]["state"] != "running":
                done = True
                if not failed and not listening:
                    failed = [params["host"]]
            if done or time.monotonic() >= deadline:
                break
            time.sleep(params["interval"])

    record = last_record(params["progress_file"])
    summary = ", ".join(f"{host} {state['state']}" for host, state in states.items())
    module.exit_json(
        changed=False,
        done=done,
        finished=finished,
        listening=listening,
        failed_hosts=failed,
        states=states,
        progress=describe(record) or summary,
        progress_data=record,
    )


if __name__ == "__main__":
    main()
