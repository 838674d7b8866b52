"""An active ufw keeps its default policies and logging unless the inventory asks
(`firewall_default_deny`, `firewall_logging`), and wherever a policy would turn to deny the
preview names the listening ports that would go dark (issue 45: an active ufw whose incoming
default was allow was switched to deny, and its logging changed, with no word of what went
dark). The module runs against real ufw in the molecule scenarios; here its decisions
(module_utils/ufw.py), the role's arguments and the preview's lines."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.llama.cluster.plugins.module_utils import preview, ufw

from tests.unit.roles.test_firewall import OWNED, WANT

ROOT = Path(__file__).resolve().parents[3]
ALLOWING = 'IPV6=yes\nDEFAULT_INPUT_POLICY="ACCEPT"\nDEFAULT_OUTPUT_POLICY="ACCEPT"\n'
DENYING = 'IPV6=yes\nDEFAULT_INPUT_POLICY="DROP"\nDEFAULT_OUTPUT_POLICY="ACCEPT"\n'
CONF = "ENABLED=yes\nLOGLEVEL=medium\n"
ADDED = "Added user rules (see 'ufw status' for running firewall):\nufw allow 8080\n"
DARK = [{"port": 9100, "processes": ["node_exporter"], "text": "9100/tcp (node_exporter)"}]


def _role_arguments(default_deny: bool, logging: str = "") -> dict[str, str]:
    """The policies and logging roles/firewall hands llama_ufw, as its task writes them."""
    tasks = yaml.safe_load((ROOT / "roles/firewall/tasks/main.yml").read_text())
    block = next(t for t in tasks if "block" in t)["block"]
    args = next(t for t in block if "llama.cluster.llama_ufw" in t)["llama.cluster.llama_ufw"]
    env = jinja2.Environment()
    env.filters["bool"] = bool
    given = {"firewall_default_deny": default_deny, "firewall_logging": logging}
    return {
        key: env.from_string(args[key]).render(given)
        for key in ("default_incoming", "default_outgoing", "logging")
    }


def _plan(default_deny: bool, *, active: bool, defaults: str, logging: str = "") -> ufw.Plan:
    params = {
        "rules": WANT,
        "purge_comments": OWNED,
        "state": "enabled",
        "if_inactive": "enable",
        **_role_arguments(default_deny, logging),
    }
    return ufw.plan(params, active=active, added=ADDED, conf=CONF, defaults=defaults)


def test_by_default_the_role_asks_for_no_policy_and_no_logging_level() -> None:
    assert _role_arguments(False) == {"default_incoming": "", "default_outgoing": "", "logging": ""}
    asked = _role_arguments(True, "low")
    assert asked == {"default_incoming": "deny", "default_outgoing": "allow", "logging": "low"}
    defaults = yaml.safe_load((ROOT / "group_vars/all/network.yml").read_text())
    assert defaults["firewall_default_deny"] is False
    role = yaml.safe_load((ROOT / "roles/firewall/defaults/main.yml").read_text())
    assert role["firewall_logging"] == ""


def test_an_active_allow_by_default_ufw_keeps_its_policies_and_logging() -> None:
    plan = _plan(False, active=True, defaults=ALLOWING)
    commands = [" ".join(argv) for argv in plan.commands()]
    assert not [c for c in commands if c.startswith(("default", "logging"))], commands
    assert [c for c in commands if c.startswith("allow")]  # the cluster's rules, added
    assert not ufw.goes_dark(plan, active=True, defaults=ALLOWING)


def test_asked_for_a_default_deny_it_is_set_and_the_ports_that_go_dark_are_named() -> None:
    plan = _plan(True, active=True, defaults=ALLOWING, logging="low")
    assert ["default", "deny", "incoming"] in plan.settings
    assert ["logging", "low"] in plan.settings
    assert ufw.goes_dark(plan, active=True, defaults=ALLOWING)
    # Already denying: nothing more goes dark.
    assert not ufw.goes_dark(_plan(True, active=True, defaults=DENYING), active=True,
                             defaults=DENYING)  # fmt: skip


@pytest.mark.parametrize(("defaults", "dark"), [(DENYING, True), (ALLOWING, False)])
def test_turning_ufw_on_darkens_what_its_incoming_default_denies(defaults: str, dark: bool) -> None:
    plan = _plan(False, active=False, defaults=defaults)
    assert ["--force", "enable"] in plan.settings
    assert ufw.goes_dark(plan, active=False, defaults=defaults) is dark


def test_the_preview_names_each_port_that_would_go_dark() -> None:
    result = {"changed": True, "commands": ["ufw default deny incoming"], "unruled": DARK}
    items = preview.ufw_items({"rollback_dir": "/var/lib/x"}, result)
    lines = [(item.category, item.text) for item in items]
    assert ("firewall", "ufw default deny incoming") in lines
    assert ("firewall", "9100/tcp (node_exporter) would go dark (no rule names it)") in lines
