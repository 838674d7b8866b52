"""llama-job running a service: a job of one node (playbooks/serve.yml, playbooks/tensorboard.yml),
and the secret environment file its keys come from."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import (
    control,
    procs,
)
from ansible_collections.llama.cluster.plugins.module_utils.llama_job import spec as job_spec

from tests.support.llama_job_support import TOOL, free_port

# A service is rank 0 of 1 with no peers: its agent keeps no heartbeats and listens on no watchdog
# port, the gate is the service's own port, a service that dies is started again while restarts are
# left, and a stop ends it. Its keys come from a secret environment file that only its user can
# read: they reach the command's environment and nothing else. The agents are real processes on
# this machine, as in tests/support/llama_job_support.py.

# The service: listens on its port, writes what it saw of its secret, then serves until stopped.
SERVICE = r"""
import os, socket, sys, time
out = sys.argv[1]
with open(out, "a") as seen:
    seen.write(f"{os.getpid()} {os.environ.get('SERVE_API_KEY', '-')} {os.environ.get('PORT')}\n")
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", int(os.environ["PORT"])))
server.listen()
while True:
    time.sleep(1)
"""
SECRET = "sk-test-4f1c9a"


class Service:
    """One service agent on this machine, as roles/job writes its spec with job_single_node."""

    def __init__(self, tmp: Path, *, restarts: int = 0, secret: bool = False) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.seen = tmp / "seen.txt"
        (tmp / "service.py").write_text(SERVICE)
        (tmp / "job.env").write_text(f'PORT="{self.port}"\n')
        secret_file = ""
        if secret:
            secret_file = str(tmp / "secrets.env")
            Path(secret_file).write_text(f'SERVE_API_KEY="{SECRET}"\n')
            os.chmod(secret_file, 0o600)
        spec = {
            "job": "serve-test",
            "host": "n1",
            "rank": 0,
            "nnodes": 1,
            "role": "master",
            "master": {"host": "n1", "address": "127.0.0.1"},
            "peers": {},
            "watchdog_port": 0,
            "master_port": self.port,
            "gate_port": self.port,
            "ports": [self.port],
            "token": "",
            "command": [sys.executable, str(tmp / "service.py"), str(self.seen)],
            "env_file": str(tmp / "job.env"),
            "secret_env_file": secret_file,
            "exclusive": True,
            "cwd": str(tmp),
            "log": str(tmp / "n1.log"),
            "state": str(tmp / "n1.state.json"),
            "progress_file": "",
            "max_restarts": restarts,
            "timeouts": {"start": 20, "heartbeat": 0.5, "peer": 3, "stop": 2, "settle": 0.3},
        }
        (tmp / "spec.json").write_text(json.dumps(spec))
        self.proc = subprocess.Popen(
            [sys.executable, str(TOOL), "run", "--spec", str(tmp / "spec.json")],
            start_new_session=True,
        )

    def state(self) -> dict:
        try:
            return json.loads((self.tmp / "n1.state.json").read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, phase: str, attempt: int = 1, timeout: float = 20) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state.get("phase") == phase and state.get("attempt") == attempt:
                return state
            time.sleep(0.1)
        pytest.fail(f"not {phase} (attempt {attempt}): {self.state()} {self.log()}")

    def log(self) -> str:
        path = self.tmp / "n1.log"
        return path.read_text() if path.exists() else ""

    def leftovers(self) -> list[str]:
        ps = ["ps", "-eo", "pid=,args="]
        out = subprocess.run(ps, capture_output=True, text=True, check=False).stdout
        return [line for line in out.splitlines() if str(self.tmp / "service.py") in line]

    def close(self) -> None:
        child = self.state().get("child")
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if child:  # the command runs in a process group of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)
        for line in self.leftovers():
            os.kill(int(line.split()[0]), signal.SIGKILL)


@pytest.fixture
def service_factory(tmp_path: Path):
    made: list[Service] = []

    def make(**kwargs: object) -> Service:
        made.append(Service(tmp_path, **kwargs))
        return made[-1]

    yield make
    for service in made:
        service.close()


def _listening_pids() -> set[int]:
    """Every process that holds a listening TCP socket on this machine."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A":
                inodes.add(int(parts[9]))
    return {pid for pids in procs.socket_owners(inodes).values() for pid in pids}


def test_a_service_runs_once_its_own_port_listens_and_keeps_no_watchdog(service_factory):
    service = service_factory()
    state = service.wait("running")
    child = state["child"]
    assert child in {entry["pid"] for entry in procs.listeners(service.port)}, service.log()
    assert service.proc.pid not in _listening_pids(), "the agent of a service listens on a port"
    assert state["peers"] == {}


def test_a_service_that_dies_is_started_again_then_stopped_on_request(service_factory):
    service = service_factory(restarts=1)
    first = service.wait("running")["child"]
    os.kill(first, signal.SIGKILL)
    again = service.wait("running", attempt=2)
    assert again["child"] not in (None, first)
    assert again["restarts"][0]["after"]["kind"] == "exited"
    os.kill(service.proc.pid, signal.SIGTERM)  # what llama-job stop / systemctl stop send
    service.proc.wait(timeout=20)
    assert service.state()["phase"] == "stopped", service.log()
    assert service.leftovers() == []
    assert procs.listeners(service.port) == []


def test_a_service_with_no_restart_left_fails_naming_its_exit(service_factory):
    service = service_factory()
    os.kill(service.wait("running")["child"], signal.SIGKILL)
    service.proc.wait(timeout=20)
    state = service.state()
    assert state["phase"] == "failed"
    assert (state["reason"]["kind"], state["reason"]["exit_status"]) == ("exited", -9)


def test_the_secret_environment_reaches_the_command_and_nothing_else(service_factory):
    service = service_factory(secret=True)
    service.wait("running")
    _pid, key, port = service.seen.read_text().split()
    assert (key, port) == (SECRET, str(service.port))
    written = [service.tmp / name for name in ("n1.log", "n1.state.json", "spec.json", "job.env")]
    assert all(SECRET not in path.read_text() for path in written)


def test_start_refuses_a_secret_file_that_others_can_read(tmp_path: Path):
    me = pwd.getpwuid(os.getuid())
    secret = tmp_path / "secrets.env"
    with pytest.raises(job_spec.Refused, match="is missing"):
        control.check_secret_file(str(secret), me)
    secret.write_text('KEY="value"\n')
    secret.chmod(0o640)
    with pytest.raises(job_spec.Refused, match=r"mode 0600; it is -rw-r-----"):
        control.check_secret_file(str(secret), me)
    secret.chmod(0o600)
    control.check_secret_file(str(secret), me)
    (tmp_path / "link.env").symlink_to(secret)
    with pytest.raises(job_spec.Refused, match="regular file"):
        control.check_secret_file(str(tmp_path / "link.env"), me)


def test_a_spec_without_the_new_keys_is_an_exclusive_job_without_secrets(tmp_path: Path):
    spec = {
        "job": "j",
        "host": "h",
        "rank": 0,
        "nnodes": 1,
        "role": "master",
        "watchdog_port": 0,
        "max_restarts": 0,
        "cwd": "/tmp",
        "log": "/tmp/l",
        "state": "/tmp/s",
        "env_file": "/tmp/e",
        "command": ["true"],
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    loaded = job_spec.load_spec(str(path), require_root=False)
    assert (loaded["exclusive"], loaded["secret_env_file"]) == (True, "")
    path.write_text(json.dumps({**spec, "secret_env_file": "relative.env"}))
    with pytest.raises(job_spec.Refused, match="secret_env_file must be an absolute path"):
        job_spec.load_spec(str(path), require_root=False)
