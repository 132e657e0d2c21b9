"""Small process and network helpers shared by both sides."""

from __future__ import annotations

import ipaddress
import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def local_addr_towards(host: str, port: int) -> str:
    """This machine's address on the route to host:port (no packet is sent: UDP connect only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def interface_with(addr: str) -> str | None:
    """The name of the network interface that holds the address `addr` (as local_addr_towards gives it), or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def pin_cpus(cpus: set[int]) -> None:
    """Restrict this process (and the processes it starts later) to `cpus`; empty = leave as is."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def host_of(address: str) -> str:
    """'tcp://HOST:PORT' -> HOST (IPv6 brackets removed)."""
    host = address.removeprefix("tcp://").rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(address: str) -> bool:
    """True only for a tcp:// address on a loopback IP or `localhost`; wildcards and other names are not."""
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname or a wildcard ("*"): it may be reachable from elsewhere
        return False
