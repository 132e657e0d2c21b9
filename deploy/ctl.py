"""`fleetrl ctl`: change a setting of a running learner over its hub socket.

    fleetrl ctl --learner tcp://HOST:PORT [--server-key F --client-key F] set max_staleness 2

One request, one reply (protocol.messages.ControlRequest / ControlReply). Exit status:
0 applied, 1 refused or no answer (the message says which), 2 usage error (bad keys included).
A hub with CURVE on admits an operator only with an authorised key, as it does an actor. A refused
handshake (an unlisted --client-key, another learner's --server-key, CURVE on one side only) is a
refusal: exit 1, with the flag to fix (protocol/auth.py handshake_failure).
"""

from __future__ import annotations

import sys
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol import messages as m
from protocol import transport
from protocol.auth import ClientKeys, handshake_failure
from protocol.codec import decode, encode


class NoReply(RuntimeError):
    """The hub did not answer in time: wrong address, learner not running, or not reachable."""


class HandshakeFailed(NoReply):
    """The learner at the address would not talk to this client: its keys, or its lack of them, do not fit."""


def request(addr: str, msg: m.Message, timeout_s: float = 5.0, keys: ClientKeys | None = None) -> m.Message:
    """Send one request to the hub at `addr` and return its validated reply (an Error reply included)."""
    ctx = zmq.Context()
    sock = transport.ops_socket(ctx, addr, keys=keys)
    # A failed CURVE handshake is otherwise indistinguishable from a learner that is not there: its monitor,
    # attached before the socket connected, reports it (transport.ops_socket).
    monitor = sock.get_monitor_socket()
    try:
        frames: list[Any] = encode(msg)  # pyzmq's stubs do not count ndarrays as buffers
        sock.send_multipart(frames, copy=False)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        # ZeroMQ connects lazily and queues the request, so a missing learner shows up only as silence.
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if monitor in ready and sock not in ready:
            # The first failure is the answer: a retry (libzmq retries all but a refused key) meets the same keys.
            event = parse_monitor_message(monitor.recv_multipart())
            on = keys is not None
            cause = handshake_failure(event["event"], int(event["value"]), "--server-key", "--client-key", curve="", client_curve=on)
            assert cause is not None, event  # the monitor hears handshake failures only
            raise HandshakeFailed(f"{addr}: {cause}")
        if sock not in ready:
            raise NoReply(f"no reply from {addr} in {timeout_s:g} s; is the learner running there (hub.bind)?")
        return decode(sock.recv_multipart(copy=False))
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def set_setting(addr: str, key: str, value: int, timeout_s: float = 5.0, keys: ClientKeys | None = None) -> m.ControlReply:
    reply = request(addr, m.ControlRequest(command="set", key=key, value=value), timeout_s, keys)
    if isinstance(reply, m.Error):
        raise ValueError(f"the hub rejected the request: {reply.detail}")
    assert isinstance(reply, m.ControlReply), f"unexpected reply {type(reply).__name__}"
    return reply


def run_ctl(addr: str, command: str, key: str, value: int, timeout_s: float, keys: ClientKeys | None = None) -> int:
    assert command == "set", command  # argparse offers no other
    try:
        reply = set_setting(addr, key, value, timeout_s, keys)
    except (NoReply, ValueError, m.ProtocolError) as e:
        print(f"fleetrl ctl: {e}", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"fleetrl ctl: refused: {reply.detail} ({key} stays {reply.value})", file=sys.stderr)
        return 1
    print(f"fleetrl ctl: {reply.detail}")
    return 0
