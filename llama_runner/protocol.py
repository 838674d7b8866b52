"""The llama-job protocol as this package reads it: the collection's
plugins/module_utils/llama_job/protocol.py (a job's phases, a rank's status, a job's outcome,
the run states), imported under its real name from the checkout this package drives, so that
the node's supervisor, the playbooks' module and filters, and this API share one definition."""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from types import ModuleType

NAME = "ansible_collections.llama.cluster.plugins.module_utils.llama_job.protocol"


def _checkout() -> Path:
    """The checkout (api.find_project_dir's rule, without importing api: it imports this)."""
    given = os.environ.get("LLAMA_CLUSTER_DIR")
    if given:
        return Path(given).expanduser().resolve()
    here = Path.cwd().resolve()
    for candidate in (Path(__file__).resolve().parents[1], here, *here.parents):
        if (candidate / "collections" / "ansible_collections" / "llama" / "cluster").is_dir():
            return candidate
    return here


@functools.cache
def protocol() -> ModuleType:
    """The protocol module (loaded on first use: outside a checkout this package still imports,
    and says what is missing): already importable where Ansible's collection finder runs in this
    process, else once that finder is started with the checkout's collections."""
    try:
        return importlib.import_module(NAME)
    except ImportError:
        pass
    from ansible.plugins.loader import init_plugin_loader  # noqa: PLC0415 - only when needed

    root = _checkout()
    init_plugin_loader([str(root / "collections"), str(root / ".cache" / "collections")])
    return importlib.import_module(NAME)
