"""Every playbook refuses an inventory that does not add up, in its first play, on the controller,
before any node is touched; the rules themselves, case by case
(llama/cluster/plugins/module_utils/inventory.py, behind the filters of filter/cluster.py).

The nodes of these inventories do not exist: ansible_host 127.0.0.1 on port 9, where nothing
listens, so a playbook that got past the check would stop on "UNREACHABLE" instead of the
message asserted here, and the recap would list the node.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.llama.cluster.plugins.filter import cluster

ROOT = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

GHOST = "ansible_host=127.0.0.{n} ansible_port=9"


def ini(tmp: Path, text: str) -> Path:
    """An INI inventory whose host lines get a ghost address appended, one loopback address per
    line (two hosts at one address are one machine, which the check refuses)."""
    lines, section = [], ""
    for line in text.strip().splitlines():
        if line.startswith("["):
            section = line
        host_line = not line.startswith("[") and not section.endswith((":vars]", ":children]"))
        lines.append(f"{line} {GHOST.format(n=len(lines) + 1)}" if host_line else line)
    path = tmp / "hosts.ini"
    path.write_text("\n".join(lines) + "\n")
    return path


def yaml_inventory(tmp: Path, inventory: dict) -> Path:
    path = tmp / "hosts.yml"
    path.write_text(json.dumps(inventory))
    return path


def ghost(n: int = 1) -> dict:
    return {"ansible_host": f"127.0.0.{n}", "ansible_port": 9}


def run(playbook: str, inventory: Path, *extra: str) -> tuple[int, str]:
    done = subprocess.run(
        # A run that train.yml plans is claimed (made) under the test's own directory.
        [
            *(str(ANSIBLE_PLAYBOOK), "-i", str(inventory), playbook),
            *("-e", f"controller_runs_dir={inventory.parent / 'runs'}", *extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default",
            "PATH": "/usr/bin:/bin",
            "HOME": str(inventory.parent),
            # A fact cache of the test's own: no facts from other runs, none left behind.
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(inventory.parent / "facts"),
        },
    )
    return done.returncode, done.stdout + done.stderr


def recap(out: str) -> dict[str, dict[str, int]]:
    """The play recap: host -> counters."""
    tail = out.rsplit("PLAY RECAP", maxsplit=1)[-1]
    rows = re.findall(r"^(\S+)\s+: ((?:\w+=\d+\s*)+)$", tail, re.M)
    return {
        host: {k: int(v) for k, v in (pair.split("=") for pair in counters.split())}
        for host, counters in rows
    }


def refused(playbook: str, inventory: Path, *extra: str) -> str:
    """Run `playbook`, assert that the inventory check refused it on localhost alone."""
    rc, out = run(playbook, inventory, *extra)
    assert rc != 0, out[-3000:]
    assert "does not describe a cluster" in out, out[-3000:]
    assert "UNREACHABLE" not in out, "a node was contacted"
    assert recap(out) == {
        "localhost": {
            "ok": recap(out)["localhost"]["ok"],
            "changed": 0,
            "unreachable": 0,
            "failed": 1,
            "skipped": 0,
            "rescued": 0,
            "ignored": 0,
        }
    }, "a task ran on a node"
    return " ".join(out.split())


# ---- through the playbooks: each case on another playbook, so that every one is proven -------
def test_no_nodes(tmp_path: Path):
    out = refused("provision.yml", yaml_inventory(tmp_path, {"all": {"hosts": {}}}))
    assert "The inventory has no nodes: no hosts in the group 'cluster'" in out
    assert "Start the lab (ansible-playbook playbooks/lab.yml)" in out
    assert "Expected exactly one host in the group 'master' (node rank 0)" in out
    assert "Found master: no such group; workers: no such group" in out


def test_a_node_in_neither_master_nor_workers(tmp_path: Path):
    inventory = {
        "all": {
            "children": {
                "cluster": {
                    "hosts": {"c": ghost(3)},
                    "children": {
                        "master": {"hosts": {"a": ghost()}},
                        "workers": {"hosts": {"b": ghost(2)}},
                    },
                }
            }
        }
    }
    out = refused("playbooks/wiring.yml", yaml_inventory(tmp_path, inventory))
    assert "c in 'cluster' but neither in 'master' nor in 'workers'" in out
    assert "Found master: a; workers: b; cluster: c, a, b" in out


# (playbook, INI inventory, extra arguments, what the message must say): each case on another
# playbook, so that the first play of every one is proven.
INI_CASES = {
    "no_master": (
        "train.yml",
        "[workers]\na\nb",
        ["-e", "model=tiny"],
        [
            "The group 'master' must hold exactly one host (found: none)",
            "Found master: no such group; workers: a, b; cluster: none",
        ],
    ),
    "two_masters": (
        "playbooks/check.yml",
        "[master]\na\nb\n[workers]\nc",
        [],
        ["The group 'master' must hold exactly one host (found: a, b)", "the others in 'workers'"],
    ),
    "a_node_in_both_master_and_workers": (
        "playbooks/status.yml",
        "[master]\na\n[workers]\na\nb",
        [],
        ["a in both 'master' and 'workers'"],
    ),
    "nodes_outside_or_only_in_the_cluster_group": (
        "playbooks/stop.yml",
        "[master]\na\n[workers]\nb\n[cluster:children]\nmaster\n[cluster]\nx",
        [],
        [
            "b in 'master' or 'workers' but not in 'cluster'",
            "x in 'cluster' but neither in 'master' nor in 'workers'",
        ],
    ),
    # Issue 13: train.yml planned the master for bf16 GPUs and failed after launch.
    "nodes_that_disagree_on_the_accelerator": (
        "train.yml",
        "[master]\na\n[workers]\nb cluster_accelerator=nvidia\n[all:vars]\ncluster_accelerator=cpu",
        ["-e", "model=tiny"],
        [
            "Settings differ between nodes: cluster_accelerator ('cpu' on a; 'nvidia' on b)",
            "cuda_version ('cpu' on a; '",  # the default follows each host's accelerator
            "set each once for the whole cluster",
        ],
    ),
    "the_master_must_be_rank_zero": (
        "playbooks/logs.yml",
        "[master]\na node_rank=1\n[workers]\nb node_rank=0",
        [],
        ["The master a has node_rank 1; the master must be rank 0."],
    ),
    "two_nodes_with_one_rank": (
        "playbooks/export.yml",
        "[master]\na node_rank=0\n[workers]\nb node_rank=2\nc node_rank=2",
        [],
        ["b and c both have node_rank 2; ranks must be unique."],
    ),
    "node_rank_on_some_hosts_only": (
        "provision.yml",
        "[master]\na node_rank=0\n[workers]\nb\nc node_rank=1",
        [],
        ["Some hosts set node_rank but b do not: set it on every host or none."],
    ),
    # Issue 13: nproc_per_node 0 gave world size 0.
    "zero_processes_per_node": (
        "train.yml",
        "[master]\na\n[workers]\nb\n[all:vars]\nnproc_per_node=0",
        ["-e", "model=tiny"],
        [
            "nproc_per_node of a is 0: allowed is a whole number >= 1",
            "nproc_per_node of b is 0: allowed is a whole number >= 1",
        ],
    ),
    "bad_gpu_numbers_are_all_listed": (
        "playbooks/check.yml",
        "[master]\na nproc_per_node=-2 gpu_ids=[0,0]\n"
        "[workers]\nb gpu_ids=all node_rank=x\nc nproc_per_node=4 gpu_ids=[0,1]",
        [],
        [
            "nproc_per_node of a is -2: allowed is a whole number >= 1",
            "gpu_ids of a is [0, 0]: allowed is a non-empty list of distinct GPU indexes",
            "gpu_ids of b is 'all': allowed is a non-empty list",
            "node_rank of b is 'x': allowed is a whole number >= 0",
            "nproc_per_node of c is 4, but gpu_ids gives it 2 GPUs ([0, 1])",
        ],
    ),
    "ports_out_of_range_or_reversed": (
        "playbooks/wiring.yml",
        "[master]\na\n[workers]\nb\n[all:vars]\nmaster_port=80\n"
        "nccl_port_range_start=41000\nnccl_port_range_end=40000",
        [],
        [
            "master_port of a is 80: allowed is a port from 1024 to 65535",
            "master_port of b is 80",
            "nccl_port_range_start of a (41000) is above nccl_port_range_end (40000)",
        ],
    ),
    "ports_inside_the_nccl_range": (
        "playbooks/status.yml",
        "[master]\na\n[workers]\nb\n[all:vars]\nmaster_port=30500\nrendezvous_port=30600\n"
        "nccl_port_range_start=30000\nnccl_port_range_end=30999",
        [],
        [
            "master_port of a (30500) is inside the NCCL port range 30000-30999",
            "rendezvous_port of a (30600) is inside the NCCL port range 30000-30999",
        ],
    ),
    "a_bad_address_and_a_bad_accelerator": (
        "playbooks/stop.yml",
        "[master]\na cluster_address=10.0.0.300\n[workers]\nb\n[all:vars]\ncluster_accelerator=gpu",
        [],
        [
            "cluster_address of a is '10.0.0.300': allowed is an IP address",
            "cluster_accelerator of a is 'gpu': allowed is nvidia or cpu",
        ],
    ),
}


@pytest.mark.parametrize("case", INI_CASES)
def test_a_bad_ini_inventory_is_refused_with_the_fix(case: str, tmp_path: Path):
    playbook, text, extra, messages = INI_CASES[case]
    out = refused(playbook, ini(tmp_path, text), *extra)
    for message in messages:
        assert message in out


def test_the_check_runs_under_limit_without_contacting_a_node(tmp_path: Path):
    rc, out = run("playbooks/check.yml", ini(tmp_path, "[master]\na\nb\n[workers]\nc"), "-l", "c")
    assert rc != 0
    assert "The group 'master' must hold exactly one host (found: a, b)" in " ".join(out.split())
    assert "UNREACHABLE" not in out
    assert recap(out)["c"]["failed"] == 1


@pytest.mark.parametrize("limit", ["a", "a,b,localhost", "all"])
def test_train_refuses_any_limit_naming_it_before_contacting_a_node(tmp_path: Path, limit: str):
    # Under --limit its controller play would be left out and the nodes would fail on a plan
    # that was never made; any limit is refused, naming it, on a good inventory.
    rc, out = run(
        "train.yml", ini(tmp_path, "[master]\na\n[workers]\nb"), "-e", "model=tiny", "-l", limit
    )
    text = " ".join(out.split())
    assert rc != 0
    assert f"so it cannot run under --limit (got --limit {limit}); nothing was changed" in text
    assert "python train_runner.py scaling --model M" in text
    # The way out the go/no-go names for fewer nodes too (issue 39).
    assert "python train_runner.py train --model M --nodes N" in text
    assert "UNREACHABLE" not in out
    assert "Check the request" not in out  # refused by the first play, before the plan


def test_master_and_workers_without_a_cluster_group_are_the_cluster(tmp_path: Path):
    # Issue 13: check.yml "passed" in 0 s on such an inventory, having matched no host. Now it
    # runs on both nodes (which do not exist, hence unreachable).
    rc, out = run("playbooks/check.yml", ini(tmp_path, "[master]\nmaster\n[workers]\nworker1"))
    assert rc != 0
    assert "does not describe a cluster" not in out
    rows = recap(out)
    assert rows["master"]["unreachable"] == 1
    assert rows["worker1"]["unreachable"] == 1


# ---- the rules, case by case -----------------------------------------------------------------
def groups(master: list[str], workers: list[str], **others: list[str]) -> dict[str, list[str]]:
    return {"all": master + workers, "master": master, "workers": workers, **others}


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"nproc_per_node": 0}, "nproc_per_node of a is 0: allowed is a whole number >= 1"),
        ({"nproc_per_node": True}, "nproc_per_node of a is true: allowed"),
        ({"nproc_per_node": 1.5}, "nproc_per_node of a is 1.5: allowed"),
        ({"nproc_per_node": "two"}, "nproc_per_node of a is 'two': allowed"),
        ({"node_rank": -1}, "node_rank of a is -1: allowed is a whole number >= 0"),
        ({"gpu_ids": []}, "gpu_ids of a is []: allowed is a non-empty list"),
        ({"gpu_ids": [0, -1]}, "gpu_ids of a is [0, -1]: allowed"),
        ({"gpu_ids": {"0": 1}}, 'gpu_ids of a is {"0": 1}: allowed'),
        ({"master_port": 65536}, "master_port of a is 65536: allowed is a port from 1024"),
        ({"master_port": 0}, "master_port of a is 0: allowed"),
        ({"rendezvous_port": 22}, "rendezvous_port of a is 22: allowed is 0 (none) or a port"),
        ({"nccl_port_range_end": "x"}, "nccl_port_range_end of a is 'x': allowed"),
        ({"cluster_address": "gpu-a.lan"}, "cluster_address of a is 'gpu-a.lan': allowed is an IP"),
        ({"cluster_accelerator": "rocm"}, "cluster_accelerator of a is 'rocm': allowed"),
        ({"nproc_per_node": 3, "gpu_ids": [0, 1]}, "nproc_per_node of a is 3, but gpu_ids"),
        (
            {"master_port": 40000, "nccl_port_range_start": 40000, "nccl_port_range_end": 40999},
            "master_port of a (40000) is inside the NCCL port range 40000-40999",
        ),
        ({"watchdog_port": 22}, "watchdog_port of a is 22: allowed is 0 (a cluster of one node"),
        (
            {"watchdog_port": 40500, "nccl_port_range_start": 40000, "nccl_port_range_end": 40999},
            "watchdog_port of a (40500) is inside the NCCL port range 40000-40999",
        ),
        (
            {"master_port": 29500, "watchdog_port": 29500},
            "master_port and watchdog_port of a are both 29500: the master listens on each",
        ),
        (
            {"rendezvous_port": 29499, "watchdog_port": 29499},
            "watchdog_port and rendezvous_port of a are both 29499",
        ),
        (
            {"cluster_environment": {"NCCL_DEBUG": "INFO\nexport EVIL=1"}},
            "cluster_environment of a.NCCL_DEBUG holds a line break (or a NUL)",
        ),
        (
            {"cluster_environment": {"BAD-NAME": "1", "1ST": "x", "OK_1": "y"}},
            "cluster_environment of a has names an environment variable cannot have: 'BAD-NAME',"
            " '1ST' (allowed: letters, digits and '_'",
        ),
        (
            {"cluster_environment": {"X": {"nested": 1}}},
            "cluster_environment of a.X is a dict: a variable's value is text",
        ),
        (
            {"cluster_environment": ["NCCL_DEBUG=INFO"]},
            "cluster_environment of a is a list: it must be a mapping of NAME: value",
        ),
    ],
)
def test_each_number_rule_names_what_is_allowed(settings: dict, problem: str):
    report = cluster.inventory_report(groups(["a"], []), {"a": settings})
    assert len(report["problems"]) == 1
    assert problem in report["problems"][0]


@pytest.mark.parametrize(
    "settings",
    [
        {"nproc_per_node": "2", "gpu_ids": ["0", "1"], "node_rank": "0"},  # INI strings
        {"nproc_per_node": 2, "gpu_ids": [3, 1, 2]},
        {"master_port": 1024, "rendezvous_port": 0, "cluster_address": "fd00::12"},
        {"master_port": 29500, "nccl_port_range_start": 40000, "nccl_port_range_end": 40000},
        {"cluster_accelerator": "cpu", "cluster_address": " 10.0.0.12 "},
        {"master_port": 29500, "rendezvous_port": 29500, "watchdog_port": 0},  # one node
        {"cluster_environment": {"NCCL_DEBUG": "INFO", "_X1": 3, "FLAG": True}},
    ],
)
def test_good_values_pass(settings: dict):
    assert cluster.inventory_report(groups(["a"], []), {"a": settings})["problems"] == []


def test_no_watchdog_port_is_refused_on_a_cluster_of_several_nodes():
    hostvars = {"a": {"watchdog_port": 0}, "b": {"watchdog_port": "0"}}
    assert cluster.inventory_report(groups(["a"], ["b"]), hostvars)["problems"] == [
        "watchdog_port is 0 on a, b, but the cluster has 2 nodes: their agents keep their "
        "heartbeats with the master's on that port (0 is for a cluster of one node). Set a free "
        "port (default 29499)."
    ]


# ---- two inventory hosts that are one machine -------------------------------------------------
def _facts(machine: str, *addresses: str) -> dict:
    return {"ansible_facts": {"machine_id": machine, "all_ipv4_addresses": list(addresses)}}


@pytest.mark.parametrize(
    ("hostvars", "problem"),
    [
        (
            {"a": {"ansible_host": "10.0.0.1"}, "b": {"ansible_host": "10.0.0.1 "}},
            "a and b are one machine: they are reached at the same address 10.0.0.1. Every rank",
        ),
        (
            {"a": {}, "b": {"ansible_host": "A"}},  # no ansible_host: the name is the address
            "a and b are one machine: they are reached at the same address A.",
        ),
        (
            {
                "a": {"ansible_host": "h", "ansible_port": 2222},
                "b": {"ansible_host": "h", "ansible_port": "2222"},
            },
            "a and b are one machine: they are reached at the same address h port 2222.",
        ),
        (
            {"a": {"cluster_address": "10.1.0.1"}, "b": {"cluster_address": "10.1.0.1"}},
            "a and b are one machine: they have the same cluster_address 10.1.0.1.",
        ),
        (
            {"a": _facts("m1", "10.0.0.2", "10.0.0.1"), "b": _facts("m1", "10.0.0.1", "10.0.0.2")},
            "a and b are one machine: they have, in their facts, the same machine-id m1 and "
            "addresses 10.0.0.1, 10.0.0.2.",
        ),
    ],
)
def test_two_hosts_that_are_one_machine_are_refused_naming_both(hostvars: dict, problem: str):
    report = cluster.inventory_report(groups(["a"], ["b"]), hostvars, [], True)
    assert len(report["problems"]) == 1, report["problems"]
    assert report["problems"][0].startswith(problem)
    assert "the run would count it twice: list each machine once" in report["problems"][0]


@pytest.mark.parametrize(
    "hostvars",
    [
        {"a": {"ansible_host": "h", "ansible_port": 2201}, "b": {"ansible_host": "h",
                                                                 "ansible_port": 2202}},
        # Cloned images share a machine-id (the lab's containers all carry their image's): the
        # addresses tell the machines apart.
        {"a": _facts("m1", "10.0.0.1"), "b": _facts("m1", "10.0.0.2")},
        # The controller itself has no address to compare (tests simulate nodes this way).
        {"a": {"ansible_connection": "local"}, "b": {"ansible_connection": "local"}},
        # Logical nodes of one machine that split its GPUs (bench/gpu/inventory.yml).
        {
            "a": {"ansible_host": "h", "gpu_ids": [0], **_facts("m1", "10.0.0.1")},
            "b": {"ansible_host": "h", "gpu_ids": ["1"], **_facts("m1", "10.0.0.1")},
        },
    ],
)  # fmt: skip
def test_hosts_that_differ_in_address_port_or_facts_are_distinct_machines(hostvars: dict):
    assert cluster.inventory_report(groups(["a"], ["b"]), hostvars, [], True)["problems"] == []


def test_hosts_of_one_machine_that_share_a_gpu_are_refused():
    hostvars = {"a": {"ansible_host": "h", "gpu_ids": [0, 1]}, "b": {"ansible_host": "h"}}
    assert cluster.inventory_report(groups(["a"], ["b"]), hostvars)["problems"]
    hostvars["b"]["gpu_ids"] = [1, 2]
    (problem,) = cluster.inventory_report(groups(["a"], ["b"]), hostvars)["problems"]
    assert "to split one machine's GPUs between hosts, give each its own gpu_ids" in problem


def test_cached_facts_are_not_compared_unless_asked():
    # The controller's check reads cached facts, which may predate a fix of the inventory.
    hostvars = {"a": _facts("m1", "10.0.0.1"), "b": _facts("m1", "10.0.0.1")}
    assert cluster.inventory_report(groups(["a"], ["b"]), hostvars)["problems"] == []
    assert cluster.inventory_report(groups(["a"], ["b"]), hostvars, [], True)["problems"]


def test_train_refuses_two_hosts_at_one_address_before_contacting_a_node(tmp_path: Path):
    # The lab's probe (issue 40): both ranks trained on one machine, reported as world size 2.
    inventory = {
        "all": {
            "children": {
                "master": {"hosts": {"a": ghost(1)}},
                "workers": {"hosts": {"b": ghost(1), "c": ghost(2)}},
            }
        }
    }
    out = refused("train.yml", yaml_inventory(tmp_path, inventory), "-e", "model=tiny")
    assert "a and b are one machine: they are reached at the same address 127.0.0.1 port 9" in out


def test_train_refuses_one_machine_under_two_names_from_the_facts_before_writing(tmp_path: Path):
    # Two names for this controller (a local connection has no address to compare before the
    # nodes are contacted): the facts train.yml gathers show one machine-id and one set of
    # addresses, and its first task on the nodes refuses, before anything is written there.
    local = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "cluster_accelerator": "cpu",
        "nproc_per_node": 1,
    }
    inventory = {
        "all": {"children": {"master": {"hosts": {"a": local}}, "workers": {"hosts": {"b": local}}}}
    }
    rc, out = run("train.yml", yaml_inventory(tmp_path, inventory), "-e", "model=tiny")
    said = " ".join(out.split())
    assert rc != 0, said[-3000:]
    assert "TASK [Train | Refuse two inventory hosts that are one machine]" in said
    assert "a and b are one machine: they have, in their facts, the same machine-id" in said
    assert "Nothing was written on any node." in said
    assert "Refuse to start while a run is in progress" not in said
    assert {host: recap(out)[host]["changed"] for host in ("a", "b")} == {"a": 0, "b": 0}


def test_wiring_refuses_a_newline_in_the_cluster_environment_before_contacting_a_node(
    tmp_path: Path,
):
    inventory = {
        "all": {
            "vars": {"cluster_environment": {"NCCL_DEBUG": "INFO\nLD_PRELOAD=/tmp/x.so"}},
            "children": {
                "master": {"hosts": {"a": ghost(1)}},
                "workers": {"hosts": {"b": ghost(2)}},
            },
        }
    }
    out = refused("playbooks/wiring.yml", yaml_inventory(tmp_path, inventory))
    assert "cluster_environment of a.NCCL_DEBUG holds a line break" in out
    assert "cluster_environment of b.NCCL_DEBUG holds a line break" in out


def test_without_a_cluster_group_master_and_workers_are_the_nodes():
    report = cluster.inventory_report(groups(["m"], ["w1", "w2"]), {"m": {}, "w1": {}, "w2": {}})
    assert report["problems"] == []
    assert report["nodes"] == ["m", "w1", "w2"]


def test_settings_unset_on_every_node_are_not_compared():
    hostvars = {"a": {"cuda_version": "12.8"}, "b": {}}
    report = cluster.inventory_report(groups(["a"], ["b"]), hostvars, ["cuda_version", "x"])
    assert report["problems"] == []


def test_disagreements_are_one_problem_naming_each_value_and_its_nodes():
    hostvars = {
        "a": {"cuda_version": "12.8", "torch_matrix": {"12.8": {"torch": "2.11.0"}}},
        "b": {"cuda_version": "12.8", "torch_matrix": {"12.8": {"torch": "2.11.0"}}},
        "c": {"cuda_version": "12.6", "torch_matrix": {"12.8": {"torch": "2.10.0"}}},
    }
    report = cluster.inventory_report(
        groups(["a"], ["b", "c"]), hostvars, ["cuda_version", "torch_matrix"]
    )
    assert report["problems"] == [
        "Settings differ between nodes: cuda_version ('12.8' on a, b; '12.6' on c), "
        'torch_matrix ({"12.8": {"torch": "2.11.0"}} on a, b; {"12.8": {"torch": "2.10.0"}} on c).'
        " Every node must have the same: set each once for the whole cluster ([all:vars], the"
        " group cluster, or group_vars/all.yml beside the inventory), not per host."
    ]


def test_the_message_lists_every_problem_then_what_was_expected_and_found():
    report = cluster.inventory_report(
        groups(["a", "b"], ["b"], gpus=["z"]), {"a": {}, "b": {"nproc_per_node": 0}}
    )
    lines = report["message"].splitlines()
    assert lines[0].startswith("- The group 'master' must hold exactly one host (found: a, b)")
    assert lines[1] == "- b in both 'master' and 'workers': a node is one or the other."
    assert lines[2].startswith("- nproc_per_node of b is 0")
    assert lines[3].startswith("Expected exactly one host in the group 'master'")
    assert lines[4] == (
        "Found master: a, b; workers: b; cluster: none (master + workers make it); gpus: z."
    )


# Node ranks and processes per node, as the cluster filters derive them from an inventory.


def topology(master: list[str], workers: list[str]) -> dict[str, list[str]]:
    return {"cluster": master + workers, "master": master, "workers": workers}


def test_master_is_rank_zero_and_workers_follow_inventory_order():
    hosts = {h: {} for h in ("a", "b", "c")}
    assert cluster.cluster_ranks(topology(["b"], ["c", "a"]), hosts) == {
        "b": 0,
        "c": 1,
        "a": 2,
    }


def test_without_a_cluster_group_master_and_workers_are_ranked():
    hosts = {h: {} for h in ("m", "w1", "w2")}
    inventory = {"master": ["m"], "workers": ["w1", "w2"]}
    assert cluster.cluster_ranks(inventory, hosts) == {"m": 0, "w1": 1, "w2": 2}


def test_explicit_node_ranks_are_used():
    hosts = {"a": {"node_rank": 0}, "b": {"node_rank": 2}, "c": {"node_rank": "1"}}
    assert cluster.cluster_ranks(topology(["a"], ["b", "c"]), hosts) == {
        "a": 0,
        "b": 2,
        "c": 1,
    }


@pytest.mark.parametrize(
    ("inventory", "hostvars", "message"),
    [
        ({"cluster": [], "master": [], "workers": []}, {}, "no hosts in the group 'cluster'"),
        (topology([], ["a"]), {"a": {}}, "exactly one host (found: none)"),
        (topology(["a", "b"], []), {"a": {}, "b": {}}, "exactly one host (found: a, b)"),
        (
            {"cluster": ["a", "b", "c"], "master": ["a"], "workers": ["b"]},
            {"a": {}, "b": {}, "c": {}},
            "c in 'cluster' but neither in 'master' nor in 'workers'",
        ),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 0}, "b": {}},
            "set it on every host or none",
        ),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 1}, "b": {"node_rank": 0}},
            "must be rank 0",
        ),
        (topology(["a"], ["b"]), {"a": {"node_rank": 0}, "b": {"node_rank": 0}}, "both have"),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 0}, "b": {"node_rank": 5}},
            "do not add up",
        ),
        (
            topology(["a"], ["b"]),
            {"a": {"node_rank": 0}, "b": {"node_rank": "x"}},
            "node_rank of b is 'x': allowed is a whole number >= 0",
        ),
    ],
)
def test_bad_topologies_fail_with_the_fix(inventory, hostvars, message):
    with pytest.raises(AnsibleFilterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cluster.cluster_ranks(inventory, hostvars)


@pytest.mark.parametrize(
    ("hostvars", "expected"),
    [
        ({"nproc_per_node": 3, "gpu_ids": [0]}, 3),
        ({"gpu_ids": [0, 1, 2, 3]}, 4),
        ({"cluster_accelerator": "cpu"}, 1),
        ({"ansible_local": {"llama_host": {"gpu_count": 8}}}, 8),
    ],
)
def test_processes_per_node(hostvars, expected):
    assert cluster.node_nproc(hostvars) == expected


@pytest.mark.parametrize("nproc", [0, -1, "two", 1.5])
def test_processes_per_node_must_be_a_positive_whole_number(nproc):
    with pytest.raises(AnsibleFilterError, match="allowed is a whole number >= 1"):
        cluster.node_nproc({"inventory_hostname": "gpu1", "nproc_per_node": nproc})


def test_gpu_node_without_gpus_or_nproc_fails():
    with pytest.raises(AnsibleFilterError, match="reports no GPUs"):
        cluster.node_nproc({"inventory_hostname": "gpu1", "ansible_local": {}})


def test_a_node_whose_facts_list_no_gpu_is_told_to_set_cluster_accelerator_cpu():
    # Issue 39: the lab's CPU nodes in a tutorial's inventory were refused without naming it.
    facts = {"llama_host": {"gpus": [], "gpu_count": 0}}
    with pytest.raises(AnsibleFilterError, match="set cluster_accelerator=cpu for the cluster"):
        cluster.node_nproc({"inventory_hostname": "lab1", "ansible_local": facts})


# ---- an inventory of the group cluster alone (a tutorial's [cluster] of addresses) ---------------
@pytest.mark.parametrize(
    ("inventory", "hostvars", "ranks"),
    [
        # the first host of cluster is the master, the others workers in inventory order
        ({"cluster": ["c", "a", "b"]}, {}, {"c": 0, "a": 1, "b": 2}),
        # ... unless a host is named: the group master, or node_rank=0
        ({"cluster": ["c", "a", "b"], "master": ["b"]}, {}, {"b": 0, "c": 1, "a": 2}),
        (
            {"cluster": ["c", "a"]},
            {"c": {"node_rank": "1"}, "a": {"node_rank": "0"}},
            {"a": 0, "c": 1},
        ),
        # workers named, no master: the host of cluster that is not a worker
        ({"cluster": ["a", "b"], "workers": ["a"]}, {}, {"b": 0, "a": 1}),
    ],
)
def test_the_group_cluster_alone_makes_its_first_host_the_master(inventory, hostvars, ranks):
    hostvars = {h: hostvars.get(h, {}) for h in inventory["cluster"]}
    assert cluster.cluster_ranks(inventory, hostvars) == ranks
    report = cluster.inventory_report(inventory, hostvars)
    assert report["problems"] == [], report["message"]


def test_a_tutorial_ini_of_the_group_cluster_alone_passes_the_check(tmp_path: Path):
    # As a tutorial writes it (and the README): addresses, a user who becomes root, no
    # [master] or [workers]. The check passes and the plays that follow see node1 as the master
    # (they then find the nodes unreachable: they do not exist).
    text = "[cluster]\nnode1\nnode2\n[cluster:vars]\nansible_user=ubuntu\nansible_become=true\n"
    rc, out = run("playbooks/status.yml", ini(tmp_path, text))
    assert "does not describe a cluster" not in out, out[-3000:]
    assert "node1: master" in out, out[-3000:]
    assert "node2: workers" in out, out[-3000:]
    # status.yml asks the master (node1) for the runs: the first node it tries to reach.
    asked = out.split("List the runs on the master", 1)[-1]
    assert "fatal: [node1]: UNREACHABLE" in asked, out[-3000:]
    assert rc != 0


def test_global_ranks_follow_node_rank_then_local_rank():
    hostvars = {"a": {"nproc_per_node": 2}, "b": {"nproc_per_node": 3}, "c": {"gpu_ids": [4]}}
    assert cluster.global_ranks(topology(["b"], ["a", "c"]), hostvars) == {
        "b": [0, 1, 2],
        "a": [3, 4],
        "c": [5],
    }
