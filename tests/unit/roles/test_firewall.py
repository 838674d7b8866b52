"""roles/firewall's ufw logic (module_utils/ufw.py): what ufw says, what the module runs.

The fixtures are written in the formats of ufw 0.36.1 (Ubuntu 22.04) and 0.36.2 (Ubuntu 24.04,
Debian 12): `ufw status verbose` pads its columns with spaces and puts a rule's comment after
` # `; `ufw show added` prints each rule as the command that adds it, the comment quoted. Each
fixture mixes the project's rules with an operator's (an application profile, a rate limit, an
interface, a plain port), which must never be touched. The module itself runs against real ufw
in the molecule scenarios (cluster, in_use).
"""

from __future__ import annotations

import json
import re

import pytest
from ansible_collections.llama.cluster.plugins.module_utils import ufw

from tests.support.role_cases import LOCAL, run_cases

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
    "if_inactive": "enable",
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


def test_an_inactive_ufw_is_left_off_and_untouched_unless_asked() -> None:
    # The default (if_inactive leave): a server whose ufw is off keeps every service reachable.
    params = {**PARAMS, "if_inactive": "leave"}
    for added in (DEBIAN_12_ADDED, UBUNTU_2204_ADDED):
        left = ufw.plan(params, active=False, added=added, conf="ENABLED=no\n", defaults="")
        assert left.commands() == []
        assert left.left_inactive
    assert ufw.leaves_inactive({"state": "enabled"}, active=False)
    assert not ufw.leaves_inactive({"state": "enabled", "if_inactive": "enable"}, active=False)
    # An active ufw is brought to the rules whatever if_inactive says.
    on = ufw.plan(params, active=True, added=UBUNTU_2204_ADDED, conf=CONF, defaults=DEFAULTS)
    assert not on.left_inactive
    assert on.commands() == [["delete", "allow", "from", "10.0.0.13"]]


# The probe of issue 40: the operator had allowed their SSH port themselves before provision.yml
# ran. ufw takes a rule that differs only in its comment (or has none) for the same rule and
# relabels it, after which the project owned the operator's rule and deleted it when
# firewall_ssh_sources narrowed. Recorded with ufw 0.36.2 in the lab's node image: after
# `ufw allow 8080; ufw allow 2222/tcp comment mine-ssh`, `ufw show added` printed the text below;
# `ufw allow proto tcp from any to any port 2222 comment 'llama-cluster ssh'` then answered
# "Rules updated" and `show added` printed `ufw allow 2222/tcp comment 'llama-cluster ssh'`.
OPERATOR_SSH_ADDED = """\
Added user rules (see 'ufw status' for running firewall):
ufw allow 8080
ufw allow 2222/tcp comment 'mine-ssh'
"""
SSH_2222 = {"port": 2222, "proto": "tcp", "comment": "llama-cluster ssh"}


def _ssh_params(sources: list[str]) -> dict:
    return {**PARAMS, "rules": ufw.expand([{**SSH_2222, "sources": sources}])}


def test_an_identical_rule_of_the_operator_is_kept_under_its_own_comment() -> None:
    plan = ufw.plan(
        _ssh_params(["any"]), active=True, added=OPERATOR_SSH_ADDED, conf=CONF, defaults=DEFAULTS
    )
    assert plan.commands() == []
    assert [ufw.added_line(rule) for rule in plan.kept] == ["ufw allow 2222/tcp comment 'mine-ssh'"]


def test_an_identical_rule_without_a_comment_is_not_adopted_either() -> None:
    added = "Added user rules (see 'ufw status' for running firewall):\nufw allow 2222/tcp\n"
    plan = ufw.plan(_ssh_params(["any"]), active=True, added=added, conf=CONF, defaults=DEFAULTS)
    assert plan.commands() == []
    assert [ufw.added_line(rule) for rule in plan.kept] == ["ufw allow 2222/tcp"]


def test_narrowing_the_ssh_sources_adds_the_project_s_rule_and_deletes_no_operator_rule() -> None:
    plan = ufw.plan(
        _ssh_params(["10.0.0.0/24"]),
        active=True,
        added=OPERATOR_SSH_ADDED,
        conf=CONF,
        defaults=DEFAULTS,
    )
    assert [" ".join(argv) for argv in plan.commands()] == [
        "allow proto tcp from 10.0.0.0/24 to any port 2222 comment llama-cluster ssh"
    ]
    assert plan.delete == []


def test_a_rule_of_an_earlier_release_that_still_lets_the_same_through_stays() -> None:
    # Its comment is the project's, under an older name: neither added again nor deleted.
    added = (
        "Added user rules (see 'ufw status' for running firewall):\n"
        "ufw allow 22/tcp comment 'llama-cluster training ports'\n"
    )
    params = {**PARAMS, "rules": ufw.expand([{**SSH_2222, "port": 22, "sources": ["any"]}])}
    plan = ufw.plan(params, active=True, added=added, conf=CONF, defaults=DEFAULTS)
    assert plan.commands() == []
    assert plan.kept == []


def test_absent_rules_are_deleted_only_under_their_own_comment() -> None:
    # roles/service closing a served port: its rule goes, the operator's identical one stays.
    added = (
        "Added user rules (see 'ufw status' for running firewall):\n"
        "ufw allow from 10.0.0.0/24 to any port 8000 proto tcp comment 'llama-cluster serve-run1'\n"
        "ufw allow from 10.0.0.0/24 to any port 8001 proto tcp comment 'dashboard'\n"
    )
    served = {"proto": "tcp", "sources": ["10.0.0.0/24"], "comment": "llama-cluster serve-run1"}
    params = {
        "rules": [],
        "absent": ufw.expand([{**served, "port": 8000}, {**served, "port": 8001}]),
        "state": "enabled",
    }
    plan = ufw.plan(params, active=True, added=added, conf=CONF, defaults=DEFAULTS)
    assert plan.commands() == [
        ["delete", "allow", "from", "10.0.0.0/24", "to", "any", "port", "8000", "proto", "tcp"]
    ]


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


# /proc/net/tcp and tcp6 as the kernel writes them (addresses in 32-bit words of the host's byte
# order): sshd on 2222, a node exporter on 9100 and a database on loopback only (IPv4); a web
# service on 8080, sshd again, and ::1 and ::ffff:127.0.0.1 listeners (IPv6); one connection.
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:08AE 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1
   1: 00000000:238C 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 5151 1
   2: 0100007F:0CEA 00000000:0000 0A 00000000:00000000 00:00000000 00000000   105        0 6161 1
   3: 0B00000A:08AE 0C00000A:C350 01 00000000:00000000 02:000A7B8F 00000000     0        0 4243 4
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue \
rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:\
00000000 00:00000000 00000000  1000        0 7171 1
   1: 00000000000000000000000000000000:08AE 00000000000000000000000000000000:0000 0A 00000000:\
00000000 00:00000000 00000000     0        0 4244 1
   2: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:\
00000000 00:00000000 00000000  1000        0 8181 1
   3: 0000000000000000FFFF00000100007F:1F92 00000000000000000000000000000000:0000 0A 00000000:\
00000000 00:00000000 00000000  1000        0 9191 1
"""


def test_listening_sockets_leave_out_loopback_and_connections() -> None:
    assert ufw.listening_sockets(PROC_NET_TCP) == {2222: {"4242"}, 9100: {"5151"}}
    assert ufw.listening_sockets(PROC_NET_TCP6) == {8080: {"7171"}, 2222: {"4244"}}


def test_the_ports_no_rule_names_are_those_that_go_dark_when_ufw_turns_on() -> None:
    listening = {**ufw.listening_sockets(PROC_NET_TCP), **ufw.listening_sockets(PROC_NET_TCP6)}
    rules = ufw.parse_added(
        "Added user rules (see 'ufw status' for running firewall):\n"
        "ufw allow 2222/tcp comment 'mine-ssh'\n"
        "ufw allow from 10.0.0.11 comment 'llama-cluster nodes'\n"
        "ufw allow 8000:8079/tcp\n"
        "ufw deny 8080/tcp\n"
        "ufw allow 9100/udp\n"
    )
    # Every port from a node names no port; a deny and a UDP rule let no TCP in.
    assert ufw.unruled_ports(listening, rules) == [8080, 9100]
    assert ufw.unruled_ports(listening, [*rules, *ufw.parse_added("ufw allow 8080,9100/tcp")]) == []


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


# ---- the role's own refusals: roles/firewall's checks run on the controller, each case a host --
# One ansible-playbook run: every case is a host of its own on the local connection, with the
# case's settings as host variables over the project's defaults; each gets the checks of its
# entry point (validate: provision.yml's and wiring.yml's pre-flight; service: roles/service's).
# Nothing reaches ufw: the service cases run with firewall_enabled false, which skips only the
# module, not the check.
CHECKS_PLAYBOOK = [
    {
        "name": "roles/firewall's checks",
        "hosts": "all",
        "gather_facts": False,
        "tasks": [
            {
                "ansible.builtin.include_role": {"name": "firewall", "tasks_from": entry},
                "when": f"firewall_entry == '{entry}'",
            }
            for entry in ("validate", "service")
        ],
    }
]
SERVICE = {
    "firewall_entry": "service",
    "firewall_enabled": False,
    "firewall_service_name": "serve-run1",
    "firewall_service_port": 8000,
    "firewall_service_sources": ["10.0.0.0/24", "any"],
}
CASES: dict[str, dict] = {
    "good": {},
    "no_ssh_source": {"firewall_ssh_sources": []},
    "master_port_too_high": {"firewall_master_port": 70000},
    "ssh_port_zero": {"firewall_ssh_ports": [22, 0]},
    "rendezvous_negative": {"firewall_rendezvous_port": -1},
    "watchdog_in_nccl_range": {"firewall_watchdog_port": 40500},
    "master_in_nccl_range": {"firewall_master_port": 40001},
    "nccl_range_privileged": {"firewall_nccl_port_range_start": 80},
    "nccl_range_inverted": {
        "firewall_nccl_port_range_start": 41000,
        "firewall_nccl_port_range_end": 40000,
    },
    "ssh_source_a_name": {"firewall_ssh_sources": ["bastion.example.com"]},
    "cidr_bad_prefix": {"firewall_cluster_cidrs": ["10.0.0.0/24", "10.1.0.0/x"]},
    "check_too_short": {"firewall_connection_check_timeout": 2},
    "port_not_a_number": {"firewall_master_port": "twenty"},
    "enable_not_a_flag": {"firewall_enable_inactive_ufw": "perhaps"},
    "service_good": SERVICE,
    "service_bad_name": {**SERVICE, "firewall_service_name": "serve run1"},
    "service_port_zero": {**SERVICE, "firewall_service_port": 0},
    "service_source_a_word": {**SERVICE, "firewall_service_sources": ["everyone"]},
    "service_bad_state": {**SERVICE, "firewall_service_state": "closed"},
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each case's failure message ('' for a case that passed)."""
    tmp = tmp_path_factory.mktemp("firewall-checks")
    hosts = {name: {"firewall_entry": "validate", **LOCAL, **case} for name, case in CASES.items()}
    out = run_cases(tmp, {"all": {"hosts": hosts}}, CHECKS_PLAYBOOK)
    fatal = re.findall(r"^fatal: \[(\S+)\]: FAILED! => (\{.*\})$", out, re.M)
    failed = {host: " ".join(json.loads(result).get("msg", "").split()) for host, result in fatal}
    return {name: failed.get(name, "") for name in CASES}


def test_good_settings_pass_the_role_s_checks(refusals: dict[str, str]) -> None:
    assert refusals["good"] == ""
    assert refusals["service_good"] == ""


NETWORK = "Firewall: need ports 1-65535"
SERVICE_CHECK = "Firewall: service"


@pytest.mark.parametrize(
    ("case", "check", "named"),
    [
        ("no_ssh_source", NETWORK, "ssh_sources=[]"),
        ("master_port_too_high", NETWORK, "master_port=70000"),
        ("ssh_port_zero", NETWORK, "ssh_ports=[22, 0]"),
        ("rendezvous_negative", NETWORK, "rendezvous=-1"),
        ("watchdog_in_nccl_range", NETWORK, "watchdog=40500"),
        ("master_in_nccl_range", NETWORK, "master_port=40001"),
        ("nccl_range_privileged", NETWORK, "NCCL range=80-40999"),
        ("nccl_range_inverted", NETWORK, "NCCL range=41000-40000"),
        ("ssh_source_a_name", NETWORK, "ssh_sources=['bastion.example.com']"),
        ("cidr_bad_prefix", NETWORK, "cluster_cidrs=['10.0.0.0/24', '10.1.0.0/x']"),
        ("check_too_short", NETWORK, "connection_check_timeout=2"),
        ("service_bad_name", SERVICE_CHECK, 'service "serve run1"'),
        ("service_port_zero", SERVICE_CHECK, "(got 0)"),
        ("service_source_a_word", SERVICE_CHECK, "(got ['everyone'])"),
        # Types, refused by the role's argument spec before its own check runs.
        ("port_not_a_number", "Validation of arguments failed", "firewall_master_port"),
        ("enable_not_a_flag", "Validation of arguments failed", "firewall_enable_inactive_ufw"),
        ("service_bad_state", "Validation of arguments failed", "firewall_service_state"),
    ],
)
def test_each_bad_setting_is_refused_naming_its_value(
    refusals: dict[str, str], case: str, check: str, named: str
) -> None:
    message = refusals[case]
    assert check in message, message
    assert named in message
    if check == NETWORK:
        assert message.endswith("Fix them in group_vars/all/network.yml.")
