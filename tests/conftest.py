"""What every test shares.

- The project's collection (llama.cluster) importable as Ansible imports it: Ansible's collection
  finder owns the `ansible_collections` package once anything starts Ansible's plugin loader in
  this process; it is started first, with the project's collections paths (as ansible.cfg names
  them), so that every test imports the plugins by their real names.
- DATA: the dataset files the checks are tried on. tests/data/datasets.json holds each one's exact
  text (broken ones included); they are written once per session into a directory of their own,
  beside tests/data/sharegpt_mixed.json (which molecule's train scenario reads too).
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

from ansible.plugins.loader import init_plugin_loader

ROOT = Path(__file__).resolve().parents[1]

init_plugin_loader([str(ROOT / "collections"), str(ROOT / ".cache" / "collections")])


def _materialise_datasets() -> Path:
    where = Path(tempfile.mkdtemp(prefix="llama-datasets-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    sources = ROOT / "tests" / "data"
    texts = json.loads((sources / "datasets.json").read_text(encoding="utf-8"))
    for name, text in texts.items():
        (where / name).write_text(text, encoding="utf-8")
    shutil.copy2(sources / "sharegpt_mixed.json", where / "sharegpt_mixed.json")
    return where


DATA = _materialise_datasets()
