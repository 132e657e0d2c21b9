"""Separate network hosts on one machine: Linux network namespaces on a bridge, as a pytest fixture.

    root namespace: bridge <id>br, 10.A.B.254/24
        |-- veth <id>h0 <=> eth0 in namespace fleetrl-<id>-learner   10.A.B.1
        |-- veth <id>h1 <=> eth0 in namespace fleetrl-<id>-actor1    10.A.B.2
        ...

Each namespace has only `lo` and `eth0`, so its processes talk to the others over real
addresses and real TCP stacks, and `Host.cut()` unplugs it (the bridge side of its veth goes
down: packets are lost, no connection is reset, as with a pulled cable). Names and the subnet
are unique per run; processes started with `Host.spawn` are killed (whole process groups) and
every link and namespace is deleted at teardown, whether the test passed or not.

Needs root (CAP_NET_ADMIN) and iproute2; the fixture skips with the reason otherwise.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from deploy import procs

GRACE_S = 15.0  # SIGTERM -> SIGKILL for processes still running at teardown


class NetnsUnavailable(RuntimeError):
    """This machine cannot build namespaces (not root, no iproute2, no CAP_NET_ADMIN)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here, or None."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    return None


@dataclass(kw_only=True, slots=True)
class Host:
    name: str  # role in the test, e.g. "learner"
    netns: str  # namespace name
    addr: str  # its IPv4 address on the bridge
    link: str  # root-side end of its veth: down = unplugged
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside this host's namespace (`ip netns exec` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def spawn(self, cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
        """Start `cmd` in this namespace, in its own process group (so teardown stops its children too)."""
        proc = procs.spawn(self.argv(cmd), env, log, cwd)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd), capture_output=True, text=True, timeout=timeout)

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")


class Network:
    """A bridge and the namespaces on it; `add` builds a host, `teardown` removes everything."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.id = f"fr{os.getpid() % 0xFFFF:04x}{random.randrange(256):02x}"  # interface names: 15 chars at most
        self.subnet = self._free_subnet()
        self.bridge = f"{self.id}br"
        self.hosts: dict[str, Host] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
        except RuntimeError as e:
            raise NetnsUnavailable(str(e)) from e
        try:  # a container may allow links but not namespaces (they need a mount under /run/netns)
            _ip("netns", "add", f"fleetrl-{self.id}-probe")
            _ip("netns", "del", f"fleetrl-{self.id}-probe")
        except RuntimeError as e:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            raise NetnsUnavailable(str(e)) from e
        _ip("addr", "add", f"{self.subnet[254]}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A 10.x.y.0/24 that no interface or route here uses (concurrent runs pick different ones)."""
        used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        for _ in range(100):
            net = ipaddress.IPv4Network(f"10.{random.randrange(200, 250)}.{random.randrange(256)}.0/24")
            if f"10.{net.network_address.packed[1]}.{net.network_address.packed[2]}." not in used:
                return net
        raise NetnsUnavailable("no free 10.x.y.0/24 subnet")

    def add(self, name: str) -> Host:
        index = len(self.hosts)
        assert index < 250, "one /24 per network"
        host = Host(name=name, netns=f"fleetrl-{self.id}-{name}", addr=str(self.subnet[index + 1]), link=f"{self.id}h{index}")
        _ip("netns", "add", host.netns)
        self.hosts[name] = host  # registered before it is complete: teardown removes what exists
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        return host

    def teardown(self) -> None:
        procs.stop([p for h in self.hosts.values() for p in h.procs], GRACE_S)
        for host in self.hosts.values():
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)  # deletes both ends
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def netns():
    """A fresh Network for one test; skipped (with the reason) where namespaces cannot be built."""
    try:
        net = Network()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    try:
        yield net
    finally:
        net.teardown()
