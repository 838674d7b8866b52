"""The model staging's filters outside the run_plan action: whether the Hugging Face token may go
to the endpoint the nodes download from, and, where the controller cannot reach the hub and
train.yml asks the master, the headers of that GET and its answer as the action reads it (the
plan itself is made by the run_plan action)."""

from __future__ import annotations

from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    model_stage_answer,
    model_stage_headers,
    model_stage_token_policy,
)


class FilterModule:
    """Where a run's token may go, and the master's question to the hub."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "model_stage_token_policy": model_stage_token_policy,
            "model_stage_headers": model_stage_headers,
            "model_stage_answer": model_stage_answer,
        }
