"""llama-cluster's playbooks from Python, through ansible-runner: the API (Cluster), its results
and errors. The command line is llama_runner.cli (train_runner.py at the repository root).

A run's status is llama-job's own type, from the project's collection (JobStatus, Phase,
FailureKind: plugins/module_utils/llama_job/protocol.py); checkout.open_checkout makes the
collection importable first."""

from llama_runner.checkout import open_checkout

open_checkout()

# After the checkout is open: the collection's modules import by their real names.
from ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol import (  # noqa: E402
    FailureKind,
    JobStatus,
    Phase,
)

from llama_runner.api import (  # noqa: E402
    DEFAULT_INVENTORY,
    DEFAULT_KEEP_ARTIFACTS,
    DEFAULT_PRIVATE_DATA_DIR,
    PLAYBOOKS,
    PROJECT_DIR,
    Cluster,
)
from llama_runner.errors import (  # noqa: E402
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
from llama_runner.events import EventCallback, ProgressCallback  # noqa: E402
from llama_runner.results import (  # noqa: E402
    Event,
    HostStats,
    RunResult,
    TrainProgress,
    TrainSummary,
)
from llama_runner.scaling import Scaling  # noqa: E402

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
    "Cluster",
    "Event",
    "EventCallback",
    "FailureKind",
    "HostStats",
    "HostUnreachable",
    "InvalidInput",
    "JobStatus",
    "Phase",
    "PlaybookFailed",
    "ProgressCallback",
    "RunInterrupted",
    "RunResult",
    "RunnerError",
    "Scaling",
    "TrainProgress",
    "TrainSummary",
]
