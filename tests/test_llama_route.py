"""plugins/modules/llama_route.py against iproute2 on this machine (the module stands in for it
on nodes that lack it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.llama.cluster.plugins.modules import llama_route

ROOT = Path(__file__).resolve().parents[1]


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
