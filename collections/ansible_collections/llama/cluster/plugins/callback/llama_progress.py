"""Ansible's default output, plus one readable progress line per poll of a running job, and
each play's wall time after the recap."""

from __future__ import annotations

import time

from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: llama_progress
    type: stdout
    short_description: default output with training progress lines
    description:
      - Ansible's default callback, except that a task polling a llama-cluster job
        (one that registers C(progress) in its result and retries with C(until))
        prints that progress line instead of "FAILED - RETRYING".
      - After the play recap, a PLAY TIMES block gives each play's wall time.
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
