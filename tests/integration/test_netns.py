"""The namespace fixture itself: separate stacks, real addresses, a cut link, and nothing left behind."""

import subprocess
import sys
import time

import pytest
from netns import NetnsUnavailable, Network, netns  # noqa: F401  (netns: the fixture)

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 7000)); s.listen()
print("listening", flush=True)
while True:
    c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()
"""
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=1.5) as c:
        print(c.recv(64).decode())
except OSError as e:
    print("error", type(e).__name__)
"""


def ask(host, addr):
    return host.run([sys.executable, "-c", CLIENT, addr]).stdout.strip()


def test_hosts_talk_over_their_own_addresses_and_a_cut_link_stops_them(netns, tmp_path):  # noqa: F811
    server, client, other = netns.add("server"), netns.add("client"), netns.add("other")
    proc = server.spawn([sys.executable, "-u", "-c", SERVER, server.addr], tmp_path / "server.log")
    deadline = time.monotonic() + 10
    while "listening" not in (tmp_path / "server.log").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
        time.sleep(0.05)
    assert ask(client, server.addr) == client.addr  # the server saw the client's own address
    assert ask(other, server.addr) == other.addr
    assert ask(client, "127.0.0.1").startswith("error")  # loopback is the client's own, not the server's

    client.cut()
    assert ask(client, server.addr) == "error TimeoutError"  # packets lost, nothing refused: a pulled cable
    assert ask(other, server.addr) == other.addr  # the others are unaffected
    client.restore()
    # The first tries may still fail: the failed neighbour (ARP) entry from the cut is retried only on the next
    # packets, and the bridge port can take a moment to forward again. A reconnecting client retries too.
    deadline = time.monotonic() + 15
    while (answer := ask(client, server.addr)) != client.addr and time.monotonic() < deadline:
        time.sleep(0.5)
    assert answer == client.addr


def test_teardown_removes_every_namespace_link_and_process(tmp_path):
    try:
        net = Network()
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces unavailable: {e}")
    try:
        host = net.add("a")
        proc = host.spawn(["sleep", "600"], tmp_path / "sleep.log")
    finally:
        net.teardown()
    assert proc.poll() is not None
    assert host.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert net.bridge not in links and host.link not in links


def test_without_root_or_iproute2_the_fixture_says_why(monkeypatch):
    import netns as mod

    monkeypatch.setattr(mod.os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="need root"):
        Network()
    monkeypatch.setattr(mod.shutil, "which", lambda name: None)
    with pytest.raises(NetnsUnavailable, match="iproute2"):
        Network()
