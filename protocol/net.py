"""Small process and network helpers shared by both sides."""

from __future__ import annotations

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


def pin_cpus(cpus: set[int]) -> None:
    """Restrict this process (and the processes it starts later) to `cpus`; empty = leave as is."""
    if cpus:
        os.sched_setaffinity(0, cpus)
