"""ZeroMQ sockets between actors and the hub, with bounded queues.

One ROUTER socket on the hub, one DEALER per actor: a single connection carries
both directions. Bounds, and how each fails:
- SNDHWM/RCVHWM cap queued messages per peer. At the HWM a DEALER send waits
  (backpressure); a ROUTER with ROUTER_MANDATORY waits too instead of dropping
  silently, and raises EHOSTUNREACH for a peer that is gone.
- MAXMSGSIZE is a hard memory cap: a peer sending a larger frame is disconnected by
  libzmq. Below it, `codec.decode` rejects frames over `max_frame_bytes` with an error reply.
"""

from __future__ import annotations

import typing
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.codec import decode, encode
from protocol.messages import Message

HARD_FRAME_FACTOR = 4  # libzmq drops the connection above this multiple of max_frame_bytes


def _bound(sock: zmq.Socket, hwm: int, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_FACTOR * max_frame_bytes)


def hub_socket(ctx: zmq.asyncio.Context, bind: str, hwm: int, max_frame_bytes: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.ROUTER)
    _bound(sock, hwm, max_frame_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(bind)
    return sock


def actor_socket(ctx: zmq.asyncio.Context, connect: str, hwm: int, max_frame_bytes: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    _bound(sock, hwm, max_frame_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 200)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # exponential backoff while the learner is away
    sock.connect(connect)
    return sock


def client_socket(ctx: zmq.Context, connect: str, max_frame_bytes: int = 16 << 20) -> zmq.Socket:
    """An operator's one-shot client (`fleetrl ctl`, `fleetrl status`): a blocking DEALER to the hub.

    The only place such a socket is made, so authentication keys can be added here.
    No reconnect backoff: the caller waits a bounded time for its reply and gives up.
    """
    sock = ctx.socket(zmq.DEALER)
    _bound(sock, 16, max_frame_bytes)
    sock.connect(connect)
    return sock


def watch_disconnects(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR socket that receives `sock`'s EVENT_DISCONNECTED events (read them with `disconnected_fds`)."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def disconnected_fds(monitor: zmq.Socket) -> list[int]:
    """The fds of the connections closed since the last call (non-blocking; `monitor` is a plain, not asyncio, socket)."""
    fds = []
    while typing.cast(int, monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # EVENTS also processes libzmq's pending commands
        event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        if event["event"] == zmq.EVENT_DISCONNECTED:
            fds.append(int(event["value"]))
    return fds


def peer_fd(frame: zmq.Frame) -> int | None:
    """The fd of the connection a received frame came on (ZMQ_SRCFD: deprecated by libzmq, still served by 4.3)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError):
        return None


async def send(sock: zmq.asyncio.Socket, msg: Message, identity: bytes | None = None) -> None:
    frames: list[Any] = encode(msg)
    if identity is not None:
        frames = [identity, *frames]
    await sock.send_multipart(frames, copy=False)


def decode_frames(frames: list[Any], max_frame_bytes: int) -> Message:
    """Decode received frames (zmq.Frame or bytes). Raises ProtocolError."""
    return decode(frames, max_frame_bytes)
