"""group_vars/ and host_vars/ beside the inventory and the playbook, as host_group_vars loads them,
except the project's own group_vars/all (llama_defaults supplies it, beneath the inventory)."""

from __future__ import annotations

import os
from typing import Any

from ansible.inventory.group import Group, InventoryObjectType
from ansible.inventory.host import Host
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.vars import BaseVarsPlugin
from ansible.plugins.vars.host_group_vars import VarsModule as HostGroupVars
from ansible.utils.path import basedir
from ansible_collections.llama.cluster.plugins.module_utils import project

DOCUMENTATION = """
    name: llama_group_vars
    short_description: host_group_vars, without the project's defaults
    description:
      - Loads group_vars/ and host_vars/ beside the inventory sources and the playbooks exactly as
        ansible.builtin.host_group_vars does, except the project's top-level group_vars/all.
      - host_group_vars would load that directory as playbook-adjacent group_vars for the playbooks
        in the project's root (provision.yml, train.yml), and as inventory-adjacent group_vars for
        an inventory kept there, both above the inventory's own group variables. llama_defaults
        supplies it instead, beneath every inventory value.
    extends_documentation_fragment:
      - vars_plugin_staging
"""

PROJECT_DIR = str(project.PROJECT_DIR)


class VarsModule(BaseVarsPlugin):
    """host_group_vars that leaves the project's group_vars/all to llama_defaults.

    It runs host_group_vars' own code rather than inheriting its class: a collection's vars plugin
    with host_group_vars' REQUIRES_ENABLED makes Ansible print a warning on every run, which
    ansible-runner hands to callers as an event of its own."""

    is_stateless = True
    load_found_files = HostGroupVars.load_found_files

    def get_vars(
        self,
        loader: DataLoader,
        path: str,
        entities: list[Host | Group] | Host | Group,
        cache: bool = True,
    ) -> dict[str, Any]:
        """Variables of `entities` from the group_vars/ and host_vars/ beside `path`."""
        if not isinstance(entities, list):
            entities = [entities]
        if os.path.realpath(basedir(path)) == PROJECT_DIR:
            entities = [
                e
                for e in entities
                if not (e.base_type is InventoryObjectType.GROUP and e.name == "all")
            ]
        return HostGroupVars.get_vars(self, loader, path, entities, cache=cache)
