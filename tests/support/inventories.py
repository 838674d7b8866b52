"""Inventories as a user writes them (INI and YAML), nodes that do not exist (127.0.0.1 on port
9, where nothing listens), and a playbook run on them with its recap."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

GHOST = "ansible_host=127.0.0.{n} ansible_port=9"


def ini(tmp: Path, text: str) -> Path:
    """An INI inventory whose host lines get a ghost address appended, one loopback address per
    line (two hosts at one address are one machine, which the check refuses)."""
    lines, section = [], ""
    for line in text.strip().splitlines():
        if line.startswith("["):
            section = line
        host_line = not line.startswith("[") and not section.endswith((":vars]", ":children]"))
        lines.append(f"{line} {GHOST.format(n=len(lines) + 1)}" if host_line else line)
    path = tmp / "hosts.ini"
    path.write_text("\n".join(lines) + "\n")
    return path


def yaml_inventory(tmp: Path, inventory: dict) -> Path:
    path = tmp / "hosts.yml"
    path.write_text(json.dumps(inventory))
    return path


def ghost(n: int = 1) -> dict:
    return {"ansible_host": f"127.0.0.{n}", "ansible_port": 9}


def run(playbook: str, inventory: Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run(
        # A run that train.yml plans is claimed (made) under the test's own directory.
        [
            *(str(ANSIBLE_PLAYBOOK), "-i", str(inventory), playbook),
            *("-e", f"controller_runs_dir={inventory.parent / 'runs'}", *extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default",
            "PATH": "/usr/bin:/bin",
            "HOME": str(inventory.parent),
            # A fact cache of the test's own: no facts from other runs, none left behind.
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(inventory.parent / "facts"),
        },
    )
    return done.returncode, done.stdout + done.stderr


def recap(out: str) -> dict[str, dict[str, int]]:
    """The play recap: host -> counters."""
    tail = out.rsplit("PLAY RECAP", maxsplit=1)[-1]
    rows = re.findall(r"^(\S+)\s+: ((?:\w+=\d+\s*)+)$", tail, re.M)
    return {
        host: {k: int(v) for k, v in (pair.split("=") for pair in counters.split())}
        for host, counters in rows
    }


def refused(playbook: str, inventory: Path, *extra: str) -> str:
    """Run `playbook`, assert that the inventory check refused it on localhost alone."""
    rc, out = run(playbook, inventory, *extra)
    assert rc != 0, out[-3000:]
    assert "does not describe a cluster" in out, out[-3000:]
    assert "UNREACHABLE" not in out, "a node was contacted"
    assert recap(out) == {
        "localhost": {
            "ok": recap(out)["localhost"]["ok"],
            "changed": 0,
            "unreachable": 0,
            "failed": 1,
            "skipped": 0,
            "rescued": 0,
            "ignored": 0,
        }
    }, "a task ran on a node"
    return " ".join(out.split())
