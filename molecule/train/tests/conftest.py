"""What the train scenario's test modules share: one tiny run that several of them observe.

A train.yml run costs about two minutes on the lab (most of it the play around a few seconds of
training), so the tests that only need a finished tiny run look at the same one: the token test
(test_models: -v output and every file, with a fake hub token), the tracking and serving tests
(test_serve: report_to tensorboard and TensorBoard on the master) and the plain 2-node run
(test_train). Each asserts what it proves on that run's output, files and nodes.
"""

from __future__ import annotations

import time

import pytest
from scenario import _playbook

# A recognisable fake hub token: test_models asserts it shows nowhere but in its 0600 file.
HF_TOKEN = "hf_FAKE_llama_cluster_1234567890"


@pytest.fixture(scope="session")
def tiny_run() -> dict[str, object]:
    """train.yml -v -e model=tiny -e hf_token=... -e tensorboard=true, run once: its output."""
    started = time.monotonic()
    done = _playbook(
        "train.yml", "-v", "-e", "model=tiny", "-e", f"hf_token={HF_TOKEN}",
        "-e", "tensorboard=true", timeout=1200,
    )  # fmt: skip
    seconds = time.monotonic() - started
    print(f"the shared tiny run: {seconds:.0f} s")
    return {"done": done, "seconds": seconds}
