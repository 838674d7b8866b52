"""What the lab's tests do to its nodes (containers of this machine): run a shell there, ask a
job's master how it stands, play a playbook beside the test, take a node down and bring it back
as it was."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from train_runner import DEFAULT_INVENTORY

ROOT = Path(__file__).resolve().parents[2]
RUNS = "/opt/llama-cluster/runs"
LLAMA_JOB = "/usr/local/sbin/llama-job"


def node(host: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A shell command on a lab node, as root."""
    return subprocess.run(
        ["docker", "exec", host, "sh", "-c", command],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def master_status(master: str, run_id: str) -> dict:
    """The master's rank status of a job ({} before it has one)."""
    done = node(master, f"{LLAMA_JOB} status --job {shlex.quote(run_id)}")
    return (json.loads(done.stdout or "{}").get("ranks") or [{}])[0]


def play(*args: str) -> tuple[subprocess.Popen[str], str]:
    """ansible-playbook on the lab, in the background; its output goes to the file named."""
    out = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        ["ansible-playbook", "-i", str(DEFAULT_INVENTORY), *args],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    return process, out.name


def new_run(master: str, before: set[str]) -> str | None:
    """The run directory that appeared on the master since `before` (its listing then)."""
    fresh = sorted(set(node(master, f"ls {RUNS}").stdout.split()) - before)
    return fresh[-1] if fresh and fresh[-1].startswith("train-") else None


def wait_for(what: str, check: object, timeout: float, process: subprocess.Popen | None = None):
    """The first true value of check() within `timeout` s; a play that ends first fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()  # type: ignore[operator]
        if found:
            return found
        if process is not None and process.poll() is not None:
            pytest.fail(f"the play ended before {what}")
        time.sleep(1)
    pytest.fail(f"no {what} within {timeout:.0f} s")


def address(host: str) -> str:
    """A lab node's address on its network."""
    return subprocess.run(
        [
            "docker",
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            host,
        ],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def booted(host: str, timeout: float = 180) -> None:
    """Wait until a restarted node's systemd has finished booting."""
    wait_for(
        f"{host} booted",
        lambda: (
            node(host, "systemctl is-system-running 2>/dev/null || true").stdout.strip()
            in ("running", "degraded")
        ),
        timeout,
    )
