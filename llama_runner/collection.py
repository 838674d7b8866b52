"""The project's collection as this package reads it, from the checkout it drives.

`find_project_dir` finds the checkout. `protocol()` is llama-job's protocol (a job's phases, a
rank's status, a job's outcome, the run states: plugins/module_utils/llama_job/protocol.py) and
`trainer_log()` rank 0's trainer log as the playbooks read it (last_attempt, log_figures:
plugins/module_utils/trainer_log.py). Both are imported under their real names through Ansible's
collection finder, so that the node's supervisor, the playbooks' modules and filters, and this
API share one definition of each. They load on first use: outside a checkout this package still
imports, and Cluster says what is missing.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from types import ModuleType

MODULE_UTILS = "ansible_collections.llama.cluster.plugins.module_utils"


def find_project_dir() -> Path:
    """The llama-cluster checkout to drive: $LLAMA_CLUSTER_DIR, else the tree this package sits in
    (a checkout, or `pip install -e .`), else the current directory or the nearest one above it
    that holds train.yml and ansible.cfg (the `llama-cluster` command of `pip install .`, run
    inside a checkout). Where none is found, the current directory (Cluster says what is missing).
    """
    given = os.environ.get("LLAMA_CLUSTER_DIR")
    if given:
        return Path(given).expanduser().resolve()
    here = Path.cwd().resolve()
    for candidate in (Path(__file__).resolve().parents[1], here, *here.parents):
        if (candidate / "train.yml").is_file() and (candidate / "ansible.cfg").is_file():
            return candidate
    return here


def _import(name: str) -> ModuleType:
    """A module of the collection's module_utils: already importable where Ansible's collection
    finder runs in this process, else once that finder is started with the checkout's
    collections."""
    try:
        return importlib.import_module(f"{MODULE_UTILS}.{name}")
    except ImportError:
        pass
    from ansible.plugins.loader import init_plugin_loader  # noqa: PLC0415 - only when needed

    root = find_project_dir()
    init_plugin_loader([str(root / "collections"), str(root / ".cache" / "collections")])
    return importlib.import_module(f"{MODULE_UTILS}.{name}")


@functools.cache
def protocol() -> ModuleType:
    """llama-job's protocol module."""
    return _import("llama_job.protocol")


@functools.cache
def trainer_log() -> ModuleType:
    """The trainer log's reader (parse_records, last_attempt, log_figures)."""
    return _import("trainer_log")
