"""The play's callback (llama_progress): its recap with play and task times, and what Ctrl-C on a
watched play says (the run goes on).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TIMERS_PLAYBOOK = """
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
    playbook.write_text(TIMERS_PLAYBOOK)
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


# Ctrl-C on a watched play stops the play, not the run (the cluster stops every rank only if one
# fails): the play says so in one line, with how to follow or stop it. roles/job sets the line
# (job_interrupt_note, from its vars) while a run goes on; the callback prints it after Ctrl-C.
INTERRUPTED_PLAYBOOK = """
- name: Interrupted | A play that leaves a run going
  hosts: localhost
  gather_facts: false
  vars:
    job_id: train-20261204-101500-tiny
    job_attachable: true
  tasks:
    - name: Interrupted | Read the job role's note
      ansible.builtin.include_vars: %(root)s/roles/job/vars/main.yml
    - name: Interrupted | Note what goes on
      ansible.builtin.set_fact:
        job_interrupt_note: "{{ __job_interrupt_note }}"
    - name: Interrupted | Note that nothing goes on any more
      ansible.builtin.set_fact:
        job_interrupt_note: ""
      when: cleared | bool
    - name: Interrupted | Follow the run
      ansible.builtin.command: sleep %(sleep)s
      changed_when: false
"""


def _interrupted(tmp_path: Path, cleared: bool, sleep: int = 60) -> tuple[int, str, str]:
    playbook = tmp_path / "interrupted.yml"
    playbook.write_text(INTERRUPTED_PLAYBOOK % {"root": ROOT, "sleep": sleep})
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", "-e", f"cleared={cleared}",
         str(playbook)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:  # interrupt once the play follows the run
        if "TASK [Interrupted | Follow the run]" in line:
            break
    if sleep > 5:
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


NOTE = (
    "Run train-20261204-101500-tiny goes on on every node: Ctrl-C stopped this play, not the run "
    "(the cluster still stops every rank if one fails). Follow it: ansible-playbook "
    "playbooks/attach.yml -e run_id=train-20261204-101500-tiny; stop it: ansible-playbook "
    "playbooks/stop.yml -e run_id=train-20261204-101500-tiny."
)


def test_ctrl_c_on_a_watched_play_says_in_one_line_that_the_run_goes_on(tmp_path: Path):
    rc, out, err = _interrupted(tmp_path, cleared=False)
    assert rc == 99, (out[-2000:], err[-2000:])  # ansible-playbook's "User interrupted execution"
    assert err.strip().splitlines()[-1] == NOTE, err[-2000:]
    assert (out + err).count("goes on on every node") == 1


def test_no_note_once_the_run_has_ended_or_when_the_play_is_not_interrupted(tmp_path: Path):
    rc, out, err = _interrupted(tmp_path, cleared=True)
    assert rc == 99
    assert "goes on on every node" not in out + err
    rc, out, err = _interrupted(tmp_path, cleared=False, sleep=0)
    assert rc == 0, out[-2000:]
    assert "goes on on every node" not in out + err


# status.yml finds the run (tasks/find_run.yml registers `__runs_found`), then works out what it
# came to (tasks/ended_run.yml): a registered variable wins over a task's vars, so a name the two
# shared fed find's result to job_run_summary on the lab ("'bool' object is not iterable").
