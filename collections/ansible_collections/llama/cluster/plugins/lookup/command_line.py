"""Lookup plugin: what this ansible-playbook run was given on its command line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible import context
from ansible.plugins.lookup import LookupBase
from ansible.utils.vars import load_extra_vars

DOCUMENTATION = r"""
name: command_line
author: llama-cluster
short_description: What this ansible-playbook run was given on its command line
description:
  - Returns one mapping, C(extra_vars) (the names of the extra variables, -e and -e @file),
    C(become) (whether -b/--become was given) and C(playbooks) (the paths of the playbooks run).
  - None of it is a variable a task can read otherwise. roles/inventory_check refuses an extra
    variable that nothing reads (filter unknown_vars) and a node it cannot become root on
    (filter inventory_report's become).
"""

EXAMPLES = r"""
given: "{{ query('llama.cluster.command_line') | first }}"
"""

RETURN = r"""
_raw:
  description: One mapping of extra_vars (names), become (true/false) and playbooks (paths).
  type: list
  elements: dict
"""


class LookupModule(LookupBase):
    """query('llama.cluster.command_line')."""

    def run(
        self, terms: list[Any], variables: Mapping[str, Any] | None = None, **kwargs: object
    ) -> list[dict[str, Any]]:
        """The command line's extra variables (names), become and playbooks."""
        # Parsed once by ansible-playbook before the play (and kept: an -e @file may be gone).
        return [
            {
                "extra_vars": sorted(load_extra_vars(self._loader)),
                "become": bool(context.CLIARGS.get("become")),
                "playbooks": [str(path) for path in context.CLIARGS.get("args", ())],
            }
        ]
