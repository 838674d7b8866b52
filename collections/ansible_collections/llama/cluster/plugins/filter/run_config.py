"""The run planner's Jinja filters, as roles/run_config and train.yml call them (the planner
itself is plugins/module_utils/planner; llama.cluster.run_plan plans a new run)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ansible_collections.llama.cluster.plugins.module_utils.planner.checkpoints import (
    resume_point,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.disk import disk_budget
from ansible_collections.llama.cluster.plugins.module_utils.planner.nodes import (
    hosts_without_gpu_facts,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.render import (
    dataset_info,
    run_files,
    train_yaml,
)


def unprobed(ranks: Iterable[str], hostvars: Any) -> list[str]:  # noqa: ANN401 - hostvars
    """The GPU nodes whose facts do not list their GPUs yet."""
    return hosts_without_gpu_facts(list(ranks), hostvars)


class FilterModule:
    """The run planner's filters."""

    def filters(self) -> dict[str, Any]:
        """The filters this plugin provides."""
        return {
            "run_config_unprobed": unprobed,
            "run_config_train_yaml": train_yaml,
            "run_config_dataset_info": dataset_info,
            "run_config_files": run_files,
            "run_config_resume_point": resume_point,
            "run_config_disk_budget": disk_budget,
        }
