"""Launch overhead of train.yml, the tiny run via train.yml vs by hand, and a no-op provision.

Measures, on a 2-node lab whose nodes are Docker containers (the lab or molecule/train):
  1. launch overhead: from `ansible-playbook train.yml` starting to every rank having joined the
     process group (LLaMA-Factory's "world size: N" line in each node's log), split into
     train.yml's part (to the moment llama-job started the command on the last node: its
     state file's started_s) and LLaMA-Factory's own start-up (from there to the line), with
     LLaMA-Factory's start-up by hand beside it;
  2. the whole tiny run via train.yml (validation, render, launch, watch, fetch, summary);
  3. the same training started by hand on the same nodes: the run directory train.yml rendered,
     copied, and `llamafactory-cli train` started on every node at once with the launcher's
     environment (as two terminals would), timed until every node's command exits;
  4. provision.yml re-run on the provisioned nodes (a no-op: its wall time and changed= per node),
     right after the runs above.
Prints a Markdown table with the load average before and after, and writes it to
bench/results/train_overhead.md (git-ignored; bench/README.md keeps the summary).

    python bench/train_overhead.py -i INVENTORY [--nodes N1,N2] [--repeat 1] [--no-provision]
        [--noop-nodes N1,...,N8 --noop-inventory INVENTORY8]   also a no-op provision of more nodes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = "/opt/llama-cluster/runs"
ENV_BIN = "/opt/llama-cluster/env/bin"


@dataclass
class Timing:
    """One train.yml run: seconds to all ranks joined, and to the play's end."""

    run_id: str
    joined_s: float
    total_s: float
    launched_s: float  # to llama-job starting the command on the last node


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def playbook(inventory: str, *args: str) -> tuple[float, str]:
    """Run ansible-playbook from the project root; its wall time and output (exit on failure)."""
    started = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", inventory, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
        check=False,
    )
    took = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"ansible-playbook {' '.join(args)} failed:\n{done.stdout[-3000:]}")
    return took, done.stdout


def provision_noop(inventory: str, nodes: list[str]) -> tuple[float, dict[str, int]]:
    """Re-run provision.yml: its wall time and each node's changed= count from the recap."""
    took, out = playbook(inventory, "provision.yml")
    recap = out.rsplit("PLAY RECAP", maxsplit=1)[-1]
    changed = {
        host: int(count)
        for host, count in re.findall(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", recap, re.M)
        if host in nodes
    }
    return took, changed


def node(name: str, command: str, check: bool = False) -> str:
    """Run a shell command in a node container and return its stdout."""
    done = subprocess.run(
        ["docker", "exec", name, "sh", "-c", command], capture_output=True, text=True, check=check
    )
    return done.stdout


def via_playbook(inventory: str, nodes: list[str]) -> Timing:
    """Time train.yml -e model=tiny: to all ranks joined, and to the end of the play."""
    before = set(node(nodes[0], f"ls {RUNS}").split())
    started = time.monotonic()
    epoch = time.time()
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            "-i",
            inventory,
            "train.yml",
            "-e",
            "model=tiny",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    joined = 0.0
    run_id = ""
    while proc.poll() is None:
        if not run_id:
            fresh = sorted(set(node(nodes[0], f"ls {RUNS}").split()) - before)
            run_id = fresh[-1] if fresh else ""
        elif not joined:
            logs = [node(n, f"cat {RUNS}/{run_id}/logs/{n}.log 2>/dev/null") for n in nodes]
            if all(re.search(r"world size: \d+", log) for log in logs):
                joined = time.monotonic() - started
        time.sleep(0.5)
    total = time.monotonic() - started
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        sys.exit(f"train.yml failed:\n{output[-3000:]}")
    states = [json.loads(node(n, f"cat {RUNS}/{run_id}/state/{n}.json") or "{}") for n in nodes]
    launched = max(state.get("started_s", 0.0) for state in states) - epoch
    return Timing(run_id, joined, total, launched)


def by_hand(
    run_id: str, nodes: list[str], master_addr: str, port: int = 29500
) -> tuple[float, float]:
    """Run the same training by hand on every node at once: seconds until every rank has
    joined (its "world size" line), and until every node's command has exited."""
    copy = f"{RUNS}/byhand-{run_id}"
    for name in nodes:
        node(
            name,
            f"rm -rf {copy} && mkdir -p {copy}/output && cp -r {RUNS}/{run_id}/data {copy}/ && "
            f"sed 's#{RUNS}/{run_id}#{copy}#g' {RUNS}/{run_id}/train.yaml > {copy}/train.yaml && "
            f"chown -R llama: {copy}",
            check=True,
        )
    launch = (
        "FORCE_TORCHRUN=1 NNODES={nnodes} NODE_RANK={rank} NPROC_PER_NODE=1 MASTER_ADDR={addr} "
        f"MASTER_PORT={port} PATH={ENV_BIN}:/usr/bin:/bin "
        f"exec {ENV_BIN}/llamafactory-cli train {copy}/train.yaml > {copy}/hand.log 2>&1"
    )
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                "docker",
                "exec",
                "-u",
                "llama",
                "-w",
                copy,
                name,
                "sh",
                "-c",
                launch.format(nnodes=len(nodes), rank=rank, addr=master_addr),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank, name in enumerate(nodes)
    ]
    joined = 0.0
    while any(p.poll() is None for p in procs):
        if not joined:
            logs = [node(n, f"cat {copy}/hand.log 2>/dev/null") for n in nodes]
            if all(re.search(r"world size: \d+", log) for log in logs):
                joined = time.monotonic() - started
        time.sleep(0.5)
    elapsed = time.monotonic() - started
    codes = [p.returncode for p in procs]
    for name in nodes:
        node(name, f"rm -rf {copy}")
    if any(codes):
        sys.exit(f"the run by hand failed: exit codes {codes}")
    return joined, elapsed


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-i", "--inventory", default=str(ROOT / "inventory/lab.yml"))
    parser.add_argument("--nodes", default="llama-lab-node1,llama-lab-node2")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--no-provision", action="store_true", help="skip the no-op provision")
    parser.add_argument("--noop-inventory", help="inventory of more lab nodes, for a no-op too")
    parser.add_argument("--noop-nodes", default="", help="those nodes, comma-separated")
    args = parser.parse_args()
    nodes = args.nodes.split(",")
    master_addr = node(nodes[0], "hostname -I").split()[0]
    load_before = load()

    rows = []
    for _ in range(args.repeat):
        timing = via_playbook(args.inventory, nodes)
        hand_joined, hand = by_hand(timing.run_id, nodes, master_addr)
        rows.append((timing, hand_joined, hand))
        print(
            f"{timing.run_id}: launched {timing.launched_s:.1f} s, joined {timing.joined_s:.1f} s,"
            f" play {timing.total_s:.1f} s; by hand joined {hand_joined:.1f} s, {hand:.1f} s",
            flush=True,
        )
    noops = []
    if not args.no_provision:
        noops.append((nodes, provision_noop(args.inventory, nodes)))
    if args.noop_inventory:
        more = args.noop_nodes.split(",")
        noops.append((more, provision_noop(args.noop_inventory, more)))

    table = [
        "| run | train.yml start -> launched on every node (s) | LLaMA-Factory start-up: launched"
        " -> all ranks joined (s) | by hand: start -> all ranks joined (s) | train.yml start ->"
        " all ranks joined (s) | whole run via train.yml (s) | same run by hand (s) |"
        " via train.yml / by hand |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {t.run_id} | {t.launched_s:.1f} | {t.joined_s - t.launched_s:.1f} | {hj:.1f} "
        f"| {t.joined_s:.1f} | {t.total_s:.1f} | {h:.1f} | {t.total_s / h:.2f}x |"
        for t, hj, h in rows
    ]
    for names, (took, changed) in noops:
        counts = ", ".join(f"{host} changed={n}" for host, n in sorted(changed.items()))
        table += [
            "",
            f"| provision.yml no-op, {len(names)} nodes (s) | changed per node |",
            "|---|---|",
            f"| {took:.1f} | {counts} |",
        ]
    table += ["", f"Load average (1, 5, 15 min): {load_before} before, {load()} after."]
    text = "\n".join(table) + "\n"
    print(text)
    out = ROOT / "bench/results/train_overhead.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"Nodes: {', '.join(nodes)} (inventory {args.inventory})\n\n{text}")


if __name__ == "__main__":
    main()
