"""Rank 0's trainer log, read as the playbooks read it: the collection's
plugins/module_utils/trainer_log.py (last_attempt, log_figures), loaded from the checkout that
this package drives, so that there is one definition of a run's last attempt."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

SOURCE = Path("collections/ansible_collections/llama/cluster/plugins/module_utils/trainer_log.py")
_NAME = "llama_runner._collection_trainer_log"


def _module() -> ModuleType:
    """The collection's module (stdlib only), loaded once."""
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    from llama_runner.api import find_project_dir  # noqa: PLC0415 - api imports this package

    path = find_project_dir() / SOURCE
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}: is {find_project_dir()} a llama-cluster checkout?")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_NAME] = module
    return module


def parse_records(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a trainer log's text (a partial line skipped)."""
    return _module().parse_records(text)


def last_attempt(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records after the last place where current_steps goes back."""
    return _module().last_attempt(records)


def log_figures(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """last_step, total_steps, final_loss, elapsed and records of the last attempt."""
    return _module().log_figures(records)
