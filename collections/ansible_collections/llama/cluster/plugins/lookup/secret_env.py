"""Lookup plugin: a secret of the controller's environment, however the playbook was started."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: secret_env
author: llama-cluster
short_description: A secret from the controller's environment (HF_TOKEN, WANDB_API_KEY, ...)
description:
  - Returns the value of each named environment variable of the controller, or "" when unset.
  - Started by ansible-playbook, that is its own environment, as ansible.builtin.env reads it.
  - Started by llama_runner (train_runner.py, the Python API), the secret variables of the
    controller's environment are left out of the environment that ansible-runner records in its
    artifacts and passed instead in a 0600 extra-vars file as the variable runner_secret_env;
    this lookup reads them there first.
options:
  _terms:
    description: Names of environment variables.
    required: true
"""

EXAMPLES = r"""
hf_token: "{{ lookup('llama.cluster.secret_env', 'HF_TOKEN') }}"
"""

RETURN = r"""
_raw:
  description: The value of each variable, "" when it is not set.
  type: list
  elements: str
"""

PASSED = "runner_secret_env"


def secret_env(
    names: list[str], passed: Mapping[str, Any] | None, environ: Mapping[str, str]
) -> list[str]:
    """Each name's value: the runner's copy first, then the environment, else ""."""
    passed = passed if isinstance(passed, Mapping) else {}
    values = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise AnsibleLookupError(
                f"secret_env takes names of environment variables, not {name!r}"
            )
        values.append(str(passed.get(name) or environ.get(name, "")))
    return values


class LookupModule(LookupBase):
    """lookup('llama.cluster.secret_env', NAME, ...)."""

    def run(
        self, terms: list[Any], variables: Mapping[str, Any] | None = None, **kwargs: object
    ) -> list[str]:
        """The values of the named variables."""
        passed = (variables or {}).get(PASSED)
        return secret_env(list(terms), passed, os.environ)
