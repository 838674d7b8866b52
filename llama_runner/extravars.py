"""Extra variables as data, never as templates.

ansible-playbook evaluates Jinja in every string of its extra variables: a value such as
`tiny{{ lookup('pipe', 'touch /tmp/x') }}`, handed to Cluster.train() by a program that took it
from its own user, would run a command on the controller. So every string the API passes (each
value, each key, at any depth; public and secret alike) reaches ansible-playbook marked with
Ansible's `!unsafe` tag, in YAML: Ansible keeps such a string as it is, wherever it goes.

The public variables travel as one line of flow YAML after `-e` (the command line that
ansible-runner records in artifacts/<ident>/command, as before); the secret ones in the 0600
file of llama_runner/secrets.py, in the same YAML.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

UNSAFE_TAG = "!unsafe"


class UnsafeDumper(yaml.SafeDumper):
    """YAML for Ansible's extra variables: every string tagged !unsafe, double-quoted (so that
    any character, a newline or a quote, is escaped and the text stays on one line)."""


def _unsafe_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    return dumper.represent_scalar(UNSAFE_TAG, value, style='"')


UnsafeDumper.add_representer(str, _unsafe_str)


def plain(name: str, value: object) -> object:
    """`value` as the plain data YAML writes (mappings, lists, strings, numbers, booleans, None);
    ValueError naming the variable and the path inside it where a value is none of those."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"extra variable {name} = {value}: a number must be finite")
        return float(value)
    if isinstance(value, Mapping):
        out: dict[object, object] = {}
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise ValueError(
                    f"extra variable {name}: key {key!r} must be a string (or an integer)"
                )
            out[plain(f"{name}.{key}", key)] = plain(f"{name}.{key}", item)
        return out
    if isinstance(value, list | tuple):
        return [plain(f"{name}[{index}]", item) for index, item in enumerate(value)]
    raise ValueError(
        f"extra variable {name} is a {type(value).__name__}: pass text, a number, true/false, "
        "a list or a mapping of those"
    )


def check_names(variables: Mapping[str, Any]) -> None:
    """ValueError naming every top-level name that is not a variable name Ansible takes."""
    bad = [repr(name) for name in variables if not (isinstance(name, str) and name.isidentifier())]
    if bad:
        raise ValueError(
            f"extra variable names must be identifiers (letters, digits, '_', not starting with a "
            f"digit): {', '.join(bad)}"
        )


def unsafe_yaml(variables: Mapping[str, Any], *, one_line: bool) -> str:
    """The variables as YAML with every string !unsafe: one line of flow YAML (`one_line`, for
    `-e`) or a block document (for a file). ValueError as plain() and check_names() raise it."""
    check_names(variables)
    data = {name: plain(name, value) for name, value in variables.items()}
    if one_line:
        text = yaml.dump(
            data, Dumper=UnsafeDumper, default_flow_style=True, width=math.inf, allow_unicode=True
        )
        return text.strip()
    return yaml.dump(data, Dumper=UnsafeDumper, default_flow_style=False, allow_unicode=True)


def argument(variables: Mapping[str, Any]) -> str:
    """The `cmdline` of ansible-runner that passes `variables` ("" for none): `-e` and their
    one line of YAML, quoted for the shell-like split ansible-runner makes of it."""
    return f"-e {shlex.quote(unsafe_yaml(variables, one_line=True))}" if variables else ""
