"""The project's collection (llama.cluster) importable as Ansible imports it.

Ansible's collection finder owns the `ansible_collections` package once anything starts Ansible's
plugin loader in this process; start it first, with the project's collections paths (as
ansible.cfg names them), so that every test imports the plugins by their real names."""

from __future__ import annotations

from pathlib import Path

from ansible.plugins.loader import init_plugin_loader

ROOT = Path(__file__).resolve().parents[1]

init_plugin_loader([str(ROOT / "collections"), str(ROOT / ".cache" / "collections")])
