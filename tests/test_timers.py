"""ansible-playbook's output: Ansible's default, then each play's time and the slowest tasks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = """
- name: Timers | First play
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Timers | Wait a second
      ansible.builtin.command: sleep 1
      changed_when: false
- name: Timers | Second play
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Timers | Say done
      ansible.builtin.debug:
        msg: done
"""


def test_recap_is_followed_by_play_times_tasks_and_total(tmp_path: Path) -> None:
    playbook = tmp_path / "timers.yml"
    playbook.write_text(PLAYBOOK)
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(playbook),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    out = done.stdout
    # The default callback's output is there as always, the timers after its recap.
    assert "TASK [Timers | Wait a second]" in out
    recap = out.index("PLAY RECAP")
    plays = dict(re.findall(r"^(Timers \| \w+ play) -+ +([\d.]+)s$", out[recap:], re.M))
    assert float(plays["Timers | First play"]) >= 1.0
    assert float(plays["Timers | Second play"]) < float(plays["Timers | First play"])
    tasks = dict(re.findall(r"^(Timers \| [\w ]+?) -+ +([\d.]+)s$", out[recap:], re.M))
    assert float(tasks["Timers | Wait a second"]) >= 1.0
    assert re.search(r"Playbook run took 0 days, 0 hours, 0 minutes, \d+ seconds", out[recap:])
