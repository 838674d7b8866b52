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

Two things it never does to a server in use: turn on a ufw it finds off (unless asked,
`if_inactive: enable`), and add a rule the node already has under another comment (ufw would
relabel the operator's rule as the project's, and a later run could delete it).
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
  - Rules whose comment is not in O(purge_comments) are never deleted, and a rule the node already
    has under another comment (or none) is never added again (ufw would relabel it).
  - An inactive ufw stays off and untouched unless O(if_inactive) is enable.
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
  absent:
    description:
      - Rules to delete where the node has them with exactly this port, proto, source and
        comment (the shape of O(rules)); a rule with another comment is never deleted.
    type: list
    elements: dict
    default: []
  if_inactive:
    description:
      - What to do when ufw is off and O(state) is enabled. leave (default) changes nothing at
        all; enable adds the rules, sets the policies and turns ufw on.
    type: str
    default: leave
    choices: [leave, enable]
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
left_inactive:
  description: ufw was off and was left off, untouched (if_inactive leave).
  type: bool
  returned: always
kept:
  description: The node's own rules (another comment, or none) that already let through what a
    rule asked for, left as they are under their own comment.
  type: list
  returned: always
unruled:
  description:
    - When this call turns ufw on with an incoming default that denies, or turns an active
      ufw's incoming default from allow to deny, the TCP ports processes listen on (other than
      on loopback) that no rule names, each with the processes' names and as text
      (C(9100/tcp (python3))); after it, only the sources allowed on every port reach them.
  type: list
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


TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def socket_owners(only: set[str] | None = None) -> dict[str, set[str]]:
    """The socket inodes processes (those named in only, else all) hold open: inode -> the
    names (comm) of those processes."""
    owners: dict[str, set[str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            name = (proc / "comm").read_text().strip()
            if only is not None and name not in only:
                continue
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners.setdefault(target[8:-1], set()).add(name)
        except OSError:
            continue
    return owners


def detect_ssh_ports(module: AnsibleModule) -> list[int]:
    """The ports sshd listens on: its effective configuration, then its sockets."""
    ports: set[int] = set()
    sshd = module.get_bin_path("sshd", opt_dirs=["/usr/sbin"])
    if sshd:
        rc, out, _ = module.run_command([sshd, "-T"], environ_update={"LC_ALL": "C"})
        if rc == 0:
            ports.update(ufwtext.sshd_ports(out))
    inodes = set(socket_owners({"sshd", "sshd-session"}))
    for table in TCP_TABLES:
        if inodes and table.exists():
            ports.update(ufwtext.listening_ports(table.read_text(), inodes))
    return sorted(ports)


def unruled(rules: list[ufwtext.Rule]) -> list[dict[str, Any]]:
    """The node's listening TCP ports that no rule names, with the processes behind them."""
    owners = socket_owners()
    listening: dict[int, set[str]] = {}
    for table in TCP_TABLES:
        if table.exists():
            for port, inodes in ufwtext.listening_sockets(table.read_text()).items():
                listening.setdefault(port, set()).update(inodes)
    found = []
    for port in ufwtext.unruled_ports(listening, rules):
        processes = sorted({n for inode in listening[port] for n in owners.get(inode, ())})
        seen = ", ".join(processes) or "process not seen"
        found.append({"port": port, "processes": processes, "text": f"{port}/tcp ({seen})"})
    return found


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
            "absent": {"type": "list", "elements": "dict", "default": []},
            "if_inactive": {"type": "str", "default": "leave", "choices": ["leave", "enable"]},
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
    if ufwtext.leaves_inactive(params, active=active):
        module.exit_json(
            changed=False,
            commands=[],
            ssh_ports=[],
            was_active=False,
            saved=False,
            left_inactive=True,
            kept=[],
            unruled=[],
        )

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
    absent = ufwtext.expand(params["absent"])
    problem = ufwtext.check_rules(rules + absent)
    if problem:
        module.fail_json(msg=f"llama_ufw: {problem}")
    params["rules"], params["absent"] = rules, absent
    added = run("show", "added")
    defaults = UFW_DEFAULTS.read_text() if UFW_DEFAULTS.exists() else ""
    plan = ufwtext.plan(
        params,
        active=active,
        added=added,
        conf=UFW_CONF.read_text() if UFW_CONF.exists() else "",
        defaults=defaults,
    )
    commands = plan.commands()
    # ufw turns on, or its incoming default to deny: what listens and no rule names goes dark
    # but for the nodes (the preview lists it).
    exposed: list[dict[str, Any]] = []
    if ufwtext.goes_dark(plan, active=active, defaults=defaults):
        exposed = unruled(ufwtext.parse_added(added) + plan.add)
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
        left_inactive=False,
        kept=[ufwtext.added_line(rule) for rule in plan.kept],
        unruled=exposed,
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
        left_inactive=False,
        kept=[],
        unruled=[],
    )


if __name__ == "__main__":
    main()
