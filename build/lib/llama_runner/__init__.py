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
    RUN_STATES,
    Event,
    HostStats,
    RunResult,
    RunStatus,
    TrainProgress,
    TrainSummary,
)

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
    "TrainProgress",
    "TrainSummary",
]
