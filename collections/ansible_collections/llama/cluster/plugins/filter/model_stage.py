"""The model staging's filter on the nodes' side: whether the Hugging Face token may go to the
endpoint the nodes download from (the plan itself is made by the run_plan action)."""

from __future__ import annotations

from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.planner.model import (
    model_stage_token_policy,
)


class FilterModule:
    """Where a run's token may go."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {"model_stage_token_policy": model_stage_token_policy}
