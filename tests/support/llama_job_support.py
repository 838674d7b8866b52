"""What the tests of llama-job (tests/test_llama_job_*.py) share: the zipapp, built as
provisioning builds it, and a pair of real agents on this machine.

A pair is a master's and a worker's agent (`llama-job run`) on 127.0.0.1, as the two "nodes" of
the GPU proof share one host, each running a small Python job; the tests break one of them the
way the lab tests break a node: kill its command, kill its agent, freeze it with SIGSTOP, stall
its progress. What the agents do is what they do on the cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    build,
)

ROOT = Path(__file__).resolve().parents[2]
# The zipapp that provisioning installs, built from the package as the role builds it.
TOOL = Path(build.build(ROOT / ".cache" / "llama-job")["path"])


# The job each agent starts: rank 0 listens on the gate port (like torchrun's store), both
# "train" STEPS steps of STEP_S seconds (fewer once the file STOP_FILE names exists), rank 0
# appends one trainer-log record per step.
JOB = r"""
import json, os, socket, sys, time
host, progress = sys.argv[1], sys.argv[2]
if os.environ.get("GATE"):
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", int(os.environ["GATE"])))
    server.listen()
steps, pause = int(os.environ["STEPS"]), float(os.environ["STEP_S"])
stall_at = int(os.environ.get("STALL_AT", "-1"))
give_up_at = int(os.environ.get("GIVE_UP_AT", "-1"))
oom_at = int(os.environ.get("OOM_AT", "-1"))
fail_once_at = int(os.environ.get("FAIL_ONCE_AT", "-1"))  # fails there on the first attempt only
if os.environ.get("RANK_PID_FILE"):  # a rank as torch's elastic agent starts one: own session
    import subprocess
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", __file__],
                            start_new_session=True)
    with open(os.environ["RANK_PID_FILE"], "w") as out:
        out.write(str(rank.pid))
chatter = int(os.environ.get("CHATTER", "0"))  # bytes of output per step (a chatty command)
marks = os.environ.get("LLAMA_JOB_MARKS", "")
def mark(name, record):  # what the job's trainer callback writes (llama_launcher.py)
    with open(os.path.join(marks, "." + name), "w") as out:
        json.dump(record, out)
    os.replace(os.path.join(marks, "." + name), os.path.join(marks, name))
save_at, save_s = int(os.environ.get("SAVE_AT", "-1")), float(os.environ.get("SAVE_S", "0"))
eval_at = int(os.environ.get("EVAL_AT", "-1"))
print("job", host, "NNODES", os.environ.get("NNODES", "-"), "NODE_RANK",
      os.environ.get("NODE_RANK", "-"), "args", " ".join(sys.argv[3:]), flush=True)
for step in range(1, steps + 1):
    time.sleep(pause)
    if step == save_at:  # rank 0 saves a checkpoint: slowly, or it hangs there
        mark("activity.json", {"what": "saving", "step": step, "checkpoint": f"checkpoint-{step}"})
        time.sleep(3600 if os.environ.get("SAVE_HANG") else save_s)
        mark("activity.json", {"what": "training", "step": step})
    if step == eval_at:  # rank 0 evaluates for EVAL_S seconds, saying so every second
        for batch in range(int(float(os.environ["EVAL_S"]))):
            mark("activity.json", {"what": "evaluating", "step": step, "batches": batch})
            time.sleep(1)
        mark("activity.json", {"what": "training", "step": step})
    if chatter:
        print(f"step {step} " + "x" * chatter, flush=True)
    if step == oom_at and os.environ.get("OOM_CGROUP"):  # into a small memory cgroup, and fill it
        with open(os.path.join(os.environ["OOM_CGROUP"], "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        hog = [bytearray(1 << 20) for _ in range(4096)]
    elif step == oom_at:  # what torch prints when a GPU is full
        print("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.30 GiB. "
              "GPU 0 has a total capacity of 79.10 GiB of which 400.00 MiB is free.", flush=True)
        sys.exit(1)
    if step == fail_once_at and not os.path.exists(os.environ["FAIL_ONCE_MARK"]):
        open(os.environ["FAIL_ONCE_MARK"], "w").close()
        sys.exit(3)
    if step == stall_at:
        time.sleep(3600)
    if step == give_up_at:  # like torchrun once a rank died, then a launcher slow to exit
        print("ChildFailedError: rank 1 died", flush=True)
        time.sleep(3600)
    if progress:
        with open(progress, "a") as log:
            log.write(json.dumps({"current_steps": step, "total_steps": steps}) + "\n")
    if os.path.exists(os.environ.get("STOP_FILE", "/nonexistent")):  # the test says: finish now
        break
if os.environ.get("MARK_RANKS"):  # every rank of the node reached the last step
    for rank in os.environ["MARK_RANKS"].split(","):
        mark(f"finished-rank{rank}.json",
             {"rank": int(rank), "step": steps, "max_steps": steps, "checkpoint": None})
time.sleep(float(os.environ.get("END_S", "0")))
if os.environ.get("TEARDOWN_ABORT"):  # gloo's teardown, as once seen on the lab: SIGABRT
    os.kill(os.getpid(), 6)
print(host, "done")
"""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Pair:
    """A master's and a worker's agent of one job on this machine."""

    def __init__(
        self,
        tmp: Path,
        *,
        restarts: int = 0,
        steps: int = 30,
        give_up_at: int = 0,
        worker_env: dict[str, str] | None = None,
        master_env: dict[str, str] | None = None,
        spec_extra: dict[str, dict] | None = None,
        **env: str,
    ) -> None:
        self.tmp = tmp
        self.gate = free_port()
        self.watchdog = free_port()
        (tmp / "job.py").write_text(JOB)
        self.progress = tmp / "trainer_log.jsonl"
        self.procs: dict[str, subprocess.Popen] = {}
        for host, rank in (("m", 0), ("w", 1)):
            master = rank == 0
            extra = {"STEPS": str(steps), "STEP_S": "0.2", **env}
            if master:
                extra["GATE"] = str(self.gate)
                extra.update(master_env or {})
            else:
                extra.pop("STALL_AT", None)
                if give_up_at:
                    extra["GIVE_UP_AT"] = str(give_up_at)
                extra.update(worker_env or {})
            (tmp / f"{host}.env").write_text(
                "".join(f'{key}="{value}"\n' for key, value in extra.items())
            )
            spec = {
                "job": "t",
                "host": host,
                "rank": rank,
                "nnodes": 2,
                "role": "master" if master else "worker",
                "master": {"host": "m", "address": "127.0.0.1"},
                "peers": {"w": "127.0.0.1"} if master else {},
                "address": "127.0.0.1",
                "watchdog_port": self.watchdog,
                "master_port": self.gate,
                "gate_port": self.gate if master else None,
                "ports": [self.gate, self.watchdog] if master else [],
                "token": "secret",
                "command": [
                    sys.executable,
                    str(tmp / "job.py"),
                    host,
                    str(self.progress) if master else "",
                ],
                "env_file": str(tmp / f"{host}.env"),
                "cwd": str(tmp),
                "log": str(tmp / f"{host}.log"),
                "state": str(tmp / f"{host}.state.json"),
                "progress_file": str(self.progress) if master else "",
                "max_restarts": restarts,
                "fail_patterns": ["ChildFailedError"],
                "timeouts": {
                    "start": 20,
                    "heartbeat": 0.5,
                    "peer": 3,
                    "stop": 2,
                    "restart": 8,
                    "settle": 0.5,
                    "stall_startup": 10,
                    "stall_floor": 2,
                    "stall_factor": 5,
                },
            }
            spec.update((spec_extra or {}).get(host, {}))
            (tmp / f"{host}.json").write_text(json.dumps(spec))
        for host in ("m", "w"):
            self.procs[host] = subprocess.Popen(
                [sys.executable, str(TOOL), "run", "--spec", str(tmp / f"{host}.json")],
                start_new_session=True,  # an agent leads its session, as under a supervisor
            )

    def state(self, host: str) -> dict:
        try:
            return json.loads((self.tmp / f"{host}.state.json").read_text())
        except (OSError, ValueError):
            return {}

    def command_pid(self, host: str) -> int | None:
        return self.state(host).get("child")

    def wait_running(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state("m").get("phase") == "running" and self.command_pid("w"):
                return
            time.sleep(0.1)
        pytest.fail(f"the job did not start: {self.logs()}")

    def wait_step(self, step: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.state("m").get("progress") or {}).get("current_steps", 0) >= step:
                return
            time.sleep(0.1)
        pytest.fail(f"the job did not reach step {step}: {self.logs()}")

    def wait_ended(self, hosts: tuple[str, ...] = ("m", "w"), timeout: float = 60) -> float:
        """Seconds until the given agents have exited."""
        started = time.monotonic()
        for host in hosts:
            self.procs[host].wait(timeout=max(1, timeout - (time.monotonic() - started)))
        return time.monotonic() - started

    def logs(self) -> str:
        return "\n".join(
            (self.tmp / f"{h}.log").read_text()
            for h in ("m", "w")
            if (self.tmp / f"{h}.log").exists()
        )

    def leftovers(self) -> list[str]:
        ps = ["ps", "-eo", "pid=,args="]
        out = subprocess.run(ps, capture_output=True, text=True, check=False).stdout
        return [line for line in out.splitlines() if str(self.tmp / "job.py") in line]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for line in self.leftovers():
            os.kill(int(line.split()[0]), signal.SIGKILL)


@pytest.fixture
def pair_factory(tmp_path: Path):
    """Pairs made by a test (Pair's arguments), closed after it."""
    made: list[Pair] = []

    def make(**kwargs: object) -> Pair:
        made.append(Pair(tmp_path, **kwargs))
        return made[-1]

    yield make
    for pair in made:
        pair.close()
