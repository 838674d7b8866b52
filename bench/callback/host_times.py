"""Seconds each host spent in each role (and in all), written as JSON when the play ends.

For bench/env_install.sh: enabled with ANSIBLE_CALLBACK_PLUGINS=bench/callback and
ANSIBLE_CALLBACKS_ENABLED=host_times; the file is $LLAMA_BENCH_TIMES (default host_times.json).
"""

from __future__ import annotations

import json
import os
import time

from ansible.executor.stats import AggregateStats
from ansible.executor.task_result import TaskResult
from ansible.inventory.host import Host
from ansible.playbook.task import Task
from ansible.plugins.callback import CallbackBase

# Steps of the node environment, found by a part of their task names.
STEPS = {
    "step:os packages": "Install the OS packages the environment needs",
    "step:venv": "Create the venv",
    "step:uv bootstrap": "Install uv into the environment",
    "step:torch": ": the torch trio",
    "step:stack": ": LLaMA-Factory and DeepSpeed",
}


class CallbackModule(CallbackBase):
    """Adds up, per host, the time from each task's start on that host to its result."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "host_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._started: dict[tuple[str, str], float] = {}
        self._times: dict[str, dict[str, float]] = {}

    def v2_runner_on_start(self, host: Host, task: Task) -> None:
        """A task starts on a host."""
        self._started[(host.get_name(), task._uuid)] = time.monotonic()

    def _done(self, result: TaskResult) -> None:
        host = result._host.get_name()
        start = self._started.pop((host, result._task._uuid), None)
        if start is None:
            return
        role = result._task._role.get_name() if result._task._role else "(play)"
        seconds = time.monotonic() - start
        per_host = self._times.setdefault(host, {})
        per_host[role] = per_host.get(role, 0.0) + seconds
        per_host["(all)"] = per_host.get("(all)", 0.0) + seconds
        # The environment's steps, by task (an included task file counts under python_env).
        for step, marker in STEPS.items():
            if marker in result._task.get_name():
                per_host[step] = per_host.get(step, 0.0) + seconds

    def v2_runner_on_ok(self, result: TaskResult) -> None:
        """A task ended on a host."""
        self._done(result)

    def v2_runner_on_failed(self, result: TaskResult, ignore_errors: bool = False) -> None:
        """A task failed on a host."""
        self._done(result)

    def v2_runner_on_skipped(self, result: TaskResult) -> None:
        """A task was skipped on a host."""
        self._done(result)

    def v2_playbook_on_stats(self, stats: AggregateStats) -> None:
        """Write the totals."""
        path = os.environ.get("LLAMA_BENCH_TIMES", "host_times.json")
        rounded = {h: {r: round(s, 1) for r, s in t.items()} for h, t in self._times.items()}
        with open(path, "w") as out:
            json.dump(rounded, out, indent=1, sort_keys=True)
