"""What the llama-job tests share: `pair_factory`, real agent pairs made by a test and closed
after it (tests/support/llama_job_support.py)."""

from tests.support.llama_job_support import pair_factory  # noqa: F401 - a fixture, registered here
