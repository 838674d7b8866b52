"""train_runner.py's command line: its exit statuses, its JSON, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# train_runner.py and llama_runner/ sit at the repository root, not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train_runner import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_INVALID_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    PROJECT_DIR,
)

TRAIN_PLAYBOOK = PROJECT_DIR / "train.yml"
needs_train = pytest.mark.skipif(
    not TRAIN_PLAYBOOK.is_file(), reason="train.yml is not in this checkout yet"
)


from tests.support.runner import cli, write_playbook  # noqa: E402


# ---- the CLI -------------------------------------------------------------------------------
def test_cli_exits_2_on_bad_input(tmp_path: Path):
    runner_dir = ("--private-data-dir", str(tmp_path / "runner"))
    missing = cli(*runner_dir, "--inventory", str(tmp_path / "nowhere.yml"), "provision")
    assert missing.returncode == EXIT_INVALID_INPUT
    assert "does not exist" in missing.stdout
    bad_value = cli("lab", "--nodes", "0")
    assert bad_value.returncode == EXIT_INVALID_INPUT
    too_short = cli(*runner_dir, "scaling", "--model", "tiny", "--steps", "1")
    assert too_short.returncode == EXIT_INVALID_INPUT
    assert "steps must be at least 2" in too_short.stdout
    local = tmp_path / "local.yml"
    local.write_text("all:\n  hosts:\n    localhost:\n      ansible_connection: local\n")
    bad_spec = cli(
        *runner_dir, "--inventory", str(local), "run", "playbooks/lab.yml", "-e", "lab_state=bogus"
    )
    assert bad_spec.returncode == EXIT_INVALID_INPUT
    assert "localhost" in bad_spec.stdout


def test_cli_exits_0_1_and_3_and_reports_json(tmp_path: Path, local_inventory: Path):
    ok = write_playbook(
        tmp_path,
        "ok.yml",
        "- name: Fine\n  hosts: cluster\n  gather_facts: false\n  tasks:\n"
        "    - name: Reach the node\n      ansible.builtin.ping:\n",
    )
    fail = write_playbook(
        tmp_path,
        "fail.yml",
        "- name: Break\n  hosts: cluster\n  gather_facts: false\n  tasks:\n"
        "    - name: Fail on purpose\n      ansible.builtin.fail:\n"
        "        msg: broken on purpose\n",
    )
    ghost = tmp_path / "ghost.yml"
    ghost.write_text(
        "all:\n  children:\n    cluster:\n      hosts:\n        ghost-node:\n"
        "          ansible_host: 127.0.0.1\n          ansible_port: 1\n"
    )

    runner_dir = ("--private-data-dir", str(tmp_path / "runner"))
    succeeded = cli(*runner_dir, "--json", "-i", str(local_inventory), "run", str(ok))
    assert succeeded.returncode == EXIT_OK, succeeded.stderr
    assert '"status": "successful"' in succeeded.stdout
    assert "PLAY Fine" in succeeded.stderr

    failed = cli(*runner_dir, "-i", str(local_inventory), "run", str(fail))
    assert failed.returncode == EXIT_FAILED
    assert "broken on purpose" in failed.stdout
    assert "Fail on purpose" in failed.stdout

    unreachable = cli(*runner_dir, "-i", str(ghost), "run", str(ok))
    assert unreachable.returncode == EXIT_UNREACHABLE
    assert "ghost-node" in unreachable.stdout


def test_cli_ctrl_c_exits_130(tmp_path: Path, local_inventory: Path):
    sleep = f"sleep {os.getpid() % 1000 + 1000}.25"  # this test's own, to find it and to end it
    playbook = write_playbook(
        tmp_path,
        "slow.yml",
        "- name: Slow\n  hosts: cluster\n  gather_facts: false\n  tasks:\n"
        f"    - name: Wait\n      ansible.builtin.command: {sleep}\n"
        "      changed_when: false\n",
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "train_runner.py",
            "--private-data-dir",
            str(tmp_path / "runner"),
            "-i",
            str(local_inventory),
            "run",
            str(playbook),
        ],
        cwd=PROJECT_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Interrupt once the play runs its task, however long start-up takes on a busy machine.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            found = subprocess.run(["pgrep", "-f", sleep], capture_output=True, check=False)
            if found.returncode == 0:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        subprocess.run(["pkill", "-f", sleep], check=False)
    assert proc.returncode == EXIT_INTERRUPTED, out
    assert "INTERRUPTED" in out
