"""roles/firewall's ufw logic (module_utils/ufw.py): what ufw says, what the module runs.

The fixtures are written in the formats of ufw 0.36.1 (Ubuntu 22.04) and 0.36.2 (Ubuntu 24.04,
Debian 12): `ufw status verbose` pads its columns with spaces and puts a rule's comment after
` # `; `ufw show added` prints each rule as the command that adds it, the comment quoted. Each
fixture mixes the project's rules with an operator's (an application profile, a rate limit, an
interface, a plain port), which must never be touched. The module itself runs against real ufw
in the molecule scenarios (cluster, in_use).
"""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.module_utils import ufw

NODES = ["10.0.0.11", "10.0.0.12"]
OWNED = [
    "llama-cluster ssh",
    "llama-cluster nodes",
    "llama-cluster training ports",
    "llama-cluster job watchdog",
]
WANT = ufw.expand(
    [
        {"port": 22, "proto": "tcp", "sources": ["any"], "comment": "llama-cluster ssh"},
        {"port": "", "proto": "", "sources": NODES, "comment": "llama-cluster nodes"},
    ]
)
PARAMS = {
    "rules": WANT,
    "purge_comments": OWNED,
    "logging": "low",
    "default_incoming": "deny",
    "default_outgoing": "allow",
    "state": "enabled",
}
CONF = "# /etc/ufw/ufw.conf\nENABLED=yes\nLOGLEVEL=low\n"
DEFAULTS = 'IPV6=yes\nDEFAULT_INPUT_POLICY="DROP"\nDEFAULT_OUTPUT_POLICY="ACCEPT"\n'

# Ubuntu 22.04, ufw 0.36.1: an operator's OpenSSH profile and node exporter on an interface,
# the project's rules for two nodes and for a third that left the cluster.
UBUNTU_2204_ADDED = """\
Added user rules (see 'ufw status' for running firewall):
ufw allow OpenSSH
ufw allow in on eth1 from 192.168.0.0/16 to any port 9100 proto tcp comment 'node exporter'
ufw allow 22/tcp comment 'llama-cluster ssh'
ufw allow from 10.0.0.11 comment 'llama-cluster nodes'
ufw allow from 10.0.0.12 comment 'llama-cluster nodes'
ufw allow from 10.0.0.13 comment 'llama-cluster nodes'
"""
UBUNTU_2204_STATUS = """\
Status: active
Logging: on (low)
Default: deny (incoming), allow (outgoing), disabled (routed)
New profiles: skip

To                         Action      From
--                         ------      ----
OpenSSH                    ALLOW IN    Anywhere
9100/tcp on eth1           ALLOW IN    192.168.0.0/16             # node exporter
22/tcp                     ALLOW IN    Anywhere                   # llama-cluster ssh
Anywhere                   ALLOW IN    10.0.0.11                  # llama-cluster nodes
Anywhere                   ALLOW IN    10.0.0.12                  # llama-cluster nodes
Anywhere                   ALLOW IN    10.0.0.13                  # llama-cluster nodes
OpenSSH (v6)               ALLOW IN    Anywhere (v6)
22/tcp (v6)                ALLOW IN    Anywhere (v6)              # llama-cluster ssh

"""

# Ubuntu 24.04, ufw 0.36.2: a rate-limited SSH on 2222, a web port without comment, a served
# model (roles/service: not owned by the firewall's main rules) and the rules of an earlier
# release (the training ports and the watchdog, now covered by the nodes' rules).
UBUNTU_2404_ADDED = """\
Added user rules (see 'ufw status' for running firewall):
ufw limit 2222/tcp
ufw allow 8080
ufw allow from 10.0.0.11 to any port 29500,40000:40999 proto tcp comment 'llama-cluster \
training ports'
ufw allow from 10.0.0.11 to any port 29499 proto tcp comment 'llama-cluster job watchdog'
ufw allow from 10.0.0.0/24 to any port 8000 proto tcp comment 'llama-cluster serve-run1'
ufw allow from 2001:db8::7 to any port 22 proto tcp comment 'llama-cluster ssh'
"""
UBUNTU_2404_STATUS = """\
Status: active
Logging: on (medium)
Default: deny (incoming), allow (outgoing), deny (routed)
New profiles: skip

To                         Action      From
--                         ------      ----
2222/tcp                   LIMIT IN    Anywhere
8080                       ALLOW IN    Anywhere
29500,40000:40999/tcp      ALLOW IN    10.0.0.11                  # llama-cluster training ports
29499/tcp                  ALLOW IN    10.0.0.11                  # llama-cluster job watchdog
8000/tcp                   ALLOW IN    10.0.0.0/24                # llama-cluster serve-run1
2222/tcp (v6)              LIMIT IN    Anywhere (v6)
8080 (v6)                  ALLOW IN    Anywhere (v6)
22/tcp                     ALLOW IN    2001:db8::7                # llama-cluster ssh

"""

# Debian 12, ufw 0.36.2, never enabled: status says inactive and nothing else.
DEBIAN_12_ADDED = "Added user rules (see 'ufw status' for running firewall):\n(None)\n"
DEBIAN_12_STATUS = "Status: inactive\n"


def _keys(rules: list[ufw.Rule]) -> list[tuple]:
    return [(r.action, r.src, r.port, r.proto, r.comment, r.extra) for r in rules]


def test_show_added_of_ubuntu_2204_is_read_rule_by_rule() -> None:
    assert _keys(ufw.parse_added(UBUNTU_2204_ADDED)) == [
        ("allow", "any", "", "", "", ("app", "OpenSSH")),
        ("allow", "192.168.0.0/16", "9100", "tcp", "node exporter", ("in", "on", "eth1")),
        ("allow", "any", "22", "tcp", "llama-cluster ssh", ()),
        ("allow", "10.0.0.11", "", "", "llama-cluster nodes", ()),
        ("allow", "10.0.0.12", "", "", "llama-cluster nodes", ()),
        ("allow", "10.0.0.13", "", "", "llama-cluster nodes", ()),
    ]


def test_show_added_of_ubuntu_2404_is_read_rule_by_rule() -> None:
    assert _keys(ufw.parse_added(UBUNTU_2404_ADDED)) == [
        ("limit", "any", "2222", "tcp", "", ()),
        ("allow", "any", "8080", "", "", ()),
        ("allow", "10.0.0.11", "29500,40000:40999", "tcp", "llama-cluster training ports", ()),
        ("allow", "10.0.0.11", "29499", "tcp", "llama-cluster job watchdog", ()),
        ("allow", "10.0.0.0/24", "8000", "tcp", "llama-cluster serve-run1", ()),
        ("allow", "2001:db8::7", "22", "tcp", "llama-cluster ssh", ()),
    ]


def test_show_added_of_a_fresh_debian_node_holds_no_rule() -> None:
    assert ufw.parse_added(DEBIAN_12_ADDED) == []


def test_the_project_s_own_rule_reads_back_as_the_rule_it_asked_for() -> None:
    assert {r.key() for r in ufw.parse_added(UBUNTU_2204_ADDED)} >= {r.key() for r in WANT}


@pytest.mark.parametrize(
    ("text", "active", "logging", "incoming", "rows"),
    [
        (UBUNTU_2204_STATUS, True, "low", "deny", 8),
        (UBUNTU_2404_STATUS, True, "medium", "deny", 8),
        (DEBIAN_12_STATUS, False, "", "", 0),
    ],
)
def test_status_verbose_gives_state_logging_policies_and_rows(
    text: str, active: bool, logging: str, incoming: str, rows: int
) -> None:
    status = ufw.parse_status(text)
    assert (status.active, status.logging, status.incoming) == (active, logging, incoming)
    assert status.outgoing == ("allow" if active else "")
    assert len(status.rules) == rows


def test_status_rows_keep_their_comment_and_the_ipv6_marker() -> None:
    rows = ufw.parse_status(UBUNTU_2404_STATUS).rules
    assert rows[2] == {
        "to": "29500,40000:40999/tcp",
        "action": "ALLOW IN",
        "from": "10.0.0.11",
        "comment": "llama-cluster training ports",
    }
    assert rows[5] == {
        "to": "2222/tcp (v6)",
        "action": "LIMIT IN",
        "from": "Anywhere (v6)",
        "comment": "",
    }


def test_a_node_that_has_everything_runs_nothing() -> None:
    added = "\n".join(UBUNTU_2204_ADDED.splitlines()[:-1])  # without the node that left
    assert ufw.plan(PARAMS, active=True, added=added, conf=CONF, defaults=DEFAULTS).commands() == []


def test_the_rules_of_a_node_that_left_are_deleted_and_no_one_else_s() -> None:
    plan = ufw.plan(PARAMS, active=True, added=UBUNTU_2204_ADDED, conf=CONF, defaults=DEFAULTS)
    assert plan.commands() == [["delete", "allow", "from", "10.0.0.13"]]


def test_rules_of_an_earlier_release_go_and_foreign_and_service_rules_stay() -> None:
    plan = ufw.plan(
        PARAMS, active=True, added=UBUNTU_2404_ADDED, conf="LOGLEVEL=medium\n", defaults=DEFAULTS
    )
    assert [" ".join(argv) for argv in plan.commands()] == [
        "allow proto tcp from any to any port 22 comment llama-cluster ssh",
        "allow from 10.0.0.11 comment llama-cluster nodes",
        "allow from 10.0.0.12 comment llama-cluster nodes",
        "delete allow from 10.0.0.11 to any port 29500,40000:40999 proto tcp",
        "delete allow from 10.0.0.11 to any port 29499 proto tcp",
        "delete allow from 2001:db8::7 to any port 22 proto tcp",
        "logging low",
    ]


def test_a_fresh_node_gets_the_rules_before_the_policies_and_the_enable() -> None:
    plan = ufw.plan(
        PARAMS,
        active=False,
        added=DEBIAN_12_ADDED,
        conf="ENABLED=no\nLOGLEVEL=off\n",
        defaults='DEFAULT_INPUT_POLICY="ACCEPT"\nDEFAULT_OUTPUT_POLICY="ACCEPT"\n',
    )
    assert [c[0] for c in plan.commands()] == ["allow"] * 3 + ["logging", "default", "--force"]
    assert plan.commands()[-2:] == [["default", "deny", "incoming"], ["--force", "enable"]]


def test_the_same_rule_twice_is_added_once() -> None:
    params = {**PARAMS, "rules": WANT + WANT}
    plan = ufw.plan(params, active=True, added=DEBIAN_12_ADDED, conf=CONF, defaults=DEFAULTS)
    assert len(plan.add) == 3


def test_disabled_switches_an_active_ufw_off_and_leaves_an_inactive_one() -> None:
    off = {"rules": [], "purge_comments": [], "state": "disabled"}
    assert ufw.plan(off, active=True, added="", conf=CONF, defaults=DEFAULTS).commands() == [
        ["disable"]
    ]
    assert ufw.plan(off, active=False, added="", conf=CONF, defaults=DEFAULTS).commands() == []


SSHD_T_2222 = """\
port 2222
addressfamily any
listenaddress [::]:2222
listenaddress 0.0.0.0:2222
usepam yes
"""
SSHD_T_LISTEN_OVERRIDES_PORT = """\
port 22
listenaddress 10.0.0.11:2200
listenaddress 127.0.0.1:22
"""


@pytest.mark.parametrize(
    ("text", "ports"),
    [
        (SSHD_T_2222, [2222]),
        (SSHD_T_LISTEN_OVERRIDES_PORT, [22, 2200]),
        ("port 22\nport 443\n", [22, 443]),
        ("sshd: no hostkeys available -- exiting.\n", []),
    ],
)
def test_sshd_ports_come_from_its_effective_configuration(text: str, ports: list[int]) -> None:
    assert ufw.sshd_ports(text) == ports


def test_listening_ports_are_those_of_the_given_sockets_in_listen_state() -> None:
    table = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:08AE 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1
   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5151 1
   2: 0B00000A:08AE 0C00000A:C350 01 00000000:00000000 02:000A7B8F 00000000     0        0 4243 4
"""
    assert ufw.listening_ports(table, {"4242", "4243"}) == [2222]
    assert ufw.listening_ports(table, set()) == []


@pytest.mark.parametrize(
    ("source", "written"),
    [
        ("any", "any"),
        ("10.0.0.5/32", "10.0.0.5"),
        ("10.0.0.5/24", "10.0.0.0/24"),
        ("2001:0db8:0000::0007", "2001:db8::7"),
    ],
)
def test_sources_are_compared_as_ufw_writes_them_back(source: str, written: str) -> None:
    assert ufw.normal_source(source) == written


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"port": "22/tcp", "proto": "tcp", "sources": ["any"]}, "port must be"),
        ({"port": "1:9", "proto": "", "sources": ["10.0.0.1"]}, "needs a proto"),
        ({"port": "", "proto": "", "sources": ["any"]}, "no firewall"),
        ({"port": "22", "proto": "tcp", "sources": ["any"], "comment": "it's"}, "quote"),
        ({"port": "22", "proto": "tcp", "sources": [""]}, "lacks a source"),
    ],
)
def test_rules_ufw_cannot_take_are_refused(rule: dict, problem: str) -> None:
    assert problem in ufw.check_rules(ufw.expand([rule]))
