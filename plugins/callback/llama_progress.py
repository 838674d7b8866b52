"""Ansible's default output, plus one readable progress line per poll of a running job."""

from __future__ import annotations

from ansible.plugins.callback.default import CallbackModule as DefaultCallback

DOCUMENTATION = """
    name: llama_progress
    type: stdout
    short_description: default output with training progress lines
    description:
      - Ansible's default callback, except that a task polling a llama-cluster job
        (one that registers C(progress) in its result and retries with C(until))
        prints that progress line instead of "FAILED - RETRYING".
    extends_documentation_fragment:
      - default_callback
      - result_format_callback
"""


class CallbackModule(DefaultCallback):
    """Default stdout callback that shows the progress of watched jobs."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "llama_progress"

    def v2_runner_retry(self, result) -> None:  # noqa: ANN001 - Ansible's TaskResult
        progress = result._result.get("progress")
        if not progress:
            super().v2_runner_retry(result)
            return
        self._display.display(f"[{result._host.get_name()}] {progress}", color="cyan")
