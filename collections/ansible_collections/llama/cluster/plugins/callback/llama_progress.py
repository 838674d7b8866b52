"""Ansible's default output, plus one readable progress line per poll of a running job, each
play's wall time after the recap, and, when Ctrl-C interrupts a play that leaves a job running
on the nodes, one line that says so and how to follow or stop it."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import time

from ansible.plugins.callback.default import CallbackModule as DefaultCallback
from ansible.utils.color import stringc

# ansible-playbook's exit status for "User interrupted execution".
EXIT_INTERRUPTED = 99

DOCUMENTATION = """
    name: llama_progress
    type: stdout
    short_description: default output with training progress lines
    description:
      - Ansible's default callback, except that a task polling a llama-cluster job
        (one that registers C(progress) in its result and retries with C(until))
        prints that progress line instead of "FAILED - RETRYING".
      - After the play recap, a PLAY TIMES block gives each play's wall time.
      - A play that starts a job which outlives it (llama-job on the nodes) sets the fact
        C(job_interrupt_note) to one line (roles/job does, with C(job_attachable), saying that
        the run goes on and how to follow or stop it), and to an empty string once it no longer
        holds. When Ctrl-C
        (SIGINT) ends ansible-playbook while a note is set, that line is printed last.
      - While a note is set, Ctrl-C ends ansible-playbook at once, its workers ended, exit
        status 99, the note last. Ansible's own interrupt can deadlock on the task that follows
        the job (its result queue's reader holds the lock the cleanup waits for), and the job
        goes on regardless.
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
"""


class CallbackModule(DefaultCallback):
    """Default stdout callback that shows the progress of watched jobs."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "llama_progress"

    def __init__(self) -> None:
        super().__init__()
        self._plays: list[tuple[str, float]] = []
        self._play_clock: tuple[str, float] | None = None
        # Ctrl-C: ansible-playbook's own handler (the task queue manager's, installed before the
        # callbacks load) raises KeyboardInterrupt and exits 99; this one notes it first.
        self._note = ""
        self._interrupted = False
        self._previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._on_interrupt)
        atexit.register(self._say_note)

    def _on_interrupt(self, signum: int, frame) -> None:  # noqa: ANN001 - a frame
        self._interrupted = True
        if self._note:  # a job goes on: this play only follows it
            self._leave_now()
        if callable(self._previous):
            self._previous(signum, frame)
        else:
            raise KeyboardInterrupt

    def _leave_now(self) -> None:
        """End ansible-playbook now, its workers first, the note last. Written straight to the
        descriptor: the interrupted thread may hold Display's lock."""
        for worker in multiprocessing.active_children():
            worker.terminate()
        note = stringc(self._note, "bright yellow")
        os.write(2, f"\n{note}\n".encode(errors="replace"))
        os._exit(EXIT_INTERRUPTED)

    def _say_note(self) -> None:
        """After an interrupt: what still runs on the nodes, and how to follow or stop it."""
        if self._interrupted and self._note:
            self._display.display(self._note, color="bright yellow", stderr=True)

    def v2_runner_on_ok(self, result) -> None:  # noqa: ANN001 - Ansible's TaskResult
        facts = result._result.get("ansible_facts") or {}
        if "job_interrupt_note" in facts:
            self._note = str(facts["job_interrupt_note"] or "")
        super().v2_runner_on_ok(result)

    def _end_play(self) -> None:
        """Record the running play's wall time."""
        if self._play_clock:
            name, started = self._play_clock
            self._plays.append((name, time.monotonic() - started))
            self._play_clock = None

    def v2_playbook_on_play_start(self, play) -> None:  # noqa: ANN001 - Ansible's Play
        self._end_play()
        self._play_clock = (play.get_name().strip(), time.monotonic())
        super().v2_playbook_on_play_start(play)

    def v2_playbook_on_stats(self, stats) -> None:  # noqa: ANN001 - Ansible's AggregateStats
        super().v2_playbook_on_stats(stats)
        self._end_play()
        if not self._plays:
            return
        self._display.banner("PLAY TIMES")
        width = max(40, self._display.columns - 10)
        for name, seconds in self._plays:
            self._display.display(f"{name} ".ljust(width, "-") + f" {seconds:8.2f}s")

    def v2_runner_retry(self, result) -> None:  # noqa: ANN001 - Ansible's TaskResult
        progress = result._result.get("progress")
        if not progress:
            super().v2_runner_retry(result)
            return
        self._display.display(f"[{result._host.get_name()}] {progress}", color="cyan")
