"""The preview of a check-mode run: per node and as one table, what a real run would change."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path
from typing import Any

from ansible import context
from ansible.plugins.callback import CallbackBase
from ansible_collections.llama.cluster.plugins.module_utils.preview import (
    CATEGORIES,
    Item,
    classify,
)

DOCUMENTATION = """
    name: llama_preview
    type: aggregate
    short_description: what a check-mode run would change, per node and as one table
    description:
      - Classifies every task result (module, arguments, result) into the preview's categories
        (driver, packages, firewall, sysctls, users, files, services, commands) with
        llama.cluster's module_utils/preview.py.
      - In check mode (C(ansible-playbook provision.yml --check)) it prints, after the recap,
        the PREVIEW block, every node's items, then one table of counts, the driver action and
        whether a reboot would follow. A real run prints nothing more.
      - With C(LLAMA_PREVIEW_LOG) set, every run (check or real) appends one JSON line of what it
        classified, so that a preview and the run after it can be compared.
    requirements:
      - enable in callbacks_enabled (ansible.cfg does)
    options:
      log:
        description: A file to which each run appends one JSON line of its items per node.
        env:
          - name: LLAMA_PREVIEW_LOG
        ini:
          - section: callback_llama_preview
            key: log
        default: ''
"""


CONTROLLER_NAMES = {"localhost", "127.0.0.1", "::1"}


class CallbackModule(CallbackBase):
    """Collects what each task changed, or would change, per node."""

    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "llama.cluster.llama_preview"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._items: dict[str, dict[str, list[str]]] = {}
        self._started = time.monotonic()
        self._playbook = ""

    @property
    def _check(self) -> bool:
        return bool(context.CLIARGS.get("check"))

    def v2_playbook_on_start(self, playbook: Any) -> None:  # noqa: ANN401 - Ansible's Playbook
        self._playbook = Path(playbook._file_name).name

    def _record(self, result: Any) -> None:  # noqa: ANN401 - Ansible's TaskResult
        delegated = result._result.get("_ansible_delegated_vars") or {}
        if delegated and (
            delegated.get("ansible_connection") == "local"
            or delegated.get("ansible_host") in CONTROLLER_NAMES
            or delegated.get("ansible_delegated_host") in CONTROLLER_NAMES
        ):
            return  # a change of the controller's, not of the node's
        task = result._task
        action = getattr(task, "resolved_action", None) or task.action
        outcomes = result._result.get("results")
        if not isinstance(outcomes, list):
            outcomes = [result._result]
        host = self._items.setdefault(result._host.get_name(), {})
        for outcome in outcomes:
            if not isinstance(outcome, dict):
                continue
            for item in classify(str(action), task.args or {}, outcome, self._check):
                listed = host.setdefault(item.category, [])
                if item.text not in listed:
                    listed.append(item.text)

    def v2_runner_on_ok(self, result: Any) -> None:  # noqa: ANN401 - Ansible's TaskResult
        self._record(result)

    def v2_runner_on_skipped(self, result: Any) -> None:  # noqa: ANN401 - Ansible's TaskResult
        self._record(result)

    def v2_playbook_on_stats(self, stats: Any) -> None:  # noqa: ANN401 - AggregateStats
        log = self.get_option("log")
        if log:
            line = {"check": self._check, "playbook": self._playbook, "hosts": self._items}
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            with Path(log).open("a", encoding="utf-8") as out:
                out.write(json.dumps(line, sort_keys=True) + "\n")
        # A playbook that ended before its node plays (train.yml --check ends after its plan)
        # has no node's changes to list: the PLAN block would be an empty table.
        if self._check and set(self._items) - CONTROLLER_NAMES:
            self._display.display(render(self._items, time.monotonic() - self._started))


def render(items: dict[str, dict[str, list[str]]], seconds: float) -> str:
    """The PREVIEW block: every node's items, then the table."""
    lines = [
        "",
        f"PREVIEW (check mode, {seconds:.0f} s: nothing was changed; a real run would do this) "
        + "*" * 20,
    ]
    if any(found.get("commands") for found in items.values()):
        lines.append(
            "(commands: check mode cannot run them; a real run would, and they may change)"
        )
    for host in sorted(h for h in items if any(items[h].values())):
        lines.append(f"{host}:")
        found = items[host]
        for category in CATEGORIES:
            texts = found.get(category, [])
            if category == "packages":
                texts = grouped(texts)
            for n, text in enumerate(texts):
                lines.append(f"  {category if n == 0 else '':<10}{text}")
        if not any(found.get(c) for c in CATEGORIES if c != "driver"):
            lines.append("  (no change)")
    lines += ["", table(items)]
    return "\n".join(lines)


def grouped(texts: list[str], width: int = 100) -> list[str]:
    """Packages of one source on wrapped lines: 'apt (3): a, b, c'."""
    sources: dict[str, list[str]] = {}
    lines = []
    for text in texts:
        source, _, package = text.partition(": ")
        if " " in package.strip("+- "):  # what an install asks for, not one package: a line
            lines += textwrap.wrap(text, width=width, break_on_hyphens=False)
        else:
            sources.setdefault(source, []).append(package)
    for source, packages in sources.items():
        lines += textwrap.wrap(
            f"{source} ({len(packages)}): {', '.join(packages)}",
            width=width,
            break_on_hyphens=False,
        )
    return lines


def table(items: dict[str, dict[str, list[str]]]) -> str:
    """One row per node: the driver action, reboot or not, and the count of each category."""
    counted = [c for c in CATEGORIES if c != "driver"]
    header = ["node", "driver", "reboot", *counted]
    rows = [header]
    for host in sorted(h for h in items if any(items[h].values())):
        found = items[host]
        driver = (found.get("driver") or ["-"])[0]
        action = driver.split(",", 1)[0]
        reboot = "yes" if ", reboot:" in driver else "no" if driver != "-" else "-"
        rows.append([host, action, reboot, *(str(len(found.get(c, []))) for c in counted)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    out = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in out)


__all__ = ["CallbackModule", "Item", "render", "table"]
