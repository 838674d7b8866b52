"""The lab's go/no-go and its ways out, and the pre-flight of a node's processes, on the real
lab (provisioned once: tests/conftest.py's `provisioned`).

The lab trains on CPUs, which the cost model does not predict; `cluster_planning_profile=rtx4090`
plans its nodes as RTX 4090s for the prediction and the go/no-go only (an emulation, said on
every line it gives). On a 10 Gbit/s link the tiny model's 2 nodes are predicted slower than one
(its step is shorter than the link's fixed cost), so train.yml refuses; each way out the refusal
names is then asked for, as the refusal writes it, and the plan passes. Plans only (train.yml
--check through train_runner.py plan): nothing is trained or written on a node.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from train_runner import DEFAULT_INVENTORY, Cluster

ROOT = Path(__file__).resolve().parents[2]
EMULATED = ["-e", "cluster_planning_profile=rtx4090", "-e", "link_gbps=10"]

pytestmark = pytest.mark.lab


def runner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "train_runner.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_the_lab_planned_as_4090s_is_refused_and_every_way_out_the_refusal_names_passes(
    provisioned: Cluster,
) -> None:
    refused = runner("plan", "--model", "tiny", *EMULATED)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode != 0, said[-3000:]
    assert "Emulated (cluster_planning_profile=rtx4090: these CPU nodes planned as" in said
    assert "Refused before launch: 2 nodes would train slower than 1" in said, said[-3000:]
    fewer = re.search(
        r"fewer nodes: 1 \(python train_runner.py train --model tiny (--nodes 1)", said
    )
    assert fewer, said[-3000:]
    ways = {"fewer nodes": ["--nodes", "1"], "train anyway": ["-e", "allow_slow_scaling=true"]}
    # A larger batch is offered only where the lab's 28 records hold it on 2 x 2 processes.
    accumulation = re.search(r"more accumulation: -e '(\{.*?\}\})'", said)
    if accumulation:
        asked = json.loads(accumulation.group(1))  # the refusal's own -e, as it writes it
        ways["more accumulation"] = ["-e", json.dumps(asked)]
    for way, extra in ways.items():
        done = runner("plan", "--model", "tiny", *extra, *EMULATED)
        text = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 0, f"{way}: {text[-3000:]}"
        assert "Emulated (cluster_planning_profile=rtx4090" in text, f"{way}: {text[-2000:]}"
    # No copy of the inventory is left behind by --nodes.
    assert not list(DEFAULT_INVENTORY.parent.glob(f".{DEFAULT_INVENTORY.stem}.*.nodes.yml"))


def test_a_node_of_several_processes_with_dockers_64_mb_of_shm_is_refused_naming_the_fix(
    provisioned: Cluster,
) -> None:
    # The lab's containers keep Docker's default /dev/shm (64 MB). Its CPU ranks talk over TCP,
    # so train.yml asks nothing of it; asked for what a GPU node needs, check.yml refuses.
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(DEFAULT_INVENTORY),
            "playbooks/check.yml", "-e", '{"preflight_checks": ["ranks"]}',
            "-e", "preflight_shm_min_mib=1024",
        ],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    said = " ".join(done.stdout.split())
    assert done.returncode != 0, said[-3000:]
    assert "runs 2 processes but its /dev/shm holds 64 MiB" in said, said[-3000:]
    assert "--shm-size=1g" in said
    assert "P2P: none (a CPU node" in said
