"""Detection and stop times of the faults the cluster stops by itself, on 2 and 4 lab nodes.

    python bench/faults.py                                   2 and 4 nodes, every fault
    python bench/faults.py --nodes 2 --faults worker-process node-kill

Starts lab containers of its own (the node image, the training stack mounted read-only from
$LLAMA_CLUSTER_TRAIN_VENV, as molecule's train scenario does), prepares them with
molecule/shared/prepare.yml and playbooks/wiring.yml, then for each fault starts a watched
train.yml of the tiny model, injects the fault at step 12 on the last node (or rank 0) and measures

    detected: fault -> the master's runner leaves `running` (llama-job status, polled)
    stopped:  fault -> no training process left on any node still up

and writes bench/results/faults.md (the table and the commands). A benchmark, not a test: it
asserts nothing; the bounds are asserted by molecule/train/tests/test_train.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "llama-cluster-node:bookworm-2"
LONG_RUN = {"train_args": {"num_train_epochs": 10, "save_steps": 5}}
FAULTS = ("worker-process", "rank0-process", "controller-kill", "node-freeze", "node-kill")
BOUNDS = {
    "worker-process": 30,
    "rank0-process": 30,
    "controller-kill": 30,
    "node-freeze": 120,
    "node-kill": 60,
}
WHAT = {
    "worker-process": "the last worker's training process killed (kill -9)",
    "rank0-process": "rank 0's training process killed (kill -9)",
    "controller-kill": "ansible-playbook SIGKILLed, then the last worker's training process killed",
    "node-freeze": "the last worker frozen (docker pause)",
    "node-kill": "the last worker killed (docker kill)",
}


def sh(*argv: str, check: bool = False, timeout: float = 120) -> str:
    """Run a command; its stdout."""
    done = subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)
    return done.stdout


def on(node: str, command: str) -> str:
    """A shell command inside a lab node."""
    return sh("docker", "exec", node, "sh", "-c", command)


class Lab:
    """N containers like molecule's train scenario, with an inventory of their own."""

    def __init__(self, prefix: str, count: int, venv: str) -> None:
        self.names = [f"{prefix}-bench{count}-node{i}" for i in range(1, count + 1)]
        self.network = f"{prefix}-bench{count}"
        self.venv = venv
        self.dir = ROOT / ".cache" / f"bench-faults-{count}"
        self.inventory = self.dir / "inventory.yml"

    def up(self) -> None:
        self.down()
        sh("docker", "network", "create", self.network, check=True)
        for name in self.names:
            sh(
                "docker", "run", "-d", "--name", name, "--hostname", name,
                "--network", self.network, "--cap-add", "SYS_ADMIN", "--cap-add", "NET_ADMIN",
                "--cgroupns", "host", "--tmpfs", "/run", "--tmpfs", "/run/lock",
                "--tmpfs", "/tmp", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw",
                "-v", "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/host-ca.crt:ro",
                "-v", f"{self.venv}:/opt/venv-train:ro", IMAGE, "/sbin/init",
                check=True,
            )  # fmt: skip
        self.dir.mkdir(parents=True, exist_ok=True)
        host = {"ansible_connection": "community.docker.docker"}
        inventory = {
            "all": {
                "children": {
                    "cluster": {
                        "children": {
                            "master": {"hosts": {self.names[0]: host}},
                            "workers": {"hosts": dict.fromkeys(self.names[1:], host)},
                        }
                    }
                }
            }
        }
        self.inventory.write_text(json.dumps(inventory, indent=2) + "\n")
        link = self.dir / "group_vars"
        if not link.exists():
            link.symlink_to(ROOT / "molecule" / "shared" / "group_vars")
        for playbook in ("molecule/shared/prepare.yml", "playbooks/wiring.yml"):
            done = self.play(playbook)
            if done.returncode != 0:
                sys.exit(f"{playbook} failed:\n{done.stdout[-3000:]}")

    def down(self) -> None:
        for name in self.names:
            sh("docker", "rm", "-f", name)
        sh("docker", "network", "rm", self.network)

    def play(self, playbook: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ansible-playbook", "-i", str(self.inventory), playbook, *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
            env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
        )

    def revive(self, name: str) -> None:
        sh("docker", "start", name)
        for _ in range(120):
            if on(name, "systemctl is-system-running 2>/dev/null").strip() in (
                "running",
                "degraded",
            ):
                break
            time.sleep(1)
        on(name, "sysctl -w net.ipv4.ip_local_port_range='40000 40999' >/dev/null")


def runs(lab: Lab) -> list[str]:
    listing = on(lab.names[0], "ls /opt/llama-cluster/runs 2>/dev/null").split()
    return sorted(r for r in listing if r.startswith("train-"))


def step(lab: Lab, run_id: str) -> int:
    text = on(lab.names[0], f"cat /opt/llama-cluster/runs/{run_id}/output/trainer_log.jsonl")
    return max((json.loads(x)["current_steps"] for x in text.splitlines() if x.strip()), default=0)


def training(node: str) -> list[int]:
    out = on(node, "ps -eo pid=,args=")
    return [int(x.split()[0]) for x in out.splitlines() if "llamafactory" in x or "torchrun" in x]


def master_phase(lab: Lab, run_id: str) -> str:
    text = on(lab.names[0], f"/usr/local/sbin/llama-job status --job {run_id}")
    ranks = json.loads(text or "{}").get("ranks") or [{}]
    return ranks[0].get("phase", "?")


def inject(lab: Lab, fault: str, play: subprocess.Popen) -> tuple[str, list[str]]:
    """Break the run; the victim and the nodes still up."""
    victim = lab.names[0] if fault == "rank0-process" else lab.names[-1]
    up = list(lab.names)
    if fault == "controller-kill":
        play.send_signal(signal.SIGKILL)
        play.wait()
    if fault in ("worker-process", "rank0-process", "controller-kill"):
        ranks = [
            int(line.split()[0])
            for line in on(victim, "ps -eo pid=,args=").splitlines()
            if "launcher.py" in line and "torchrun" not in line
        ]
        on(victim, f"kill -9 {min(ranks)}")
    elif fault == "node-freeze":
        sh("docker", "pause", victim)
        up.remove(victim)
    elif fault == "node-kill":
        sh("docker", "kill", victim)
        up.remove(victim)
    return victim, up


def measure(lab: Lab, fault: str) -> dict[str, object]:
    """One fault on a fresh watched run; the seconds to detection and to every rank stopped."""
    before = runs(lab)
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    play = subprocess.Popen(
        ["ansible-playbook", "-i", str(lab.inventory), "train.yml", "-e", "model=tiny",
         "-e", json.dumps(LONG_RUN)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    run_id = ""
    while play.poll() is None:
        fresh = [r for r in runs(lab) if r not in before]
        if fresh and step(lab, fresh[-1]) >= 12:
            run_id = fresh[-1]
            break
        time.sleep(1)
    if not run_id:
        return {"fault": fault, "error": Path(log.name).read_text()[-2000:]}
    victim, up = inject(lab, fault, play)
    fault_at = time.monotonic()
    detected = stopped = None
    while time.monotonic() - fault_at < 300 and stopped is None:
        now = time.monotonic() - fault_at
        if detected is None and master_phase(lab, run_id) != "running":
            detected = now
        if not any(training(node) for node in up):
            stopped = now
        time.sleep(0.2)
    if play.poll() is None:
        play.wait(timeout=600)
    if fault == "node-freeze":
        sh("docker", "unpause", victim)
    if fault == "node-kill":
        lab.revive(victim)
    reason = json.loads(
        on(lab.names[0], f"/usr/local/sbin/llama-job status --job {run_id}") or "{}"
    )
    verdict = ((reason.get("ranks") or [{}])[0].get("reason")) or {}
    return {
        "fault": fault,
        "run_id": run_id,
        "detected_s": detected,
        "stopped_s": stopped,
        "bound_s": BOUNDS[fault],
        "verdict": f"{verdict.get('node')}: {verdict.get('kind')}",
    }


def main() -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--prefix", default=os.environ.get("LLAMA_MOLECULE_PREFIX", "bench"))
    parser.add_argument("--keep", action="store_true", help="leave the containers running")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "faults.md")
    args = parser.parse_args()
    venv = os.environ.get("LLAMA_CLUSTER_TRAIN_VENV")
    if not venv or not Path(venv).is_dir():
        sys.exit("set LLAMA_CLUSTER_TRAIN_VENV to the training venv (scripts/setup-train-venv.sh)")
    rows = []
    for count in args.nodes:
        lab = Lab(args.prefix, count, venv)
        started = time.monotonic()
        lab.up()
        print(f"{count} nodes ready in {time.monotonic() - started:.0f} s", flush=True)
        try:
            for fault in args.faults:
                row = {"nodes": count, **measure(lab, fault)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            if not args.keep:
                lab.down()
    lines = [
        "# Fault detection and stop times (bench/faults.py)",
        "",
        f"Command: `python bench/faults.py --nodes {' '.join(map(str, args.nodes))}` "
        "(LLAMA_CLUSTER_TRAIN_VENV set; tiny model, 70 steps, fault at step 12; lab containers "
        "on one 2-core machine). detected: fault -> the master's runner leaves `running`; "
        "stopped: fault -> no training process on any node still up.",
        "",
        "| nodes | fault | detected (s) | every rank stopped (s) | bound (s) | verdict |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:

        def fmt(value: object) -> str:
            return f"{value:.1f}" if isinstance(value, float) else "-"

        verdict = str(row.get("verdict", row.get("error", "")))[:80]
        lines.append(
            f"| {row['nodes']} | {WHAT[row['fault']]} | {fmt(row.get('detected_s'))} | "
            f"{fmt(row.get('stopped_s'))} | {row.get('bound_s', '-')} | {verdict} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
