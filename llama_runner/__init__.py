"""llama-cluster's playbooks from Python, through ansible-runner: the API (Cluster), its results
and errors. The command line is llama_runner.cli (train_runner.py at the repository root)."""

from llama_runner.api import (
    DEFAULT_INVENTORY,
    DEFAULT_KEEP_ARTIFACTS,
    DEFAULT_PRIVATE_DATA_DIR,
    PLAYBOOKS,
    PROJECT_DIR,
    Cluster,
)
from llama_runner.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_INVALID_INPUT,
    EXIT_OK,
    EXIT_UNREACHABLE,
    HostUnreachable,
    InvalidInput,
    PlaybookFailed,
    RunInterrupted,
    RunnerError,
)
from llama_runner.events import EventCallback, ProgressCallback
from llama_runner.results import (
    Event,
    HostStats,
    RunResult,
    RunStatus,
    TrainProgress,
    TrainSummary,
)
from llama_runner.scaling import Scaling

__all__ = [
    "DEFAULT_INVENTORY",
    "DEFAULT_KEEP_ARTIFACTS",
    "DEFAULT_PRIVATE_DATA_DIR",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID_INPUT",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "PLAYBOOKS",
    "PROJECT_DIR",
    "RUN_STATES",
    "Cluster",
    "Event",
    "EventCallback",
    "HostStats",
    "HostUnreachable",
    "InvalidInput",
    "PlaybookFailed",
    "ProgressCallback",
    "RunInterrupted",
    "RunResult",
    "RunStatus",
    "RunnerError",
    "Scaling",
    "TrainProgress",
    "TrainSummary",
]


def __getattr__(name: str) -> object:
    """RUN_STATES: the states of a run (the protocol's, loaded from the checkout on first use)."""
    if name == "RUN_STATES":
        from llama_runner import results  # noqa: PLC0415 - a lazy attribute

        return results.RUN_STATES
    raise AttributeError(name)
