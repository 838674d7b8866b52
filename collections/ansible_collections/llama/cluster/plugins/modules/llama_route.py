#!/usr/bin/python
"""Ansible module: the interface and source address a node uses to reach an address."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: llama_route
short_description: The interface and source address towards an address, without iproute2
description:
  - Asks the kernel which source address it would use to reach O(address) (a UDP socket's
    connect sends nothing), then names the interface that holds that source address. On the
    node that holds O(address) itself, the address and its own interface are returned.
  - Needs nothing but Python's standard library, so that nodes without iproute2 (minimal images,
    containers) get the same answer as C(ip route get).
options:
  address:
    description: The IPv4 or IPv6 address to reach (the master's cluster address).
    type: str
    required: true
"""

EXAMPLES = r"""
- name: Find the interface this node reaches the master through
  llama.cluster.llama_route:
    address: "{{ hostvars[groups['master'] | first]['cluster_address'] }}"
  register: route
# route.ifname: eth1; route.source: 10.0.0.12
"""

RETURN = r"""
ifname:
  description: The interface the node reaches O(address) through; empty when none holds the source.
  type: str
  returned: always
source:
  description: The node's source address towards O(address).
  type: str
  returned: always
local:
  description: Whether O(address) is one of this node's own addresses.
  type: bool
  returned: always
interfaces:
  description: The names of the node's interfaces (Ansible's own interface facts need iproute2).
  type: list
  elements: str
  returned: always
"""

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def source_address(address: str) -> str:
    """The source address the kernel picks to reach address (no packet is sent)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((address, 9))
        return str(sock.getsockname()[0])


def interface_addresses() -> dict[str, set[str]]:
    """Every interface's addresses: IPv4 by ioctl, IPv6 from /proc/net/if_inet6."""
    found: dict[str, set[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                found.setdefault(name, set())
                continue
            found.setdefault(name, set()).add(socket.inet_ntoa(reply[20:24]))
    inet6 = Path("/proc/net/if_inet6")
    if inet6.exists():
        for line in inet6.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6:
                packed = bytes.fromhex(fields[0])
                found.setdefault(fields[5], set()).add(str(ipaddress.IPv6Address(packed)))
    return found


def route(address: str) -> dict[str, Any]:
    """The interface and source address towards address, whether it is this node's, and the
    node's interfaces."""
    source = source_address(address)
    addresses = interface_addresses()
    owner = {addr: name for name, held in addresses.items() for addr in held}
    wanted = str(ipaddress.ip_address(address))
    names = sorted(addresses)
    if wanted in owner:
        return {"ifname": owner[wanted], "source": wanted, "local": True, "interfaces": names}
    return {"ifname": owner.get(source, ""), "source": source, "local": False, "interfaces": names}


def main() -> None:
    """Run the module."""
    module = AnsibleModule(
        argument_spec={"address": {"type": "str", "required": True}}, supports_check_mode=True
    )
    address = module.params["address"]
    try:
        ipaddress.ip_address(address)
    except ValueError:
        module.fail_json(msg=f"llama_route: {address!r} is not an IP address.")
    try:
        found = route(address)
    except OSError as err:
        module.fail_json(msg=f"llama_route: no route to {address}: {err.strerror or err}.")
    module.exit_json(changed=False, **found)


if __name__ == "__main__":
    main()
