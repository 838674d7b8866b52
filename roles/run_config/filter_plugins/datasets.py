"""Filters for the run's datasets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def run_config_dataset_files(
    datasets: list[Mapping[str, Any]], checked: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The run's datasets, in order, each with the file to train on that its check returned.

    checked maps a dataset name to a check result ({"file": ...}, as llama_dataset_check returns
    it); a dataset without one keeps its file.
    """
    return [
        {**entry, "file": checked[entry["name"]]["file"]}
        if entry["name"] in checked
        else dict(entry)
        for entry in datasets
    ]


class FilterModule:
    """The run_config role's dataset filters."""

    def filters(self) -> dict[str, Any]:
        """Map filter names to functions."""
        return {"run_config_dataset_files": run_config_dataset_files}
