"""`fleetrl ctl`: change a setting of a running learner over its hub socket.

    fleetrl ctl --learner tcp://HOST:PORT set max_staleness 2

One request, one reply (protocol.messages.ControlRequest / ControlReply). Exit status:
0 applied, 1 refused or no answer (the message says which), 2 usage error.
"""

from __future__ import annotations

import sys

import zmq

from protocol import messages as m
from protocol import transport
from protocol.codec import decode, encode


class NoReply(RuntimeError):
    """The hub did not answer in time: wrong address, learner not running, or not reachable."""


def request(addr: str, msg: m.Message, timeout_s: float = 5.0) -> m.Message:
    """Send one request to the hub at `addr` and return its validated reply (an Error reply included)."""
    ctx = zmq.Context()
    sock = transport.ops_socket(ctx, addr)
    try:
        sock.send_multipart(encode(msg), copy=False)
        # ZeroMQ connects lazily and queues the request, so a missing learner shows up only as silence.
        if not sock.poll(int(timeout_s * 1000)):
            raise NoReply(f"no reply from {addr} in {timeout_s:g} s; is the learner running there (hub.bind)?")
        return decode(sock.recv_multipart(copy=False))
    finally:
        sock.close(linger=0)
        ctx.term()


def set_setting(addr: str, key: str, value: int, timeout_s: float = 5.0) -> m.ControlReply:
    reply = request(addr, m.ControlRequest(command="set", key=key, value=value), timeout_s)
    if isinstance(reply, m.Error):
        raise ValueError(f"the hub rejected the request: {reply.detail}")
    assert isinstance(reply, m.ControlReply), f"unexpected reply {type(reply).__name__}"
    return reply


def run_ctl(addr: str, command: str, key: str, value: int, timeout_s: float) -> int:
    assert command == "set", command  # argparse offers no other
    try:
        reply = set_setting(addr, key, value, timeout_s)
    except (NoReply, ValueError, m.ProtocolError) as e:
        print(f"fleetrl ctl: {e}", file=sys.stderr)
        return 1
    if not reply.ok:
        print(f"fleetrl ctl: refused: {reply.detail} ({key} stays {reply.value})", file=sys.stderr)
        return 1
    print(f"fleetrl ctl: {reply.detail}")
    return 0
