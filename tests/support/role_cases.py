"""A role's refusals, case by case, in one ansible-playbook run: each case is a host of its own
on the local connection, its settings host variables over the project's defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}


def run_cases(tmp: Path, inventory: dict, plays: list[dict]) -> str:
    """ansible-playbook of `plays` on `inventory` (written to `tmp`) from the project's root, a
    fact cache of its own; its output, one line of JSON per result (each message read whole)."""
    (tmp / "hosts.yml").write_text(json.dumps(inventory))
    (tmp / "cases.yml").write_text(json.dumps(plays))
    env = {
        **os.environ,
        "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
        "ANSIBLE_CALLBACK_FORMAT_PRETTY": "false",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp / "facts"),
    }
    argv = [str(ANSIBLE_PLAYBOOK), "-i", str(tmp / "hosts.yml"), str(tmp / "cases.yml")]
    done = subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    assert "PLAY RECAP" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr
