"""The NVIDIA driver decision for roles/nvidia_driver (plugins/module_utils/driver.py), as filters.

`facts | llama.cluster.nvidia_driver_action(host=..., driver_min=..., ...)` returns keep, install,
upgrade or blocked, whether a reboot is needed, the reason and the message the node stops with.
Bad facts fail the task naming the node and the fact.

`driver_from_repo | llama.cluster.nvidia_apt_preferences(decision)` is the apt preferences file
that keeps NVIDIA's CUDA repository from replacing the driver's packages (roles/cuda_toolkit),
holding the driver the decision keeps when the driver itself comes from that repository.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.llama.cluster.plugins.module_utils.driver import (
    apt_preferences,
    driver_action,
    held_driver,
)
from ansible_collections.llama.cluster.plugins.module_utils.planner.schema import as_flag


def nvidia_driver_action(facts: Mapping[str, Any], **options: Any) -> dict[str, Any]:  # noqa: ANN401
    """driver_action (module_utils/driver.py) on the node's facts, its errors as filter errors."""
    host = str(options.get("host", "this node"))
    for flag in ("allow_reboot", "controller", "mok_enrolled"):
        if flag in options:
            options[flag] = as_flag(options[flag])
    if "inventory" in options:
        options["inventory"] = [str(source) for source in options["inventory"] or []]
    try:
        return driver_action(facts, **options)
    except ValueError as err:
        raise AnsibleFilterError(
            f"{host}: cannot decide on the NVIDIA driver: {err}. Run provision.yml --tags"
            " host_facts to record the node's facts again."
        ) from err
    except TypeError as err:
        raise AnsibleFilterError(f"nvidia_driver_action: {err}") from err


def nvidia_apt_preferences(driver_from_repo: object, decision: Mapping[str, Any] | None) -> str:
    """apt_preferences (module_utils/driver.py) for the node's driver decision."""
    if decision is not None and not isinstance(decision, Mapping):
        raise AnsibleFilterError(f"nvidia_apt_preferences: the decision is {decision!r}")
    try:
        return apt_preferences(as_flag(driver_from_repo), held_driver(decision))
    except ValueError as err:
        raise AnsibleFilterError(f"nvidia_apt_preferences: {err}") from err


class FilterModule:
    """The NVIDIA driver decision and the pin of its packages."""

    def filters(self) -> dict[str, Any]:
        """Filter names."""
        return {
            "nvidia_driver_action": nvidia_driver_action,
            "nvidia_apt_preferences": nvidia_apt_preferences,
        }
