"""llama-job's command line: the supervisor of llama-cluster's distributed jobs on one node.

One contract for every playbook and the agent, whether or not systemd runs the node:

    llama-job start  --spec FILE --user U --group G [--supervisor auto|systemd|process]
    llama-job stop   --job ID [--timeout S]
    llama-job status --job ID
    llama-job list   [--active]
    llama-job wait   --job ID --until running|ended [--timeout S]
    llama-job ports  --port P [--port P ...]
    llama-job rejoin                      (at boot: a worker's jobs it lost, started again)
    llama-job run    --spec FILE          (what the unit runs, as the job's user)

Every verb prints one JSON document on stdout (the shapes are in roles/job/README.md) and
exits 0, or 2 for a refused request (with {"error": ...}).

`start` (root) launches an agent, `llama-job run`, as the job's user (launchers.py). The agent
starts the job's command in its own process group and keeps a heartbeat with the agents of
the other nodes (a star around the master's agent, over authenticated TCP on the watchdog
port: link.py): whatever ends one node's command, a node that stops answering, or a run that
stops making progress, ends the command on every node, and the master's agent records why
(master.py, worker.py). With restarts allowed it starts the command again on every node once
every node is back.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from . import control
from .master import MasterAgent
from .spec import Refused, load_spec
from .worker import WorkerAgent


def cmd_run(args: argparse.Namespace) -> int:
    """`run --spec FILE`: this node's agent (what the unit runs, as the job's user)."""
    spec = load_spec(args.spec, require_root=False)
    return (MasterAgent(spec) if spec.is_master else WorkerAgent(spec)).run()


def parser() -> argparse.ArgumentParser:
    """The command line."""
    top = argparse.ArgumentParser(prog="llama-job", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="verb", required=True)
    start = sub.add_parser("start", help="launch this node's agent of a job (root)")
    start.add_argument("--spec", required=True)
    start.add_argument("--user", required=True)
    start.add_argument("--group", default="")
    start.add_argument("--supervisor", choices=["auto", "systemd", "process"], default="auto")
    run = sub.add_parser("run", help="this node's agent (what the unit runs)")
    run.add_argument("--spec", required=True)
    stop = sub.add_parser("stop", help="stop this node's part of a job (root)")
    stop.add_argument("--job", required=True)
    stop.add_argument("--timeout", type=float, default=20.0)
    status = sub.add_parser("status", help="this node's part of a job, as JSON")
    status.add_argument("--job", required=True)
    listing = sub.add_parser("list", help="every job on this node, as JSON")
    listing.add_argument("--active", action="store_true")
    wait = sub.add_parser("wait", help="status once a job runs or has ended")
    wait.add_argument("--job", required=True)
    wait.add_argument("--until", choices=["running", "ended"], default="ended")
    wait.add_argument("--timeout", type=float, default=15.0)
    ports = sub.add_parser("ports", help="who listens on TCP ports")
    ports.add_argument("--port", type=int, action="append", required=True)
    sub.add_parser("rejoin", help="start again the jobs this node lost without ending them (root)")
    return top


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "start": control.cmd_start,
    "run": cmd_run,
    "stop": control.cmd_stop,
    "status": control.cmd_status,
    "list": control.cmd_list,
    "wait": control.cmd_wait,
    "ports": control.cmd_ports,
    "rejoin": control.cmd_rejoin,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parser().parse_args(argv)
    try:
        return VERBS[args.verb](args)
    except Refused as err:
        control.emit({"error": str(err)})
        return 2


if __name__ == "__main__":
    sys.exit(main())
