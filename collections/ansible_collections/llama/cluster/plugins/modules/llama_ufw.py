#!/usr/bin/python
"""Bring ufw to the cluster's rules, logging level, default policies and state in one call.

community.general.ufw reads ufw's state again for every rule, level and policy, and its
`default` and `logging` actions reload the firewall each time (1.7 s for a policy that was
already set); a node's firewall took ten tasks and 10 s of a no-op provision.yml. This module
reads the state once (`ufw status`, `ufw show added`, ufw's two configuration files) and runs
ufw only for what differs, in the order that never locks anyone out: the allow rules first, then
logging and the default policies, then `ufw --force enable`. Rules are only added, as the role
always did: rules it no longer asks for are left to the operator.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_ufw
short_description: Bring ufw to a set of allow rules, a logging level, default policies and a state
description:
  - Reads ufw's state once and runs ufw only for what differs; allow rules come before the
    policies and before ufw is enabled.
options:
  rules:
    description:
      - Allow rules; each has port (a port, a list "a,b" or a range "a:b"), proto, sources (a
        list of "any", addresses or networks: one ufw rule each) and comment.
    type: list
    elements: dict
    default: []
  logging:
    description: ufw's logging level (off, low, medium, high, full); empty leaves it.
    type: str
    default: ""
  default_incoming:
    description: The default incoming policy (deny, allow, reject); empty leaves it.
    type: str
    default: ""
  default_outgoing:
    description: The default outgoing policy (deny, allow, reject); empty leaves it.
    type: str
    default: ""
  state:
    description: enabled or disabled.
    type: str
    default: enabled
    choices: [enabled, disabled]
author: llama-cluster
"""

RETURN = r"""
commands:
  description: The ufw commands run (or, in check mode, that would run).
  type: list
  returned: always
"""

POLICY_OF = {"DROP": "deny", "ACCEPT": "allow", "REJECT": "reject"}
UFW_CONF = Path("/etc/ufw/ufw.conf")
UFW_DEFAULTS = Path("/etc/default/ufw")


def shell_value(text: str, key: str) -> str:
    """The value of KEY=value (quotes dropped) in a shell-style configuration file, or ''."""
    match = re.search(rf"^{key}=[\"']?([^\"'\n]*)", text, re.M)
    return match.group(1).strip() if match else ""


def added_line(rule: dict[str, str]) -> str:
    """The rule as `ufw show added` prints it."""
    comment = f" comment '{rule['comment']}'" if rule.get("comment") else ""
    if rule["src"] == "any":
        return f"ufw allow {rule['port']}/{rule['proto']}{comment}"
    return f"ufw allow from {rule['src']} to any port {rule['port']} proto {rule['proto']}{comment}"


def rule_command(rule: dict[str, str]) -> list[str]:
    """The ufw command line that adds the rule."""
    argv = ["allow", "proto", rule["proto"], "from", rule["src"], "to", "any"]
    argv += ["port", str(rule["port"])]
    if rule.get("comment"):
        argv += ["comment", rule["comment"]]
    return argv


def plan(
    params: dict[str, Any], *, active: bool, added: str, conf: str, defaults: str
) -> list[list[str]]:
    """The ufw commands (argv after `ufw`) that bring the node to params, in a safe order.

    active: `ufw status` says active; added: `ufw show added`; conf, defaults: the texts of
    /etc/ufw/ufw.conf and /etc/default/ufw.
    """
    existing = {line.strip() for line in added.splitlines()}
    commands = [rule_command(r) for r in params["rules"] if added_line(r) not in existing]
    level = shell_value(conf, "LOGLEVEL") or "off"
    if params["logging"] and params["logging"] != level:
        commands.append(["logging", params["logging"]])
    for direction, key in (
        ("incoming", "DEFAULT_INPUT_POLICY"),
        ("outgoing", "DEFAULT_OUTPUT_POLICY"),
    ):
        want = params[f"default_{direction}"]
        if want and POLICY_OF.get(shell_value(defaults, key)) != want:
            commands.append(["default", want, direction])
    if params["state"] == "enabled" and not active:
        commands.append(["--force", "enable"])
    if params["state"] == "disabled" and active:
        commands.append(["disable"])
    return commands


def expand(rules: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One rule per source, in the order given."""
    return [
        {
            "port": str(rule.get("port", "")),
            "proto": str(rule.get("proto", "")),
            "src": str(src),
            "comment": str(rule.get("comment", "")),
        }
        for rule in rules
        for src in rule.get("sources", [])
    ]


def check_rules(rules: list[dict[str, Any]]) -> str:
    """'' when every rule has what ufw needs, else what is wrong."""
    for rule in rules:
        missing = [key for key in ("port", "proto", "src") if not str(rule.get(key, "")).strip()]
        if missing:
            return f"rule {rule} lacks {', '.join(missing)}"
        if not re.fullmatch(r"[0-9]+([,:][0-9]+)*", str(rule["port"])):
            return f"rule {rule}: port must be a port, a list a,b or a range a:b"
        if "'" in str(rule.get("comment", "")):
            return f"rule {rule}: a comment cannot hold a quote"
    return ""


def main() -> None:
    """Read ufw's state, run what differs, report the commands."""
    module = AnsibleModule(
        argument_spec={
            "rules": {"type": "list", "elements": "dict", "default": []},
            "logging": {"type": "str", "default": ""},
            "default_incoming": {"type": "str", "default": ""},
            "default_outgoing": {"type": "str", "default": ""},
            "state": {"type": "str", "default": "enabled", "choices": ["enabled", "disabled"]},
        },
        supports_check_mode=True,
    )
    params = dict(module.params)
    params["rules"] = expand(params["rules"])
    problem = check_rules(params["rules"])
    if problem:
        module.fail_json(msg=f"llama_ufw: {problem}")
    ufw = module.get_bin_path("ufw", required=True)

    def run(*argv: str) -> str:
        rc, out, err = module.run_command([ufw, *argv], environ_update={"LC_ALL": "C"})
        if rc != 0:
            module.fail_json(msg=f"ufw {' '.join(argv)} failed (rc {rc}): {(err or out).strip()}")
        return out

    status = run("status")
    commands = plan(
        params,
        active=status.startswith("Status: active"),
        added=run("show", "added"),
        conf=UFW_CONF.read_text() if UFW_CONF.exists() else "",
        defaults=UFW_DEFAULTS.read_text() if UFW_DEFAULTS.exists() else "",
    )
    changed = bool(commands)
    if not module.check_mode:
        changed = False
        for argv in commands:
            out = run(*argv)
            # A rule that `show added` spells otherwise than added_line: ufw skips it and says so.
            lines = [line for line in out.splitlines() if line.strip()]
            if argv[0] != "allow" or not all(line.startswith("Skipping") for line in lines):
                changed = True
    module.exit_json(changed=changed, commands=[" ".join(["ufw", *argv]) for argv in commands])


if __name__ == "__main__":
    main()
