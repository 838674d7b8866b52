"""The preview's classifier (module_utils/preview.py) and its rendering (callback llama_preview).

The results below are the shapes the modules return (apt's --simulate and real output, uv's and
pip's dry runs and real runs as printed by uv 0.13.9 and pip 24, llama_ufw's commands). The
end-to-end proof, a check-mode run that changes nothing and a real run that makes exactly the
listed changes, is molecule/in_use (tests/test_in_use.py there).
"""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.llama.cluster.plugins.callback.llama_preview import render, table
from ansible_collections.llama.cluster.plugins.module_utils.preview import (
    COMMAND_SKIPPED,
    Item,
    apt_packages,
    classify,
    pip_changes,
)

APT_SIMULATE = """\
NOTE: This is only a simulation!
Reading package lists...
The following NEW packages will be installed:
  python3.11-venv rsync
Inst rsync (3.2.7-1+deb12u2 Debian:12.12/stable [amd64])
Inst python3.11-venv (3.11.2-6+deb12u6 Debian:12.12/stable [amd64])
Inst libc6 [2.36-9+deb12u9] (2.36-9+deb12u10 Debian:12.12/stable [amd64])
Conf rsync (3.2.7-1+deb12u2 Debian:12.12/stable [amd64])
"""
APT_REAL = """\
Unpacking rsync (3.2.7-1+deb12u2) ...
Setting up libc6:amd64 (2.36-9+deb12u10) ...
Setting up rsync (3.2.7-1+deb12u2) ...
Setting up python3.11-venv (3.11.2-6+deb12u6) ...
Processing triggers for man-db (2.11.2-2) ...
"""
UV_DRY = """\
Using Python 3.11.7 environment at: /opt/llama-cluster/env
Resolved 2 packages in 11ms
Would download 2 packages
Would uninstall 1 package
Would install 2 packages
 - idna==3.10
 + idna==3.20
 + packaging==26.4
"""
UV_REAL = """\
Using Python 3.11.7 environment at: /opt/llama-cluster/env
Resolved 2 packages in 6ms
Prepared 2 packages in 100ms
Uninstalled 1 package in 3ms
Installed 2 packages in 15ms
 - idna==3.10
 + idna==3.20
 + packaging==26.4
"""
UV_ARGV = [
    "/opt/llama-cluster/env/bin/uv", "pip", "install", "--python",
    "/opt/llama-cluster/env/bin/python", "--no-index", "--find-links",
    "/opt/llama-cluster/wheelhouse", "--constraint", "/opt/llama-cluster/env/constraints.txt",
    "idna==3.20", "packaging",
]  # fmt: skip


def result(**fields: Any) -> dict[str, Any]:
    return {"changed": True, **fields}


def texts(items: list[Item]) -> list[str]:
    return [f"{i.category}: {i.text}" for i in items]


def test_apt_names_the_same_packages_before_and_after_dependencies_included():
    assert apt_packages(APT_SIMULATE) == ["libc6", "python3.11-venv", "rsync"]
    assert apt_packages(APT_REAL) == apt_packages(APT_SIMULATE)
    planned = classify("ansible.builtin.apt", {}, result(stdout=APT_SIMULATE), check_mode=True)
    done = classify("ansible.builtin.apt", {}, result(stdout=APT_REAL), check_mode=False)
    assert planned == done
    assert texts(planned)[0] == "packages: apt: libc6"


def test_uv_s_dry_run_and_real_run_list_the_same_upgrade_and_install():
    assert pip_changes(UV_DRY) == ["+ idna==3.20", "+ packaging==26.4"]
    args = {"argv": [*UV_ARGV, "--dry-run"]}
    planned = classify("command", args, result(stderr=UV_DRY), check_mode=True)
    done = classify("command", {"argv": UV_ARGV}, result(stderr=UV_REAL), check_mode=False)
    assert planned == done
    assert texts(done) == [
        "packages: pip /opt/llama-cluster/env: + idna==3.20",
        "packages: pip /opt/llama-cluster/env: + packaging==26.4",
    ]


def test_pip_s_would_install_and_successfully_installed_read_alike():
    assert pip_changes("Would install Idna-3.20 uv-0.13.9") == ["+ idna==3.20", "+ uv==0.13.9"]
    assert pip_changes("Successfully installed idna-3.20 uv-0.13.9") == pip_changes(
        "Would install idna-3.20 uv-0.13.9"
    )


def test_an_install_into_an_environment_still_to_be_made_names_what_it_asks_for():
    skipped = {"skipped": True, "changed": False, "msg": COMMAND_SKIPPED}
    assert texts(classify("command", {"argv": UV_ARGV}, skipped, check_mode=True)) == [
        "packages: pip /opt/llama-cluster/env: idna==3.20 packaging (and their locked dependencies)"
    ]


def test_a_command_check_mode_cannot_run_is_listed_as_such_and_one_with_creates_as_a_file():
    skipped = {"skipped": True, "changed": False, "msg": COMMAND_SKIPPED}
    assert texts(classify("command", {"argv": ["modprobe", "nvidia"]}, skipped, True)) == [
        "commands: modprobe nvidia"
    ]
    venv = {"argv": ["python3.11", "-m", "venv", "/e"], "creates": "/e/bin/python"}
    assert texts(classify("ansible.builtin.command", venv, result(), True)) == [
        "files: /e/bin/python (made by: python3.11 -m venv /e)"
    ]


def test_unchanged_results_and_read_only_probes_add_nothing():
    assert classify("ansible.builtin.command", {"argv": ["ufw", "status"]}, {}, True) == []
    assert classify("ansible.builtin.copy", {"dest": "/x"}, {"changed": False}, True) == []
    # A command skipped by its own `when` is no change either.
    assert classify("command", {}, {"skipped": True, "changed": False}, True) == []


def test_firewall_sysctl_accounts_files_and_services_by_module():
    ufw = result(commands=["ufw allow 2222/tcp comment 'llama-cluster ssh'", "ufw --force enable"])
    rollback = {"rollback_dir": "/var/lib/llama-cluster/firewall-rollback", "state": "enabled"}
    assert texts(classify("llama.cluster.llama_ufw", rollback, ufw, True)) == [
        "firewall: ufw allow 2222/tcp comment 'llama-cluster ssh'",
        "firewall: ufw --force enable",
        "files: /var/lib/llama-cluster/firewall-rollback (ufw's state saved for a rollback)",
    ]
    sysctl = {"name": "net.ipv4.ip_local_port_range", "value": "50000 51000", "state": "present"}
    assert texts(classify("ansible.posix.sysctl", sysctl, result(), True)) == [
        "sysctls: net.ipv4.ip_local_port_range = 50000 51000 (present)"
    ]
    assert texts(classify("ansible.builtin.user", {"name": "llama"}, result(), True)) == [
        "users: user llama (present)"
    ]
    assert texts(classify("ansible.builtin.group", {"name": "llama"}, result(), True)) == [
        "users: group llama (present)"
    ]
    directory = {"path": "/opt/llama-cluster", "state": "directory"}
    assert texts(classify("ansible.builtin.file", directory, result(), True)) == [
        "files: /opt/llama-cluster (directory)"
    ]
    # synchronize rewrites its dest to user@host:path.
    sync = {"dest": "debian@172.20.0.2:/opt/llama-cluster/wheelhouse/"}
    assert texts(classify("ansible.posix.synchronize", sync, result(), True)) == [
        "files: /opt/llama-cluster/wheelhouse/ (written)"
    ]
    hosts = {"path": "/etc/hosts", "state": "present"}
    assert texts(classify("ansible.builtin.blockinfile", hosts, result(), True)) == [
        "files: /etc/hosts (edited)"
    ]
    service = {"name": "ssh", "state": "restarted"}
    assert texts(classify("ansible.builtin.systemd_service", service, result(), True)) == [
        "services: ssh restarted"
    ]


def test_the_module_s_own_arguments_win_over_the_task_s_untemplated_ones():
    templated = result(invocation={"module_args": {"dest": "/etc/profile.d/cuda.sh"}})
    task_args = {"dest": "{{ cuda_profile }}"}
    assert texts(classify("ansible.builtin.template", task_args, templated, True)) == [
        "files: /etc/profile.d/cuda.sh (written)"
    ]


@pytest.mark.parametrize(
    ("decision", "shown"),
    [
        ({"action": "keep", "reboot": False, "reason": "570 meets 525"}, "keep, no reboot: 570"),
        ({"action": "install", "reboot": True, "reason": "none loaded"}, "install, reboot: none"),
    ],
)
def test_the_driver_decision_is_shown_whatever_it_is(decision: dict, shown: str):
    facts = {"ansible_facts": {"__nvidia_driver_decision": decision}, "changed": False}
    [item] = classify("ansible.builtin.set_fact", {}, facts, True)
    assert item.category == "driver"
    assert item.text.startswith(shown)


def test_the_preview_prints_each_node_and_one_table():
    items = {
        "node1": {
            "driver": ["install, reboot: no driver loaded"],
            "packages": [f"apt: pkg{n}" for n in range(30)],
            "firewall": ["ufw allow from 10.0.0.2 comment 'llama-cluster nodes'"],
        },
        "node2": {"driver": ["keep, no reboot: 580 loaded"]},
        "localhost": {},
    }
    text = render(items, 12.0)
    assert "nothing was changed" in text
    assert "localhost" not in text
    assert "  packages  apt (30): pkg0, pkg1," in text
    assert "node2:\n  driver    keep, no reboot: 580 loaded\n  (no change)" in text
    rows = table(items).splitlines()
    assert rows[0].split(" | ")[:4] == ["node ", "driver ", "reboot", "packages"]
    assert [cell.strip() for cell in rows[2].split("|")][:5] == [
        "node1", "install", "yes", "30", "1",
    ]  # fmt: skip
    assert [cell.strip() for cell in rows[3].split("|")][:4] == ["node2", "keep", "no", "0"]
