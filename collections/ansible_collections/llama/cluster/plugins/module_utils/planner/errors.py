"""What every part of the planner shares: its error, and the data files its messages name."""

from __future__ import annotations

try:  # Ansible turns a filter error into the task's failure message.
    from ansible.errors import AnsibleFilterError as _BaseError
except ImportError:  # pragma: no cover - the planner is also usable without Ansible
    _BaseError = ValueError  # type: ignore[assignment,misc]

TRAINING_FILE = "group_vars/all/training.yml"
CATALOGUE_FILE = "group_vars/all/models.yml"


class PlanError(_BaseError):
    """A request, an inventory or a rule the planner cannot plan, with what to change."""
