"""The exceptions a Cluster raises, and the CLI's exit status for each."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llama_runner.results import RunResult

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130


class RunnerError(Exception):
    """Base of every error a Cluster raises; `result` is the run's, when one ran."""

    def __init__(self, message: str, result: RunResult | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.result = result


class PlaybookFailed(RunnerError):
    """A task failed. `host` is the node that failed: for a distributed job, the node whose rank
    failed first (as the job watcher reported it), else the host the failing task ran on.
    `task` is the failing task, `failed_hosts` every node the job watcher saw fail."""

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        task: str | None = None,
        failed_hosts: tuple[str, ...] = (),
        result: RunResult | None = None,
    ) -> None:
        super().__init__(message, result)
        self.host = host
        self.task = task
        self.failed_hosts = failed_hosts

    def __str__(self) -> str:
        where = " ".join(
            part
            for part in (
                f"host {self.host}" if self.host else "",
                f"task '{self.task}'" if self.task else "",
            )
            if part
        )
        return f"{where}: {self.message}" if where else self.message


class HostUnreachable(PlaybookFailed):
    """Ansible could not reach a host."""


class InvalidInput(PlaybookFailed, ValueError):
    """The inputs were rejected: by a validation play, an argument spec, or before any run."""


class RunInterrupted(RunnerError):
    """The run was cancelled (Ctrl-C, SIGTERM or Cluster.cancel()).

    `stopped` says whether the training ranks were stopped on the cluster afterwards; when it is
    False and `run_id` is set, the run may still be going (detached, or the stop failed).
    """

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        stopped: bool = False,
        result: RunResult | None = None,
    ) -> None:
        super().__init__(message, result)
        self.run_id = run_id
        self.stopped = stopped


def exit_code(error: RunnerError) -> int:
    """The CLI's exit status for `error`."""
    if isinstance(error, RunInterrupted):
        return EXIT_INTERRUPTED
    if isinstance(error, InvalidInput):
        return EXIT_INVALID_INPUT
    if isinstance(error, HostUnreachable):
        return EXIT_UNREACHABLE
    return EXIT_FAILED
