"""What the train scenario's test modules share: the nodes and their names, the playbooks run as a
user runs them, and the looks at the nodes (their training processes, their runs, their jobs)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.fault_timings import record_fault

ROOT = Path(__file__).resolve().parents[3]
# Container names carry a prefix so that two checkouts can run the scenario side by side.
PREFIX = os.environ.get("LLAMA_MOLECULE_PREFIX", "mol")
NODES = (f"{PREFIX}-train-node1", f"{PREFIX}-train-node2")
MASTER, WORKER = NODES
RUNS = "/opt/llama-cluster/runs"
LLAMA_JOB = "/usr/local/sbin/llama-job"
# A run long enough to be broken mid-way: 28 samples / (2 per device x 2 ranks) = 7 steps per
# epoch, 140 steps, a checkpoint every 5. A rank is killed right after checkpoint-10 is saved on
# its node; the other faults come once rank 0 has logged step 12. The tiny run takes 10-20 s
# from there to its end on the 2-core CI machine, so every fault finds it still running. Every
# checkpoint is kept (the plan's default keeps the latest 3, and the kills wait for checkpoint-10,
# which would be gone within seconds).
LONG_RUN = {"train_args": {"num_train_epochs": 20, "save_steps": 5, "save_total_limit": 100}}
LONG_RUN_STEPS = 140
FAULT_STEP = 12
FAULT_CHECKPOINT = 10
COMMON_CHECKPOINT = 10  # the healing run's: node2 loses its checkpoint-15 before the kill
# The bounds, from the fault to every rank stopped on every node still up.
RANK_DIES_S = 30
NODE_KILLED_S = 60
NODE_FROZEN_MIN_S = 120
# The worker's memory in the host-memory test: above what the node needs before launch (systemd,
# sshd, Ansible's modules: about 50 MiB), below what the launchers and a rank of the tiny model
# need (resident: llamafactory-cli 0.8 GiB, torchrun 0.55 GiB, a rank 0.75 GiB on the lab).
HOST_LIMIT_MIB = 768
RANK_DIES_BOUND = (
    "a second or two (the agent's 0.2 s loop, one message to the other node) + "
    "job_stop_timeout (10 s) to SIGKILL; 30 s leaves room for a loaded 2-core machine"
)
# A node that loses power sends nothing and closes nothing: the others give it up after
# job_peer_timeout of silence (the last message they heard came before the cut, so at most that
# long after it), and it gives them up the same way; then SIGTERM, SIGKILL after
# job_stop_timeout. The bound is that sum from the run's own spec, plus this much for a loaded
# 2-core machine (the agents' 0.2 s loop, the ranks' exit, this test's docker exec polling).
POWER_LOSS_SLACK_S = 15
# A watching play ends this soon after the master's verdict (the failure's at_s): the node its
# agent gave up is asked nothing more (roles/job's job_gone), so what is left is asking the live
# node, stopping it, fetching its log and listing its checkpoints (issue 40: four tasks each
# waited about 30 s on the dead node, 2 min 40 s in all).
PLAY_AFTER_VERDICT_S = 15

# Every fault test's measurement, with its bound and how the bound is derived, lands in one
# file (tests/support/fault_timings.py: .cache/fault_timings.json): docs/faults.md's table was read
# there.

_state: dict[str, str] = {}
_timings: dict[str, float] = {}


def _inventory() -> str:
    path = os.environ.get("MOLECULE_INVENTORY_FILE")
    if not path:
        pytest.skip("runs under molecule verify (MOLECULE_INVENTORY_FILE is not set)")
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"}


def _node(node: str, command: str, timeout: float = 60) -> str:
    done = subprocess.run(
        ["docker", "exec", node, "sh", "-c", command],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    return done.stdout


def _said(output: str) -> str:
    """The play's output with the YAML callback's line wrapping undone."""
    return " ".join(output.split())


def _run_id(output: str) -> str:
    match = re.search(r"Run (train-\d{8}-\d{6}-[\w-]+)", output)
    assert match, f"no run id in the play's output:\n{output[-3000:]}"
    return match.group(1)


def _playbook(playbook: str, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ansible-playbook", "-i", _inventory(), playbook, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # failures are reported on stderr
        text=True,
        env=_env(),
        check=False,
        timeout=timeout,
    )


class Play:
    """An ansible-playbook running in the background, its output in a file (never a full pipe)."""

    def __init__(self, playbook: str, *extra: str) -> None:
        self.out = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            ["ansible-playbook", "-i", _inventory(), playbook, *extra],
            cwd=ROOT,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
        )

    def output(self) -> str:
        return Path(self.out.name).read_text()

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the play did not end within {timeout:.0f} s:\n{self.output()[-4000:]}")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.output())


def _runs() -> list[str]:
    return sorted(
        r for r in _node(MASTER, f"ls {RUNS} 2>/dev/null").split() if r.startswith("train-")
    )


def _current_step(run_id: str) -> int:
    lines = _node(MASTER, f"cat {RUNS}/{run_id}/output/trainer_log.jsonl 2>/dev/null")
    steps = [json.loads(line)["current_steps"] for line in lines.splitlines() if line.strip()]
    return max(steps, default=0)


def _wait_for_new_run(play: Play | None, before: list[str], step: int = FAULT_STEP) -> str:
    """The run started after `before`, once rank 0 has logged `step`."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        fresh = [r for r in _runs() if r not in before]
        if fresh and _current_step(fresh[-1]) >= step:
            return fresh[-1]
        if play is not None and play.proc.poll() is not None:
            pytest.fail(
                f"the play ended before the run reached step {step}:\n{play.output()[-4000:]}"
            )
        time.sleep(1)
    pytest.fail(f"no run reached step {step} within 900 s")


def _training_pids(node: str) -> list[int]:
    """PIDs of a node's ranks: LLaMA-Factory's workers that torchrun started (not torchrun)."""
    out = _node(node, "ps -eo pid=,args=")
    return [
        int(line.split()[0])
        for line in out.splitlines()
        if "launcher.py" in line and "torchrun" not in line
    ]


def _training_processes(nodes: tuple[str, ...] = NODES) -> dict[str, str]:
    """Every process of a run left on the given nodes (launcher, torchrun, workers)."""
    found = {}
    for node in nodes:
        out = _node(node, "ps -eo pid=,args= | grep -E 'llamafactory|torchrun' | grep -v grep")
        if out.strip():
            found[node] = out
    return found


def _time_until_stopped(since: float, nodes: tuple[str, ...], bound: float) -> float:
    """Seconds from `since` until no training process is left on `nodes` (fails past 2x bound)."""
    while time.monotonic() - since < bound * 2:
        if not _training_processes(nodes):
            return time.monotonic() - since
        time.sleep(0.5)
    left = _training_processes(nodes)
    pytest.fail(f"training processes still run {bound * 2:.0f} s after the fault: {left}")


def _children(pid: int) -> list[int]:
    """Every descendant of a controller process (ansible-playbook's forks)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [child for child, up in parents.items() if up == parent]
        found += kids
        frontier += kids
    return found


def _kill_training_process(
    node: str, run_id: str, checkpoint: int = FAULT_CHECKPOINT, first: str = ""
) -> float:
    """SIGKILL one of `node`'s ranks as soon as `checkpoint` is saved on that node (after the
    shell command `first`, when given); the moment of the kill, on this machine's monotonic clock.

    The wait and the kill are one shell on the node, so no round trip from here lies between
    them. Containers share this machine's clock: the node's `date` at the kill is our time."""
    # The save counts once its marker is written (after every file was synced).
    saved = f"{RUNS}/{run_id}/output/checkpoint-{checkpoint}/llama_job_saved.json"
    script = (
        f"i=0; until [ -f {saved} ]; do i=$((i + 1)); [ $i -gt 3000 ] && exit 3; sleep 0.1; done; "
        + (f"{first}; " if first else "")
        # [l] keeps this shell's own command line out of the match.
        + "set -- $(ps -eo pid=,args= | grep '[l]auncher[.]py' | grep -v torchrun); "
        + '[ -n "$1" ] || exit 4; kill -9 "$1" && date +%s.%N'
    )
    done = subprocess.run(
        ["docker", "exec", node, "sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
        timeout=360,
    )
    reasons = {3: f"{saved} did not appear within 300 s", 4: "no training process was left"}
    assert done.returncode == 0, f"no kill on {node}: {reasons.get(done.returncode, done.stderr)}"
    return time.monotonic() - (time.time() - float(done.stdout.split()[-1]))


def _jobs(node: str, *args: str) -> dict:
    return json.loads(_node(node, f"{LLAMA_JOB} {' '.join(shlex.quote(a) for a in args)}") or "{}")


def _assert_nothing_active() -> None:
    for node in NODES:
        active = _jobs(node, "list", "--active")["jobs"]
        assert active == [], f"{node} still runs {active}"


def _assert_failure_reported(done: subprocess.CompletedProcess, node: str, run_id: str) -> str:
    """The watching play failed naming the node, its exit status and error lines; logs came back."""
    said = _said(done.stdout)
    assert done.returncode != 0, "the play succeeded although a fault was injected"
    assert f"failed on {node}" in said, done.stdout[-5000:]
    assert f"Logs: {ROOT}/runs/{run_id}/" in said
    local = ROOT / "runs" / run_id / "logs"
    for up in NODES:
        if up == node and not (local / f"{up}.log").exists():
            continue  # a dead node's log cannot come back, and the play does not need it
        assert (local / f"{up}.log").is_file(), f"{up}'s log did not come back"
    return said


def _median_step_s(records: list[str]) -> float:
    """The median seconds per step in trainer log lines (their elapsed_time is H:MM:SS)."""
    points = []
    for line in records:
        if line.strip():
            record = json.loads(line)
            hours, minutes, seconds = (int(x) for x in record["elapsed_time"].split(":"))
            points.append((record["current_steps"], hours * 3600 + minutes * 60 + seconds))
    rates = sorted(
        (t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in itertools.pairwise(points) if s2 > s1
    )
    return rates[len(rates) // 2] if rates else 0.0


def _record(name: str, seconds: float, bound: float, derivation: str) -> None:
    """A fault's stop time: kept for the summary, written to RESULTS and asserted."""
    _timings[name] = seconds
    record_fault(name, seconds, bound, derivation)


def _timeouts(run_id: str, node: str = MASTER) -> dict[str, float]:
    """The supervisor's clocks of a run, as its spec on the node holds them (not the secret)."""
    path = f"{RUNS}/{run_id}/env/{node}.job.json"
    script = f"import json; print(json.dumps(json.load(open({path!r}))['timeouts']))"
    return json.loads(_node(node, f"python3 -c {shlex.quote(script)}"))


def _address(node: str) -> str:
    return subprocess.run(
        [
            "docker",
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            node,
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
