"""The preflight's consistency filter: table, odd-node detection, missing facts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter import preflight

ROOT = Path(__file__).resolve().parents[1]

KEYS = yaml.safe_load((ROOT / "roles/preflight/defaults/main.yml").read_text())[
    "preflight_consistency_keys"
]


def node_facts(**stack: str) -> dict:
    # The shapes host_facts and llamafactory write (roles/*/files/*_probe.py).
    host = {
        "os": {"id": "ubuntu", "version": "24.04", "codename": "noble", "key": "ubuntu-24.04"},
        "driver_loaded": True,
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
        "gpu_count": 2,
        "gpus": [
            {"index": 0, "name": "NVIDIA H200", "memory_mib": 143771, "pci_bus_id": "0000:18:00.0"},
            {"index": 1, "name": "NVIDIA H200", "memory_mib": 143771, "pci_bus_id": "0000:2a:00.0"},
        ],
    }
    versions = {
        "python": "3.12.3",
        "torch": "2.11.0",
        "torchaudio": "2.11.0",
        "torchvision": "0.26.0",
        "transformers": "5.6.0",
        "llamafactory": "0.9.5",
        "deepspeed": "0.19.8",
        "accelerate": "1.11.0",
        "peft": "0.18.1",
        "torch_cuda": "13.0",
        "nccl": "2.28.9",
    }
    versions.update(stack)
    return {"llama_host": host, "llama_stack": versions}


def test_identical_nodes_pass_and_the_table_has_one_row_per_node() -> None:
    facts = {name: node_facts() for name in ("node1", "node2", "node3")}
    result = preflight.preflight_consistency(facts, KEYS, "node1")
    assert result["missing"] == {}
    assert result["mismatches"] == []
    header, *rows = result["table"]
    assert header.split()[:3] == ["node", "os", "driver"]
    assert [row.split()[0] for row in rows] == ["node1", "node2", "node3"]
    assert "NVIDIA H200" in rows[0]
    assert "ubuntu-24.04" in rows[0]
    assert "2.28.9" in rows[2]


def test_the_odd_node_and_its_value_are_named() -> None:
    facts = {"node1": node_facts(), "node2": node_facts(), "node3": node_facts(torch="2.10.0")}
    result = preflight.preflight_consistency(facts, KEYS, "node1")
    assert result["mismatches"] == ["node3: torch is 2.10.0, but 2.11.0 on node1, node2"]


def test_a_tie_between_two_nodes_is_decided_by_the_master() -> None:
    facts = {"master": node_facts(), "worker": node_facts(deepspeed="0.18.0")}
    result = preflight.preflight_consistency(facts, KEYS, "master")
    assert result["mismatches"] == ["worker: deepspeed is 0.18.0, but 0.19.8 on master"]


def test_a_different_gpu_model_or_count_is_named() -> None:
    odd = node_facts()
    odd["llama_host"] = dict(odd["llama_host"], gpu_count=1, gpus=[{"name": "NVIDIA A100"}])
    facts = {"node1": node_facts(), "node2": node_facts(), "node3": odd}
    mismatches = preflight.preflight_consistency(facts, KEYS, "node1")["mismatches"]
    assert "node3: gpus is 1, but 2 on node1, node2" in mismatches
    assert "node3: gpu model is NVIDIA A100, but NVIDIA H200 on node1, node2" in mismatches


def test_a_package_missing_on_one_node_is_a_difference() -> None:
    facts = {"node1": node_facts(), "node2": node_facts(deepspeed=None)}
    result = preflight.preflight_consistency(facts, KEYS, "node1")
    assert result["mismatches"] == ["node2: deepspeed is -, but 0.19.8 on node1"]


@pytest.mark.parametrize("absent", ["llama_host", "llama_stack"])
def test_missing_provisioning_facts_are_reported_per_node(absent: str) -> None:
    partial = node_facts()
    del partial[absent]
    facts = {"node1": node_facts(), "node2": partial}
    assert preflight.preflight_consistency(facts, KEYS, "node1")["missing"] == {"node2": [absent]}
