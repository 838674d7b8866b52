"""What a task result changed (or, in check mode, would change), in the preview's categories.

The callback llama.cluster.llama_preview gives every task result of a run to `classify` and
prints what it returns per node (provision.yml --check: the preview). A real run is classified
the same way, so that a preview and the run after it can be compared category by category. Facts
in (the task's action, its arguments as the module received them, its result), items out; no
Ansible import.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The categories, in the order the preview prints them.
CATEGORIES = (
    "driver",
    "packages",
    "firewall",
    "sysctls",
    "users",
    "files",
    "services",
    "commands",
)

FILE_ACTIONS = {
    "copy",
    "template",
    "file",
    "lineinfile",
    "blockinfile",
    "replace",
    "get_url",
    "unarchive",
    "apt_repository",
    "synchronize",
    "authorized_key",
}
SERVICE_ACTIONS = {"systemd", "systemd_service", "service"}
COMMAND_ACTIONS = {"command", "shell", "script", "raw"}
PACKAGE_ACTIONS = {"apt", "package", "pip"}
# A command task skipped in check mode: it would run, what it changes is not known before.
COMMAND_SKIPPED = "Command would have run if not in check mode"
# pip's options that take a value (their value is no requirement).
PIP_VALUE_OPTIONS = {
    "--python",
    "--constraint",
    "-c",
    "--find-links",
    "-f",
    "--index-url",
    "-i",
    "--extra-index-url",
    "--index-strategy",
    "--target",
    "--requirement",
    "-r",
}


@dataclass(frozen=True)
class Item:
    """One change of one node: its category and what a reader sees."""

    category: str
    text: str


def short_action(action: str) -> str:
    """'ansible.builtin.copy' -> 'copy', 'llama.cluster.llama_ufw' -> 'llama_ufw'."""
    return action.rsplit(".", 1)[-1]


def apt_packages(output: str) -> list[str]:
    """Packages apt-get installs or upgrades, from its --simulate output or a real run's."""
    names: list[str] = []
    for line in output.splitlines():
        match = re.match(r"Inst (\S+) (?:\[(\S+)\] )?\((\S+)", line) or re.match(
            r"Setting up (\S+) \((\S+)\)", line
        )
        if not match:
            continue
        name = match.group(1).split(":", 1)[0]
        if name not in names:
            names.append(name)
    return sorted(names)


def pip_changes(output: str) -> list[str]:
    """What pip or uv installs, upgrades or removes, from a dry run's output or a real run's."""
    items: list[str] = []
    for line in output.splitlines():
        uv = re.match(r"^ ([+-]) (\S+)==(\S+)$", line)
        if uv:
            items.append(f"{uv.group(1)} {uv.group(2).lower()}=={uv.group(3)}")
            continue
        pip = re.match(r"^(?:Would install|Successfully installed) (.+)$", line)
        if pip and not re.match(r"\d+ packages?$", pip.group(1)):  # uv's 'Would install 2 packages'
            for spec in pip.group(1).split():
                name, _, version = spec.rpartition("-")
                items.append(f"+ {name.lower().replace('_', '-')}=={version}")
    # One package replaced by another version: '- x==1', '+ x==2' reads as one upgrade.
    added = {i[2:].split("==")[0]: i for i in items if i.startswith("+")}
    result = [i for i in items if i.startswith("+") or i[2:].split("==")[0] not in added]
    return sorted(set(result))


def pip_requirements(argv: list[str]) -> list[str]:
    """The requirements a `pip install` / `uv pip install` command line asks for."""
    words = argv[argv.index("install") + 1 :]
    specs, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in PIP_VALUE_OPTIONS:
            skip = True
        elif not word.startswith("-"):
            specs.append(word)
    return specs


def command_argv(args: Mapping[str, Any]) -> list[str]:
    """A command task's argv, whether given as argv or as a string."""
    if args.get("argv"):
        return [str(a) for a in args["argv"]]
    raw = args.get("_raw_params") or args.get("cmd") or ""
    try:
        return shlex.split(str(raw))
    except ValueError:
        return str(raw).split()


def is_pip_install(argv: list[str]) -> bool:
    """Whether a command line is a pip or uv install into an environment."""
    return "pip" in argv and "install" in argv[argv.index("pip") :]


def module_args(result: Mapping[str, Any], task_args: Mapping[str, Any]) -> Mapping[str, Any]:
    """The arguments the module ran with (templated), else the task's."""
    invocation = result.get("invocation") or {}
    return invocation.get("module_args") or task_args or {}


def classify(
    action: str,
    task_args: Mapping[str, Any],
    result: Mapping[str, Any],
    check_mode: bool,
) -> list[Item]:
    """The items one task result adds to its node's preview (its list of changes)."""
    decision = (result.get("ansible_facts") or {}).get("__nvidia_driver_decision")
    if decision:
        return [driver_item(decision)]
    skipped_command = check_mode and result.get("msg") == COMMAND_SKIPPED
    if not result.get("changed") and not skipped_command:
        return []
    name = short_action(action)
    args = module_args(result, task_args)
    if name in COMMAND_ACTIONS:
        return command_items(args, result)
    if name in PACKAGE_ACTIONS:
        return package_items(name, args, result)
    describe = SIMPLE.get(name)
    if describe:
        return describe(name, args, result)
    return [Item("commands", f"{action} {result.get('msg', '') or ''}".strip())]


def ufw_items(args: Mapping[str, Any], result: Mapping[str, Any]) -> list[Item]:
    """ufw's commands, the listening ports a deny would darken, and the copy of ufw's state that
    llama_ufw keeps for a rollback."""
    commands = [str(c) for c in result.get("commands") or []]
    items = [Item("firewall", c) for c in commands]
    # Where a policy turns to deny: the listening ports that would go dark (llama_ufw's unruled).
    items += [
        Item("firewall", f"{port.get('text')} would go dark (no rule names it)")
        for port in result.get("unruled") or []
        if isinstance(port, Mapping)
    ]
    if commands and args.get("rollback_dir") and args.get("state") != "rolled_back":
        items.append(Item("files", f"{args['rollback_dir']} (ufw's state saved for a rollback)"))
    return items


def service_items(_name: str, args: Mapping[str, Any], _result: Mapping[str, Any]) -> list[Item]:
    """A service started, restarted, enabled or reloaded."""
    state = args.get("state") or ("enabled" if args.get("enabled") else "reloaded")
    return [Item("services", f"{args.get('name')} {state}")]


SIMPLE = {
    "llama_ufw": lambda _n, a, r: ufw_items(a, r),
    "sysctl": lambda _n, a, _r: [
        Item("sysctls", f"{a.get('name')} = {a.get('value')} ({a.get('state')})")
    ],
    "user": lambda n, a, _r: [Item("users", f"{n} {a.get('name')} ({a.get('state', 'present')})")],
    "group": lambda n, a, _r: [Item("users", f"{n} {a.get('name')} ({a.get('state', 'present')})")],
    "llama_files": lambda _n, _a, r: [Item("files", str(p)) for p in r.get("changed_paths") or []],
    **dict.fromkeys(SERVICE_ACTIONS, service_items),
    **dict.fromkeys(FILE_ACTIONS, lambda n, a, r: [file_item(n, a, r)]),
}


def driver_item(decision: Mapping[str, Any]) -> Item:
    """The driver decision: keep, install, upgrade or blocked, and whether a reboot follows."""
    reboot = "reboot" if decision.get("reboot") else "no reboot"
    return Item("driver", f"{decision.get('action')}, {reboot}: {decision.get('reason', '')}")


def command_items(args: Mapping[str, Any], result: Mapping[str, Any]) -> list[Item]:
    """A command that changed something, or that check mode could not run (it would run)."""
    argv = command_argv(args)
    if argv and is_pip_install(argv):
        env = argv[0].rsplit("/", 2)[0]
        changes = pip_changes(f"{result.get('stdout', '')}\n{result.get('stderr', '')}")
        if changes:
            return [Item("packages", f"pip {env}: {change}") for change in changes]
        wanted = " ".join(pip_requirements(argv))
        return [Item("packages", f"pip {env}: {wanted} (and their locked dependencies)")]
    creates = args.get("creates")
    text = " ".join(argv) if argv else str(args)
    if creates:
        return [Item("files", f"{creates} (made by: {text})")]
    # The same text whether check mode skipped it or a real run changed something with it, so
    # that a preview and the run after it compare equal.
    return [Item("commands", text)]


def package_items(name: str, args: Mapping[str, Any], result: Mapping[str, Any]) -> list[Item]:
    """apt (from apt-get's output, dependencies included) or pip packages."""
    if name == "pip":
        changes = pip_changes(str(result.get("stdout", "")))
        wanted = args.get("name") or []
        return [Item("packages", f"pip: {c}") for c in changes or wanted]
    found = apt_packages(str(result.get("stdout", "")))
    if found:
        return [Item("packages", f"apt: {p}") for p in found]
    if args.get("update_cache") and not args.get("name"):
        return [Item("commands", "apt-get update")]
    wanted = args.get("name") or args.get("pkg") or []
    wanted = [wanted] if isinstance(wanted, str) else wanted
    return [Item("packages", f"apt: {p}") for p in wanted]


def file_item(name: str, args: Mapping[str, Any], result: Mapping[str, Any]) -> Item:
    """A path and what happens to it."""
    path = str(args.get("dest") or args.get("path") or result.get("dest") or result.get("path"))
    if name == "synchronize":
        # The module's dest is rewritten to [user@]host:path.
        path = re.sub(r"^[^/]*:", "", path)
    if name == "apt_repository":
        return Item("files", f"apt source {args.get('repo')}")
    if name == "authorized_key":
        return Item("files", f"authorized key of {args.get('user')}")
    state = args.get("state")
    if name == "file":
        what = {"directory": "directory", "absent": "removed", "touch": "file"}.get(
            str(state), str(state or "attributes")
        )
    elif name in {"lineinfile", "blockinfile", "replace"}:
        what = "edited" if state != "absent" else "block removed"
    else:
        what = "written"
    return Item("files", f"{path} ({what})")
