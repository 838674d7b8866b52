"""The checkout this package drives, and its collection made importable.

llama_runner imports the project's collection (llama.cluster) by its real names, as the
playbooks' plugins do: llama-job's protocol (`ansible_collections.llama.cluster.plugins.
module_utils.llama_job.protocol`: a job's phases, failure kinds and status) and rank 0's trainer
log reader (`...module_utils.trainer_log`). `open_checkout` makes those imports work: it starts
Ansible's collection finder over the checkout's collections, unless it already runs in this
process (Ansible's own plugins, the tests). llama_runner/__init__.py calls it first.
"""

from __future__ import annotations

import os
from pathlib import Path

from ansible.plugins.loader import init_plugin_loader
from ansible.utils.collection_loader import AnsibleCollectionConfig


class NotACheckout(ImportError):
    """llama_runner runs outside a llama-cluster checkout: nothing to drive, no collection."""


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


def _finder_runs() -> bool:
    """Whether Ansible's collection finder already owns `ansible_collections` in this process."""
    return AnsibleCollectionConfig.collection_finder is not None


def open_checkout() -> Path:
    """The checkout, with its collection importable; NotACheckout names the fix where there is
    no checkout to drive."""
    root = find_project_dir()
    if _finder_runs():
        return root
    collections = root / "collections"
    if not (collections / "ansible_collections" / "llama" / "cluster").is_dir():
        raise NotACheckout(
            f"{root} is not a llama-cluster checkout (no train.yml, or no collections/): run "
            "inside one, or set LLAMA_CLUSTER_DIR=<checkout>",
            name="llama_runner",
        )
    init_plugin_loader([str(collections), str(root / ".cache" / "collections")])
    return root
