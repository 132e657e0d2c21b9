"""The learner's gloo group binds to the interface on the route to MASTER_ADDR (learner/train/distributed.py).
Left to gloo, a node whose hostname does not resolve bound to loopback, and a learner group across two Slurm
nodes failed with "connection refused" (tests/slurm: the two-node learner)."""

import os
import socket

import psutil

from learner.train.distributed import bind_gloo_towards_master
from protocol.net import interface_with


def test_the_interface_holding_an_address():
    assert interface_with("127.0.0.1") == "lo"
    assert interface_with("192.0.2.77") is None  # TEST-NET-1: on no interface here
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and name != "lo":
                assert interface_with(a.address) == name


def test_gloo_binds_towards_the_master(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    # A master on loopback (a lone learner, or every rank on this machine) sets nothing: the variable would be
    # inherited by every process this one starts. The test suite's own in-process learners leaked "lo" into a
    # later Slurm job, whose learner group across two nodes then bound to loopback and failed.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    bind_gloo_towards_master()
    assert "GLOO_SOCKET_IFNAME" not in os.environ

    others = [(n, a.address) for n, addrs in psutil.net_if_addrs().items() for a in addrs if a.family == socket.AF_INET and n != "lo"]
    for name, address in others:  # a master on another interface of this machine: that interface
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
        monkeypatch.setenv("MASTER_ADDR", address)
        bind_gloo_towards_master()
        assert os.environ["GLOO_SOCKET_IFNAME"] == name


def test_a_set_interface_is_kept_and_an_unknown_master_left_to_gloo(monkeypatch):

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    bind_gloo_towards_master()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "::1")  # an IPv6 master: no IPv4 route to ask about
    bind_gloo_towards_master()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
