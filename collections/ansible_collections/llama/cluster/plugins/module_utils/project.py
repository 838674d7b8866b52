"""Where the project is: this collection lives in the project's tree, at
<project>/collections/ansible_collections/llama/cluster, wherever ansible runs from."""

from __future__ import annotations

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[6]
GROUP_VARS_DIR = PROJECT_DIR / "group_vars"
