"""The project's plugins, modules and scripts, loaded from their files for the tests.

They are not a package: Ansible loads them by path, and so do the tests. A module is registered
in sys.modules under its name while it runs, because dataclasses look their module up there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(path: str | Path, name: str | None = None) -> ModuleType:
    """The module in `path` (relative to the project's root, or absolute), freshly executed."""
    source = ROOT / path
    name = name or source.stem
    spec = importlib.util.spec_from_file_location(name, source)
    assert spec is not None, f"cannot load {source}"
    assert spec.loader is not None, f"cannot load {source}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
