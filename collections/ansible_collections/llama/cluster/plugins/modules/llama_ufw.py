#!/usr/bin/python
"""Bring ufw to the cluster's rules, logging level, default policies and state in one call.

community.general.ufw reads ufw's state again for every rule, level and policy, and its
`default` and `logging` actions reload the firewall each time (1.7 s for a policy that was
already set); a node's firewall took ten tasks and 10 s of a no-op provision.yml. This module
reads the state once (`ufw status verbose`, `ufw show added`, ufw's two configuration files)
and runs ufw only for what differs, in the order that never locks anyone out: the allow rules
first (SSH on every port sshd listens on), then the deletions of the caller's own stale rules,
then logging and the default policies, then `ufw --force enable`. Before it changes anything it
can keep a copy of ufw's state, which `state: rolled_back` puts back.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.llama.cluster.plugins.module_utils import ufw as ufwtext

DOCUMENTATION = r"""
module: llama_ufw
short_description: Bring ufw to a set of allow rules, a logging level, default policies and a state
description:
  - Reads ufw's state once and runs ufw only for what differs; allow rules come first, then the
    deletion of stale rules the caller owns (by comment), then the policies, then enable.
  - SSH is allowed on every TCP port sshd listens on (C(sshd -T), and the listening sockets of
    sshd processes) plus O(ssh_ports), from O(ssh_sources).
  - Rules whose comment is not in O(purge_comments) are never deleted.
options:
  rules:
    description:
      - Allow rules; each has port (a port, a list "a,b" or a range "a:b"; empty for every port),
        proto (tcp, udp; empty for any), sources (a list of "any", addresses or networks, one ufw
        rule each) and comment.
    type: list
    elements: dict
    default: []
  ssh_sources:
    description: Who may reach sshd; empty adds no SSH rule.
    type: list
    elements: str
    default: []
  ssh_ports:
    description: Ports to open for SSH besides those sshd listens on (e.g. ansible_port).
    type: list
    elements: int
    default: []
  ssh_comment:
    description: The comment of the SSH rules.
    type: str
    default: llama-cluster ssh
  ssh_required:
    description: Fail when no SSH port is found (the controller reaches the node over SSH).
    type: bool
    default: false
  purge_comments:
    description: Comments of the rules the caller owns; such a rule not asked for is deleted.
    type: list
    elements: str
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
    description:
      - enabled or disabled; rolled_back puts back the state saved in O(rollback_dir) by the
        last call that changed something.
    type: str
    default: enabled
    choices: [enabled, disabled, rolled_back]
  rollback_dir:
    description: Where to keep ufw's state before a change (0700); empty keeps none.
    type: path
    default: ""
author: llama-cluster
"""

EXAMPLES = r"""
- name: Allow SSH and the cluster's nodes, drop the rules of nodes that left, enable ufw
  llama.cluster.llama_ufw:
    rules:
      - sources: [10.0.0.11, 10.0.0.12]
        comment: llama-cluster nodes
    ssh_sources: [any]
    ssh_ports: [22]
    purge_comments: [llama-cluster nodes, llama-cluster ssh]
    state: enabled
    rollback_dir: /var/lib/llama-cluster/ufw

- name: Put back the state saved before the last change
  llama.cluster.llama_ufw:
    state: rolled_back
    rollback_dir: /var/lib/llama-cluster/ufw
"""

RETURN = r"""
commands:
  description: The ufw commands run (or, in check mode, that would run).
  type: list
  returned: always
ssh_ports:
  description: The ports SSH is allowed on.
  type: list
  returned: always
was_active:
  description: Whether ufw was active before this call.
  type: bool
  returned: always
saved:
  description: Whether ufw's previous state was saved in rollback_dir.
  type: bool
  returned: always
"""

UFW_CONF = Path("/etc/ufw/ufw.conf")
UFW_DEFAULTS = Path("/etc/default/ufw")
# What `ufw` keeps of its state: the user rules (IPv4, IPv6), enabled and logging, the policies.
STATE_FILES = (
    Path("/etc/ufw/user.rules"),
    Path("/etc/ufw/user6.rules"),
    UFW_CONF,
    UFW_DEFAULTS,
)


def sshd_listening_inodes() -> set[str]:
    """The socket inodes that sshd processes hold open."""
    inodes: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "comm").read_text().strip() not in {"sshd", "sshd-session"}:
                continue
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def detect_ssh_ports(module: AnsibleModule) -> list[int]:
    """The ports sshd listens on: its effective configuration, then its sockets."""
    ports: set[int] = set()
    sshd = module.get_bin_path("sshd", opt_dirs=["/usr/sbin"])
    if sshd:
        rc, out, _ = module.run_command([sshd, "-T"], environ_update={"LC_ALL": "C"})
        if rc == 0:
            ports.update(ufwtext.sshd_ports(out))
    inodes = sshd_listening_inodes()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if inodes and table.exists():
            ports.update(ufwtext.listening_ports(table.read_text(), inodes))
    return sorted(ports)


def save_state(directory: Path, active: bool) -> None:
    """Copy ufw's state files and whether it was active into directory."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in STATE_FILES:
        if path.exists():
            shutil.copy2(path, directory / path.name)
    (directory / "state.json").write_text(json.dumps({"active": active}))


def main() -> None:
    """Read ufw's state, run what differs (or put the saved state back), report the commands."""
    module = AnsibleModule(
        argument_spec={
            "rules": {"type": "list", "elements": "dict", "default": []},
            "ssh_sources": {"type": "list", "elements": "str", "default": []},
            "ssh_ports": {"type": "list", "elements": "int", "default": []},
            "ssh_comment": {"type": "str", "default": "llama-cluster ssh"},
            "ssh_required": {"type": "bool", "default": False},
            "purge_comments": {"type": "list", "elements": "str", "default": []},
            "logging": {"type": "str", "default": ""},
            "default_incoming": {"type": "str", "default": ""},
            "default_outgoing": {"type": "str", "default": ""},
            "state": {
                "type": "str",
                "default": "enabled",
                "choices": ["enabled", "disabled", "rolled_back"],
            },
            "rollback_dir": {"type": "path", "default": ""},
        },
        supports_check_mode=True,
    )
    params: dict[str, Any] = dict(module.params)
    ufw = module.get_bin_path("ufw", required=True)

    def run(*argv: str) -> str:
        rc, out, err = module.run_command([ufw, *argv], environ_update={"LC_ALL": "C"})
        if rc != 0:
            module.fail_json(msg=f"ufw {' '.join(argv)} failed (rc {rc}): {(err or out).strip()}")
        return out

    active = ufwtext.parse_status(run("status", "verbose")).active
    if params["state"] == "rolled_back":
        roll_back(module, run, Path(params["rollback_dir"]), active)

    ssh_ports: list[int] = []
    if params["ssh_sources"]:
        ssh_ports = sorted(set(detect_ssh_ports(module)) | set(params["ssh_ports"]))
        if not ssh_ports and params["ssh_required"]:
            module.fail_json(
                msg="llama_ufw: no port found that sshd listens on (sshd -T, listening sockets) "
                "and no ssh_ports given: set firewall_ssh_ports to the SSH port of this node."
            )
    ssh_rules = [
        {"port": port, "proto": "tcp", "sources": params["ssh_sources"]}
        | {"comment": params["ssh_comment"]}
        for port in ssh_ports
    ]
    rules = ufwtext.expand(ssh_rules + params["rules"])
    problem = ufwtext.check_rules(rules)
    if problem:
        module.fail_json(msg=f"llama_ufw: {problem}")
    params["rules"] = rules
    plan = ufwtext.plan(
        params,
        active=active,
        added=run("show", "added"),
        conf=UFW_CONF.read_text() if UFW_CONF.exists() else "",
        defaults=UFW_DEFAULTS.read_text() if UFW_DEFAULTS.exists() else "",
    )
    commands = plan.commands()
    saved = False
    if commands and not module.check_mode and params["rollback_dir"]:
        save_state(Path(params["rollback_dir"]), active)
        saved = True
    changed = bool(commands)
    if not module.check_mode:
        changed = False
        for argv in commands:
            out = run(*argv)
            # A rule ufw already has in another spelling: ufw skips it and says so.
            lines = [line for line in out.splitlines() if line.strip()]
            if argv[0] != "allow" or not all(line.startswith("Skipping") for line in lines):
                changed = True
    module.exit_json(
        changed=changed,
        commands=[" ".join(["ufw", *argv]) for argv in commands],
        ssh_ports=ssh_ports,
        was_active=active,
        saved=saved,
    )


def roll_back(
    module: AnsibleModule, run: Callable[..., str], directory: Path, active: bool
) -> None:
    """Put back the ufw state saved in directory; exits the module."""
    state_file = directory / "state.json"
    if not state_file.exists():
        module.fail_json(msg=f"llama_ufw: nothing to roll back to: {state_file} does not exist")
    was_active = bool(json.loads(state_file.read_text())["active"])
    commands = [["reload"]] if was_active else [["disable"]] if active else []
    if not module.check_mode:
        for path in STATE_FILES:
            if (directory / path.name).exists():
                shutil.copy2(directory / path.name, path)
        for argv in commands:
            run(*argv)
    module.exit_json(
        changed=True,
        commands=[" ".join(["ufw", *argv]) for argv in commands],
        ssh_ports=[],
        was_active=active,
        saved=False,
    )


if __name__ == "__main__":
    main()
