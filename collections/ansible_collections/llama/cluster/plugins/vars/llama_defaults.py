"""The project's defaults (group_vars/all/*.yml), beneath every value of the user's inventory."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleParserError
from ansible.inventory.group import Group, InventoryObjectType
from ansible.inventory.host import Host
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.vars import BaseVarsPlugin
from ansible.utils.vars import combine_vars
from ansible_collections.llama.cluster.plugins.module_utils.project import GROUP_VARS_DIR

DOCUMENTATION = """
    name: llama_defaults
    short_description: The project's group_vars/all/*.yml as the lowest group variables
    description:
      - Loads the project's top-level group_vars/all/*.yml into the group C(all) once the inventory
        is parsed, leaving out every variable the inventory itself sets on C(all).
      - The defaults then sit beneath every value of the inventory, the inventory's C(all) vars
        included. Being templates, they are still evaluated per host (cuda_version follows each
        host's cluster_accelerator).
      - Enabled in ansible.cfg together with llama_group_vars, which loads every other
        group_vars/ and host_vars/ directory as host_group_vars does.
    options:
      stage:
        description: Runs once, after the inventory is parsed (the values land in the group all).
        default: inventory
        choices: [inventory]
        type: str
"""

DEFAULTS_DIR = GROUP_VARS_DIR


class VarsModule(BaseVarsPlugin):
    """Supplies the project's defaults to the group all."""

    is_stateless = True

    def get_vars(
        self,
        loader: DataLoader,
        path: str,
        entities: list[Host | Group] | Host | Group,
        cache: bool = True,
    ) -> dict[str, Any]:
        """The project's defaults that the group all does not set itself, for the group all."""
        if not isinstance(entities, list):
            entities = [entities]
        data: dict[str, Any] = {}
        for entity in entities:
            if entity.base_type is not InventoryObjectType.GROUP or entity.name != "all":
                continue
            for found in loader.find_vars_files(str(DEFAULTS_DIR), "all"):
                try:
                    new = loader.load_from_file(
                        found, cache="all", unsafe=True, trusted_as_template=True
                    )
                except Exception as err:
                    raise AnsibleParserError(f"Could not load the defaults {found}: {err}") from err
                if new:
                    data = combine_vars(data, new)
            # The inventory's own values for `all` ([all:vars], all.vars) win.
            data = {key: value for key, value in data.items() if key not in entity.vars}
        return data
