"""The preflight's consistency filter: table, odd-node detection, missing facts; the links:
llama_links's interfaces (its server and client: tests/unit/roles/test_link_server.py), the
networks the
nodes share, the interface a run uses and the fact the planner reads."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_collections.llama.cluster.plugins.filter import links, preflight
from ansible_collections.llama.cluster.plugins.module_utils.planner.links import (
    node_links,
    run_link,
)
from ansible_collections.llama.cluster.plugins.modules import llama_links, llama_route

ROOT = Path(__file__).resolve().parents[3]

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


def _gpus(name: str, mib: int, count: int = 2) -> dict:
    return {"gpus": [{"index": i, "name": name, "memory_mib": mib} for i in range(count)]}


def test_a_gpu_memory_mix_is_refused_unless_allowed_and_then_reported() -> None:
    odd = node_facts(torch="2.10.0")
    odd["llama_host"] = dict(odd["llama_host"], **_gpus("NVIDIA H200", 81559), driver_version="570")
    facts = {"node1": node_facts(), "node2": node_facts(), "node3": odd}
    refused = preflight.preflight_consistency(facts, KEYS, "node1")
    assert "node3: gpu memory is 81559, but 143771 on node1, node2" in refused["mismatches"]
    assert "node3: driver is 570, but 580.159.04 on node1, node2" in refused["mismatches"]
    allowed = preflight.preflight_consistency(facts, KEYS, "node1", allow_hardware=True)
    # The hardware is only reported; a package that differs is still refused.
    assert allowed["mismatches"] == ["node3: torch is 2.10.0, but 2.11.0 on node1, node2"]
    assert allowed["reported"] == [
        "node3: driver is 570, but 580.159.04 on node1, node2",
        "node3: gpu memory is 81559, but 143771 on node1, node2",
    ]
    assert "143771" in allowed["table"][1]


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


# ---- the links ------------------------------------------------------------------------------
def _net(root: Path, name: str, kind: int, *, bridge: bool = False, rdma: bool = False) -> None:
    net = root / name
    net.mkdir()
    (net / "type").write_text(f"{kind}\n")
    if bridge:
        (net / "bridge").mkdir()
    if rdma:
        (net / "device" / "infiniband").mkdir(parents=True)


def test_interface_kinds_come_from_sysfs(tmp_path: Path) -> None:
    _net(tmp_path, "ib0", 32)
    _net(tmp_path, "ens1f0", 1, rdma=True)
    _net(tmp_path, "eth0", 1)
    _net(tmp_path, "br0", 1, bridge=True)
    _net(tmp_path, "tun0", 65534)
    kinds = {net.name: llama_links.interface_kind(net) for net in tmp_path.iterdir()}
    assert kinds == {
        "ib0": "infiniband",
        "ens1f0": "roce",
        "eth0": "ethernet",
        "br0": "bridge",
        "tun0": "other",
    }


def test_this_machines_interfaces_leave_out_loopback_and_carry_their_address() -> None:
    found = llama_links.interfaces()
    assert "lo" not in found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.200", 9))
        own = sock.getsockname()[0]
    assert own in {info["address"] for info in found.values()}
    assert all(info["mtu"] for info in found.values())


# The link server and the measuring side on real sockets, with check.yml's secret and against
# hostile peers: tests/unit/roles/test_link_server.py.


def _iface(
    address: str, kind: str = "ethernet", speed: int | None = 10000, **extra: object
) -> dict:
    return {"address": address, "prefix": 24, "kind": kind, "speed_mbps": speed, "mtu": 1500,
            "operstate": "up", **extra}  # fmt: skip


def _node3(last: int, ib_mbps: int = 200000, ens2_mtu: int = 1500) -> dict:
    """A server with a 1 GbE management port, InfiniBand, 25 GbE and docker0."""
    return {
        "eno1": _iface(f"192.168.1.{last}", speed=1000),
        "ib0": _iface(f"10.9.0.{last}", "infiniband", ib_mbps),
        "docker0": _iface("172.17.0.1", "bridge", None),
        "ens2": _iface(f"10.1.0.{last}", speed=25000, mtu=ens2_mtu),
    }


NODES3 = {"n1": _node3(11), "n2": _node3(12), "n3": _node3(13, ib_mbps=100000, ens2_mtu=9000)}


def test_shared_networks_are_ranked_infiniband_first_and_docker0_is_no_link() -> None:
    networks = links.links_networks(NODES3)
    assert [(n["network"], n["kind"], n["speed_mbps"]) for n in networks] == [
        ("10.9.0.0/24", "infiniband", 100000),  # the slowest node's speed
        ("10.1.0.0/24", "ethernet", 25000),
        ("192.168.1.0/24", "ethernet", 1000),
    ]
    assert links.links_ifname(networks, "n3") == "ib0"
    assert links.links_ifname(networks, "n3", "eno1") == "eno1"  # the inventory's name wins
    assert len(links.links_pairs(networks)) == 3 * 6
    assert links.links_mtu_mismatches(networks) == [
        "10.1.0.0/24: MTU differs between nodes (n1 ens2 1500, n2 ens2 1500, n3 ens2 9000)"
    ]


def test_a_network_one_node_lacks_or_a_down_port_is_not_shared_and_one_node_shares_none() -> None:
    nodes = {h: dict(ifs) for h, ifs in NODES3.items()}
    nodes["n2"] = {k: v for k, v in nodes["n2"].items() if k != "ib0"}
    nodes["n3"]["ens2"] = {**nodes["n3"]["ens2"], "operstate": "down"}
    networks = links.links_networks(nodes)
    assert [n["network"] for n in networks] == ["192.168.1.0/24"]
    assert links.links_ifname(networks, "n1") == "eno1"
    assert links.links_networks({"n1": NODES3["n1"]}) == []
    assert links.links_ifname([], "n1") == ""  # roles/nccl_network keeps the route


def test_the_fact_is_what_the_planner_reads() -> None:
    networks = links.links_networks(NODES3)
    measured = [
        {"item": pair, "tcp_gbps": 90.0 if pair["ifname"] == "ib0" else 9.0, "rtt_ms": 0.1}
        for pair in links.links_pairs(networks)
    ]
    measured[0] = {**measured[0], "tcp_gbps": 40.0, "rtt_ms": 0.4}  # n1 -> n2 on ib0
    result = {
        "backend": "nccl",
        "busbw_gbps": 80.5,
        "algbw_gbps": 60.4,
        "nnodes": 3,
        "world_size": 24,
    }
    allreduce = links.links_allreduce(result, "ib0", "256")
    when = "2026-12-02T12:00:00Z"
    facts = {
        host: links.links_fact(
            host,
            NODES3[host],
            networks,
            measured=measured,
            ifname="ib0",
            allreduce=allreduce,
            measured_at=when,
        )
        for host in NODES3
    }
    assert facts["n1"]["peers"] == {
        "n2": {"ifname": "ib0", "tcp_gbps": 40.0, "rtt_ms": 0.4},
        "n3": {"ifname": "ib0", "tcp_gbps": 90.0, "rtt_ms": 0.1},
    }
    assert facts["n1"]["networks"]["10.1.0.0/24"]["peers"]["n2"]["tcp_gbps"] == 9.0
    assert facts["n2"]["interfaces"]["ib0"] == {
        "kind": "infiniband",
        "speed_mbps": 200000,
        "mtu": 1500,
        "address": "10.9.0.12",
    }
    cluster = [{"host": h, "links": node_links(facts[h], None)} for h in NODES3]
    link, _ = run_link(cluster)
    assert link is not None
    assert link.bandwidth == pytest.approx(80.5e9 / 8)  # the all-reduce's bus bandwidth
    assert link.latency == pytest.approx(0.0002)  # half the largest round trip
    for fact in facts.values():
        del fact["allreduce"]
    link, _ = run_link([{"host": h, "links": node_links(facts[h], None)} for h in NODES3])
    assert link is not None
    assert "slowest TCP stream, n1 to n2" in link.source
    assert link.bandwidth == pytest.approx(40e9 / 8)


def test_the_report_names_every_failed_pair() -> None:
    pair = {"source": "n1", "target": "n2", "network": "10.9.0.0/24", "ifname": "ib0"}
    report = links.links_report(
        [
            {"item": pair, "tcp_gbps": 9.41, "rtt_ms": 0.12},
            {"item": pair, "failed": True, "msg": "refused"},
        ]
    )
    assert report == {
        "measured": ["n1 to n2 on 10.9.0.0/24 (ib0): 9.41 Gbit/s, round trip 0.12 ms"],
        "failed": ["n1 to n2 on 10.9.0.0/24 (ib0): refused"],
    }


@pytest.mark.parametrize(
    ("pairs", "gpus", "disable", "reason"),
    [
        ([], 1, False, "fewer than 2 GPUs"),
        ([(0, 1, True, True), (1, 0, True, True)], 2, False, "P2P works between all 2 GPUs"),
        ([(0, 1, False, True), (1, 0, False, True)], 2, True, "P2P absent (no peer access): 0->1"),
        ([(0, 1, True, False), (1, 0, True, True)], 2, True, "P2P broken (a copy arrived"),
    ],
)
def test_p2p_is_disabled_for_a_node_only_where_it_is_absent_or_broken(
    pairs: list, gpus: int, disable: bool, reason: str
) -> None:
    probe = {
        "gpus": gpus,
        "names": ["NVIDIA GeForce RTX 4090"],
        "pairs": [
            {"from": a, "to": b, "access": access, "intact": ok} for a, b, access, ok in pairs
        ],
    }
    decided = links.links_p2p(probe)
    assert decided["nccl_p2p_disable"] is disable
    assert decided["reason"].replace("GPUs ", "").startswith(reason)
    fact = links.links_fact("n1", {}, [], measured=[], ifname="eth0", p2p=decided)
    assert fact["p2p"]["nccl_p2p_disable"] is disable


def test_with_ufw_on_only_the_networks_it_opens_between_the_nodes_count() -> None:
    networks = links.links_networks(NODES3)
    addresses = {h: f"192.168.1.{i}" for i, h in zip((11, 12, 13), NODES3, strict=True)}
    assert [n["network"] for n in links.links_open(networks, addresses)] == ["192.168.1.0/24"]
    opened = links.links_open(networks, addresses, cidrs=["10.9.0.0/16"])
    assert links.links_ifname(opened, "n1") == "ib0"
    assert len(links.links_open(networks, addresses, firewall=False)) == 3


# plugins/modules/llama_route.py against iproute2 on this machine (the module stands in for it
# on nodes that lack it).


def _own_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.200", 9))
        return str(sock.getsockname()[0])


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 is the reference here")
@pytest.mark.parametrize("target", ["192.0.2.200", "10.255.255.1"])
def test_a_remote_address_gets_the_interface_and_source_of_ip_route_get(target: str) -> None:
    words = subprocess.run(
        ["ip", "-o", "route", "get", target], check=True, capture_output=True, text=True
    ).stdout.split()
    found = llama_route.route(target)
    assert "lo" in found.pop("interfaces")
    assert found == {
        "ifname": words[words.index("dev") + 1],
        "source": words[words.index("src") + 1],
        "local": False,
    }


def test_the_master_itself_gets_the_interface_that_holds_its_address() -> None:
    own = _own_address()
    route = llama_route.route
    loopback = route("127.0.0.1")
    assert loopback.pop("interfaces") == sorted(name for _, name in socket.if_nameindex())
    assert loopback == {"ifname": "lo", "source": "127.0.0.1", "local": True}
    found = route(own)
    assert found["local"] is True
    assert found["source"] == own
    assert found["ifname"] not in ("", "lo")


def test_the_module_refuses_what_is_not_an_address() -> None:
    args = '{"ANSIBLE_MODULE_ARGS": {"address": "master.example"}}'
    done = subprocess.run(
        [
            sys.executable,
            str(
                ROOT
                / "collections/ansible_collections/llama/cluster/plugins/modules/llama_route.py"
            ),
        ],
        input=args,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1
    assert "'master.example' is not an IP address" in done.stdout


# ---- several processes on one node: /dev/shm, locked memory, P2P (issue 39) -------------------
def ipc(size: int | None = 8192, free: int | None = None, *, memlock: object = "unlimited") -> dict:
    shm = {"path": "/dev/shm", "exists": size is not None, "writable": True, "fstype": "tmpfs"}
    if size is not None:
        shm.update(size_mib=size, free_mib=size if free is None else free)
    return {"shm": shm, "memlock": {"soft": memlock, "hard": memlock}}


def test_dockers_64_mb_of_shm_is_refused_on_a_gpu_node_of_several_processes_naming_the_fix():
    verdict = preflight.preflight_ranks(ipc(64), "gpu1", 8)
    assert not verdict["ok"]
    problem = verdict["problem"]
    assert "gpu1 runs 8 processes but its /dev/shm holds 64 MiB" in problem
    assert "less than the 1024 MiB" in problem
    for fix in ("--shm-size=1g", "--ipc=host", "NCCL_SHM_DISABLE", "preflight_shm_min_mib"):
        assert fix in problem, fix
    assert "/dev/shm 64 MiB (64 MiB free, tmpfs)" in verdict["line"]


@pytest.mark.parametrize(
    ("probe", "nproc", "accelerator", "ok"),
    [
        (ipc(64), 1, "nvidia", True),  # one process: nothing shared
        (ipc(64), 2, "cpu", True),  # gloo over TCP: nothing asked of /dev/shm
        (ipc(2048), 8, "nvidia", True),
        (ipc(None), 2, "nvidia", False),  # no /dev/shm at all
        (ipc(4096, free=100), 4, "nvidia", False),  # others' segments fill it
    ],
)
def test_shared_memory_is_asked_for_only_where_a_nodes_processes_share_it(
    probe: dict, nproc: int, accelerator: str, ok: bool
):
    verdict = preflight.preflight_ranks(probe, "n", nproc, accelerator=accelerator)
    assert verdict["ok"] is ok, verdict


def test_the_minimum_is_a_setting_and_a_cpu_node_is_checked_when_it_is_set():
    assert not preflight.preflight_ranks(ipc(64), "lab1", 2, accelerator="cpu", min_mib=1024)["ok"]
    assert preflight.preflight_ranks(ipc(64), "gpu1", 2, min_mib=32)["ok"]


def test_the_line_says_the_locked_memory_and_the_p2p_decision():
    off = {"nccl_p2p_disable": True, "reason": "GPUs 0 and 1 have no peer access"}
    verdict = preflight.preflight_ranks(ipc(4096, memlock=65536), "gpu1", 2, p2p=off)
    assert verdict["ok"]
    assert "locked memory 64 KiB" in verdict["line"]
    assert (
        "P2P: off, NCCL_P2P_DISABLE=1 for its jobs (GPUs 0 and 1 have no peer access)"
        in (verdict["line"])
    )
    assert "--ulimit memlock=-1" in verdict["warning"]
    on = preflight.preflight_ranks(ipc(4096), "gpu1", 2, p2p={"nccl_p2p_disable": False})
    assert "P2P: on between its GPUs" in on["line"]
    assert on["warning"] == ""
    assert (
        "P2P: not probed (run playbooks/check.yml"
        in preflight.preflight_ranks(ipc(4096), "gpu1", 2)["line"]
    )
    cpu = preflight.preflight_ranks(ipc(64), "lab1", 2, accelerator="cpu")
    assert "P2P: none (a CPU node" in cpu["line"]


def test_the_probe_reads_this_machines_shared_memory():
    done = subprocess.run(
        [sys.executable, str(ROOT / "roles/preflight/files/ipc.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    found = yaml.safe_load(done.stdout)
    assert found["shm"]["path"] == "/dev/shm"
    if found["shm"]["exists"]:
        assert found["shm"]["size_mib"] >= found["shm"]["free_mib"] >= 0
    assert "hard" in found["memlock"]
