"""ufw as text: read what ufw prints, decide what to run. Pure functions, no ufw call.

Used on the nodes by the llama_ufw module (Python 3.10+) and tested on the controller against
the output of ufw 0.36.1 (Ubuntu 22.04) and 0.36.2 (Ubuntu 24.04, Debian 12). The project's
rules carry a comment that starts with "llama-cluster": only rules whose comment the caller
owns are ever deleted, every other rule (an operator's, another tool's) is left alone. A rule
the node already has under another comment (or none) is never added again: ufw would take the
new comment for the old rule, and the project would then own, and one day delete, the
operator's rule.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

POLICY_OF = {"DROP": "deny", "ACCEPT": "allow", "REJECT": "reject"}
ANY = "any"


@dataclass(frozen=True)
class Rule:
    """One ufw rule, as `ufw show added` spells it and as the module asks for it.

    port '' and proto '' mean every port and every protocol; src 'any' means from anywhere.
    spec is the rule's text after `ufw` and before its comment: what `ufw delete` takes.
    """

    action: str = "allow"
    src: str = ANY
    port: str = ""
    proto: str = ""
    comment: str = ""
    extra: tuple[str, ...] = ()
    spec: str = field(default="", compare=False)

    def key(self) -> tuple[str, str, str, str, str, tuple[str, ...]]:
        """What makes two rules the same rule, comment included."""
        return (*self.access(), self.comment)

    def access(self) -> tuple[str, str, str, str, tuple[str, ...]]:
        """What the rule lets through: ufw takes two rules that differ only in their comment
        for one rule, and adding the second relabels the first."""
        return (self.action, self.src, self.port, self.proto, self.extra)


@dataclass
class Status:
    """What `ufw status verbose` says; logging and policies only when ufw is active."""

    active: bool
    logging: str = ""
    incoming: str = ""
    outgoing: str = ""
    rules: list[dict[str, str]] = field(default_factory=list)


SIMPLE_FORM = re.compile(r"[0-9][0-9,:]*(/[a-z]+)?")
CLAUSES = {"from", "to", "proto", "in", "out", "on", "log", "log-all"}


def _clauses(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The extended form's clauses: src, dst, port (the destination's), proto, and the rest.

    What this project never writes (a direction, an interface, a log option, a source port, an
    application) goes to the rest, in order.
    """
    found = {"src": ANY, "dst": ANY, "port": "", "proto": ""}
    rest: list[str] = []
    side = ""
    index = 0
    while index < len(words):
        word = words[index]
        value = words[index + 1] if index + 1 < len(words) else ""
        step = 2
        if word in {"from", "to"}:
            side = word
            found["src" if word == "from" else "dst"] = value
        elif word == "port" and side == "to":
            found["port"] = value
        elif word == "proto":
            found["proto"] = value
        elif word in {"on", "port", "app"}:
            rest += [f"{side}-{word}" if side else word, value]
        else:
            rest.append(word)
            step = 1
        index += step
    return found, rest


def parse_added_line(line: str) -> Rule | None:
    """One line of `ufw show added` as a Rule, or None for a line that is not a rule.

    Both forms ufw prints are read: the simple one (`ufw allow 22/tcp`) and the extended one
    (`ufw allow from 10.0.0.1 to any port 22 proto tcp`), each with an optional
    `comment '...'`. Whatever this project never writes (a route rule, a direction, an
    interface, a destination address, an application) is kept in `extra`, so such a rule never
    equals one of the project's.
    """
    if not line.strip().startswith("ufw "):
        return None
    try:
        words = shlex.split(line)[1:]
    except ValueError:
        return None
    comment = ""
    if "comment" in words:
        at = words.index("comment")
        comment, words = " ".join(words[at + 1 :]), words[:at]
    spec = " ".join(shlex.quote(word) for word in words)
    extra: list[str] = []
    if words[:1] == ["route"]:
        extra, words = ["route"], words[1:]
    if not words:
        return None
    action, words = words[0], words[1:]
    port, proto = "", ""
    if words and words[0] not in CLAUSES:
        # The simple form: `allow 22/tcp`, `allow 8080`, `allow OpenSSH`.
        if SIMPLE_FORM.fullmatch(words[0]):
            port, _, proto = words[0].partition("/")
        else:
            extra += ["app", words[0]]
        words = words[1:]
    found, rest = _clauses(words)
    extra += rest
    if found["dst"] != ANY:
        extra += ["to", found["dst"]]
    return Rule(
        action,
        found["src"],
        found["port"] or port,
        found["proto"] or proto,
        comment,
        tuple(extra),
        spec,
    )


def parse_added(text: str) -> list[Rule]:
    """Every rule of `ufw show added` (the header and '(None)' are not rules)."""
    rules = [parse_added_line(line) for line in text.splitlines()]
    return [rule for rule in rules if rule is not None]


def parse_status(text: str) -> Status:
    """`ufw status verbose`: whether ufw is active, its logging, its policies and its table.

    Table rows are split on the runs of two or more spaces ufw pads its columns with; a
    comment follows ` # `. Rows of IPv6 rules keep their `(v6)` markers.
    """
    lines = text.splitlines()
    status = Status(active=bool(lines) and lines[0].strip() == "Status: active")
    in_table = False
    for line in lines[1:]:
        if line.startswith("Logging:"):
            match = re.search(r"\((\w+)\)", line)
            status.logging = match.group(1) if match else line.split(":", 1)[1].strip()
        elif line.startswith("Default:"):
            for policy, direction in re.findall(r"(\w+) \((incoming|outgoing)\)", line):
                setattr(status, direction, policy)
        elif line.startswith("--"):
            in_table = True
        elif in_table and line.strip():
            row, _, comment = line.partition(" # ")
            cells = re.split(r"\s{2,}", row.strip())
            if len(cells) >= 3:
                to, action, source = cells[:3]
                row_fields = {"to": to, "action": action, "from": source}
                status.rules.append({**row_fields, "comment": comment.strip()})
    return status


def shell_value(text: str, key: str) -> str:
    """The value of KEY=value (quotes dropped) in a shell-style configuration file, or ''."""
    match = re.search(rf"^{key}=[\"']?([^\"'\n]*)", text, re.M)
    return match.group(1).strip() if match else ""


def sshd_ports(sshd_t: str) -> list[int]:
    """The TCP ports `sshd -T` says sshd listens on.

    `listenaddress host:port` lines carry the real ports (a Port directive does not apply to a
    ListenAddress with a port of its own); `port N` lines count only when there are none.
    """
    listen: set[int] = set()
    ports: set[int] = set()
    for line in sshd_t.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == "listenaddress":
            match = re.search(r":([0-9]+)$", words[1])
            if match:
                listen.add(int(match.group(1)))
        elif len(words) == 2 and words[0] == "port" and words[1].isdigit():
            ports.add(int(words[1]))
    return sorted(listen or ports)


def listening_ports(proc_net_tcp: str, inodes: set[str]) -> list[int]:
    """Ports of the LISTEN sockets of /proc/net/tcp (or tcp6) whose inode is in inodes."""
    ports: set[int] = set()
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in the host's (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[at : at + 4][::-1] for at in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_sockets(proc_net_tcp: str) -> dict[int, set[str]]:
    """The TCP ports of /proc/net/tcp (or tcp6) listened on other than on loopback: port ->
    the sockets' inodes. Loopback-only listeners are out of a firewall's reach anyway."""
    found: dict[int, set[str]] = {}
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) <= 9 or fields[3] != "0A":
            continue
        host, _, port = fields[1].rpartition(":")
        address = _address(host)
        mapped = getattr(address, "ipv4_mapped", None)
        if address.is_loopback or (mapped is not None and mapped.is_loopback):
            continue
        found.setdefault(int(port, 16), set()).add(fields[9])
    return found


def names_port(rule: Rule, port: int) -> bool:
    """Whether the rule lets TCP in on this port by naming it (a port, a list or a range)."""
    if rule.action not in {"allow", "limit"} or rule.proto not in {"", "tcp"} or not rule.port:
        return False
    for part in rule.port.split(","):
        low, _, high = part.partition(":")
        if low.isdigit() and int(low) <= port <= int(high if high.isdigit() else low):
            return True
    return False


def unruled_ports(listening: dict[int, set[str]], rules: list[Rule]) -> list[int]:
    """The listening ports no rule names: once ufw denies by default, they answer only the
    sources allowed on every port (the cluster's nodes)."""
    return sorted(port for port in listening if not any(names_port(r, port) for r in rules))


def normal_source(source: str) -> str:
    """A source as ufw writes it back: a network's host bits cleared, /32 and /128 dropped."""
    if source == ANY:
        return source
    try:
        network = ipaddress.ip_network(source, strict=False)
    except ValueError:
        return source
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def expand(rules: list[dict[str, Any]]) -> list[Rule]:
    """One Rule per source, in the order given; a port '' opens every port."""
    return [
        Rule(
            src=normal_source(str(source)),
            port=str(rule.get("port", "") or ""),
            proto=str(rule.get("proto", "") or ""),
            comment=str(rule.get("comment", "")),
        )
        for rule in rules
        for source in rule.get("sources", [])
    ]


def check_rules(rules: list[Rule]) -> str:
    """'' when ufw can take every rule, else what is wrong with the first that it cannot."""
    for rule in rules:
        if not rule.src.strip():
            return f"rule {rule.key()} lacks a source"
        if rule.port and not re.fullmatch(r"[0-9]+([,:][0-9]+)*", rule.port):
            return f"rule {rule.key()}: port must be a port, a list a,b or a range a:b"
        if rule.port and (("," in rule.port or ":" in rule.port) and not rule.proto):
            return f"rule {rule.key()}: a port list or range needs a proto"
        if not rule.port and rule.src == ANY:
            return f"rule {rule.key()}: every port from anywhere is no firewall"
        if "'" in rule.comment:
            return f"rule {rule.key()}: a comment cannot hold a quote"
    return ""


def add_command(rule: Rule) -> list[str]:
    """The ufw argv (after `ufw`) that adds the rule."""
    argv = [rule.action]
    if rule.proto:
        argv += ["proto", rule.proto]
    argv += ["from", rule.src]
    if rule.port:
        argv += ["to", ANY, "port", rule.port]
    if rule.comment:
        argv += ["comment", rule.comment]
    return argv


def added_line(rule: Rule) -> str:
    """An existing rule as `ufw show added` prints it."""
    comment = f" comment '{rule.comment}'" if rule.comment else ""
    return f"ufw {rule.spec}{comment}"


def delete_command(rule: Rule) -> list[str]:
    """The ufw argv that deletes an existing rule: its own spec as `show added` printed it."""
    return ["delete", *shlex.split(rule.spec)]


@dataclass
class Plan:
    """What to run, in this order: add, delete, logging and policies, enable or disable.

    kept: the rules asked for that the node already has under a comment the caller does not
    own (an operator's rule, or one without comment): left as they are, never relabelled.
    left_inactive: ufw is off and stays off (if_inactive: leave): nothing is run at all.
    """

    add: list[Rule]
    delete: list[Rule]
    settings: list[list[str]]
    kept: list[Rule] = field(default_factory=list)
    left_inactive: bool = False

    def commands(self) -> list[list[str]]:
        """Every ufw argv, in the order that never cuts a connection that should stay."""
        return [
            *(add_command(rule) for rule in self.add),
            *(delete_command(rule) for rule in self.delete),
            *self.settings,
        ]


def goes_dark(plan: Plan, *, active: bool, defaults: str) -> bool:
    """Whether this plan leaves ufw on with an incoming default that turns away what no rule
    names, where that was reachable before: ufw turned on (its incoming default, the plan's or
    /etc/default/ufw's, denies), or an active ufw's incoming default turned from allow to deny
    or reject. The listening ports no rule names then go dark but for the cluster's nodes."""
    asked = next(
        (argv[1] for argv in plan.settings if argv[0] == "default" and argv[2:] == ["incoming"]),
        None,
    )
    current = POLICY_OF.get(shell_value(defaults, "DEFAULT_INPUT_POLICY"), "deny")
    closes = (asked or current) in ("deny", "reject")
    if ["--force", "enable"] in plan.settings:
        return closes
    return active and current == "allow" and asked in ("deny", "reject")


def leaves_inactive(params: dict[str, Any], *, active: bool) -> bool:
    """Whether ufw, found off, stays off and untouched: it is only turned on when asked
    (if_inactive: enable). A server's other services (a node exporter, NFS, a database) would
    otherwise go dark the moment the default policy turns to deny."""
    return not active and params["state"] == "enabled" and params.get("if_inactive") != "enable"


def plan(
    params: dict[str, Any],
    *,
    active: bool,
    added: str,
    conf: str,
    defaults: str,
) -> Plan:
    """The changes that bring a node's ufw to params.

    params: rules (Rule list: added unless the node has a rule that lets the same through, under
    any comment), purge_comments (the comments whose rules this caller owns: any such rule that
    lets through what no rule asked for does is deleted), absent (Rule list: deleted where the
    node has them, comment included), logging, default_incoming, default_outgoing, state and
    if_inactive (enable: turn an inactive ufw on; anything else: leave it off and untouched).
    active: `ufw status` says active; added: `ufw show added`; conf, defaults: the texts of
    /etc/ufw/ufw.conf and /etc/default/ufw.
    """
    if leaves_inactive(params, active=active):
        return Plan([], [], [], left_inactive=True)
    existing = parse_added(added)
    have = {rule.access(): rule for rule in existing}
    owned = set(params.get("purge_comments") or [])
    add: list[Rule] = []
    kept: list[Rule] = []
    for rule in params["rules"]:
        found = have.get(rule.access())
        if found is None:
            if rule.access() not in {r.access() for r in add}:
                add.append(rule)
        elif found.comment != rule.comment and found.comment not in owned and found not in kept:
            kept.append(found)
    wanted = {rule.access() for rule in params["rules"]}
    absent = {rule.key() for rule in params.get("absent") or []}
    delete = [
        rule
        for rule in existing
        if (rule.comment in owned and rule.access() not in wanted) or rule.key() in absent
    ]
    settings: list[list[str]] = []
    level = shell_value(conf, "LOGLEVEL") or "off"
    if params.get("logging") and params["logging"] != level:
        settings.append(["logging", params["logging"]])
    for direction, key in (
        ("incoming", "DEFAULT_INPUT_POLICY"),
        ("outgoing", "DEFAULT_OUTPUT_POLICY"),
    ):
        wanted_policy = params.get(f"default_{direction}")
        if wanted_policy and POLICY_OF.get(shell_value(defaults, key)) != wanted_policy:
            settings.append(["default", wanted_policy, direction])
    if params["state"] == "enabled" and not active:
        settings.append(["--force", "enable"])
    if params["state"] == "disabled" and active:
        settings.append(["disable"])
    return Plan(add, delete, settings, kept)
