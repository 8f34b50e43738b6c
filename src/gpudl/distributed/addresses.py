"""Which of this machine's addresses a job over several machines uses, known from the machine itself.

A machine's hostname is a poor guide on the networks jobs run on: containers on one host share
one, and a name may resolve to another network than the job's (or not at all). So the launcher
asks the kernel instead: an endpoint is this machine's when one of its addresses can be bound here,
and this machine's address for the job is the one the kernel would send from to reach the endpoint.
"""

from __future__ import annotations

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_local(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine: it resolves to an address bindable here."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in found:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address[0], 0))
            return True
        except OSError:  # EADDRNOTAVAIL: another machine's
            continue
    return False


def address_towards(host: str, port: int) -> str | None:
    """This machine's IPv4 address on the route to `host` (None where it has none): a UDP socket's
    connect picks the route and sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` (Linux; None elsewhere or if none does)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None
