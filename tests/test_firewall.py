"""roles/firewall's llama_ufw: what it runs for a node's ufw state (read once).

The texts below are what ufw 0.36 printed on a lab node (Debian 12). The module itself runs
against real ufw in every provision of the lab and of molecule's scenarios.
"""

from __future__ import annotations

import pytest
from ansible_collections.llama.cluster.plugins.modules import llama_ufw as ufw

NODES = ["172.18.0.2", "172.18.0.3"]
RULES = ufw.expand(
    [
        {"port": 22, "proto": "tcp", "sources": ["any"], "comment": "llama-cluster ssh"},
        {
            "port": "29500,40000:40999",
            "proto": "tcp",
            "sources": NODES,
            "comment": "llama-cluster training ports",
        },
        {"port": 29499, "proto": "tcp", "sources": NODES, "comment": "llama-cluster job watchdog"},
    ]
)
PARAMS = {
    "rules": RULES,
    "logging": "low",
    "default_incoming": "deny",
    "default_outgoing": "allow",
    "state": "enabled",
}
PORTS = "29500,40000:40999"
ADDED = "\n".join(
    [
        "Added user rules (see 'ufw status' for running firewall):",
        "ufw allow 22/tcp comment 'llama-cluster ssh'",
        *(
            f"ufw allow from {node} to any port {PORTS} proto tcp"
            " comment 'llama-cluster training ports'"
            for node in NODES
        ),
        *(
            f"ufw allow from {node} to any port 29499 proto tcp"
            " comment 'llama-cluster job watchdog'"
            for node in NODES
        ),
    ]
)
CONF = "# /etc/ufw/ufw.conf\nENABLED=yes\nLOGLEVEL=low\n"
DEFAULTS = 'IPV6=yes\nDEFAULT_INPUT_POLICY="DROP"\nDEFAULT_OUTPUT_POLICY="ACCEPT"\n'
FRESH_ADDED = "Added user rules (see 'ufw status' for running firewall):\n(None)\n"


def test_a_node_that_has_everything_runs_nothing() -> None:
    assert ufw.plan(PARAMS, active=True, added=ADDED, conf=CONF, defaults=DEFAULTS) == []


def test_a_fresh_node_gets_the_rules_before_the_policies_and_the_enable() -> None:
    commands = ufw.plan(
        PARAMS,
        active=False,
        added=FRESH_ADDED,
        conf="ENABLED=no\nLOGLEVEL=off\n",
        defaults='DEFAULT_INPUT_POLICY="ACCEPT"\nDEFAULT_OUTPUT_POLICY="ACCEPT"\n',
    )
    assert [c[0] for c in commands] == ["allow"] * 5 + ["logging", "default", "--force"]
    assert commands[0] == [
        "allow", "proto", "tcp", "from", "any", "to", "any", "port", "22",
        "comment", "llama-cluster ssh",
    ]  # fmt: skip
    assert commands[-2:] == [["default", "deny", "incoming"], ["--force", "enable"]]


def test_only_the_new_node_s_rules_are_added() -> None:
    params = {
        **PARAMS,
        "rules": [*RULES, *ufw.expand([{**_watchdog(), "sources": ["172.18.0.4"]}])],
    }
    commands = ufw.plan(params, active=True, added=ADDED, conf=CONF, defaults=DEFAULTS)
    assert commands == [
        ufw.rule_command(ufw.expand([{**_watchdog(), "sources": ["172.18.0.4"]}])[0])
    ]


def _watchdog() -> dict:
    return {"port": 29499, "proto": "tcp", "comment": "llama-cluster job watchdog"}


def test_a_changed_level_or_policy_is_set_alone() -> None:
    commands = ufw.plan(
        PARAMS, active=True, added=ADDED, conf="LOGLEVEL=medium\n", defaults=DEFAULTS
    )
    assert commands == [["logging", "low"]]
    outgoing_denied = DEFAULTS.replace('OUTPUT_POLICY="ACCEPT"', 'OUTPUT_POLICY="DROP"')
    commands = ufw.plan(PARAMS, active=True, added=ADDED, conf=CONF, defaults=outgoing_denied)
    assert commands == [["default", "allow", "outgoing"]]


def test_disabled_switches_an_active_ufw_off_and_leaves_an_inactive_one() -> None:
    off = {**PARAMS, "rules": [], "logging": "", "default_incoming": "", "default_outgoing": ""}
    off["state"] = "disabled"
    assert ufw.plan(off, active=True, added=ADDED, conf=CONF, defaults=DEFAULTS) == [["disable"]]
    assert ufw.plan(off, active=False, added=ADDED, conf=CONF, defaults=DEFAULTS) == []


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"port": "", "proto": "tcp", "src": "any"}, "lacks port"),
        ({"port": "22/tcp", "proto": "tcp", "src": "any"}, "port must be"),
        ({"port": "22", "proto": "tcp", "src": "any", "comment": "it's"}, "quote"),
    ],
)
def test_rules_ufw_cannot_take_are_refused(rule: dict, problem: str) -> None:
    assert problem in ufw.check_rules([rule])
