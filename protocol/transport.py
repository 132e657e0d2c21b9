"""ZeroMQ sockets between actors and the hub, with bounded queues.

One ROUTER socket on the hub, one DEALER per actor: a single connection carries
both directions. Bounds, and how each fails:
- SNDHWM/RCVHWM cap queued messages per peer. At the HWM a DEALER send waits
  (backpressure). A ROUTER with ROUTER_MANDATORY never drops silently: a send to a
  peer whose queue is full fails with EAGAIN (pyzmq's asyncio socket first waits
  until the socket next wakes, which on a quiet socket may be never: callers bound
  the wait), and one to a peer that is gone with EHOSTUNREACH. Answers to peers that
  may never read them go out with NOBLOCK and are dropped at the HWM (the hub's `_reply`).
- MAXMSGSIZE is a hard memory cap: a peer sending a larger frame is disconnected by
  libzmq. Below it, `codec.decode` rejects frames over `max_frame_bytes` with an error reply.
- Receiving never drops: a peer whose messages fill RCVHWM is simply no longer read
  (TCP backpressure), so the hub holds at most HWM messages per connection. libzmq caps
  each frame (MAXMSGSIZE) but not the frames in one message (it delivers a multipart
  message whole): an authorised key holder could still make the hub hold one huge one.

CURVE (protocol/auth.py): with keys, the hub is a CURVE server and asks the ZAP handler
(learner/hub/gatekeeper.py) about every client key; ZAP_ENFORCE_DOMAIN makes a missing handler
refuse everyone instead of admitting everyone. A refused client's handshake fails, so not
one of its messages reaches the hub, and nothing is ever sent to it.
"""

from __future__ import annotations

import typing
from collections.abc import AsyncGenerator
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.auth import HANDSHAKE_FAILED, ClientKeys, ServerKeys
from protocol.codec import decode, encode
from protocol.messages import Message

HARD_FRAME_FACTOR = 4  # libzmq drops the connection above this multiple of max_frame_bytes
ZAP_DOMAIN = b"fleetrl"  # the ZAP domain the hub's socket authenticates in


def _bound(sock: zmq.Socket, hwm: int, max_frame_bytes: int) -> None:
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_FACTOR * max_frame_bytes)


def hub_socket(ctx: zmq.Context, bind: str, hwm: int, max_frame_bytes: int, keys: ServerKeys | None = None) -> zmq.Socket:
    """The hub's ROUTER; with `keys` a CURVE server (start the ZAP handler on `ctx` before this)."""
    sock = ctx.socket(zmq.ROUTER)
    _bound(sock, hwm, max_frame_bytes)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.bind(bind)
    return sock


def client_socket(
    ctx: zmq.asyncio.Context,
    connect: str,
    hwm: int,
    max_frame_bytes: int,
    keys: ClientKeys | None = None,
    kind: int = zmq.DEALER,
    events: int = 0,
) -> zmq.asyncio.Socket:
    """Every socket that dials the hub (actor, ctl, status) is made here; `keys` from `auth.client_keys`.

    `events`: a monitor event mask. The monitor is attached before the socket connects: attached after,
    it can miss the first connection's events, and a refused key is refused once, on the first
    handshake (the actor once sat unaware of its refused key; test_auth caught it). Read the events with
    `socket_events(sock, events)` or `sock.get_monitor_socket()`, both of which return this monitor.
    """
    sock = ctx.socket(kind)
    _bound(sock, hwm, max_frame_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 200)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # exponential backoff while the learner is away
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    if events:
        sock.get_monitor_socket(events)  # pyzmq keeps it: later get_monitor_socket calls return this one
    sock.connect(connect)
    return sock


def ops_socket(ctx: zmq.Context, connect: str, max_frame_bytes: int = 16 << 20, keys: ClientKeys | None = None) -> zmq.Socket:
    """An operator's one-shot client (`fleetrl ctl`, `fleetrl status`): a blocking DEALER to the hub.

    The caller waits a bounded time for its reply and gives up. A failed CURVE handshake (a refused key,
    another learner's server key, CURVE on one side only) would look like silence, so the socket's monitor
    reports it (auth.HANDSHAKE_FAILED, from `sock.get_monitor_socket()`).
    """
    return client_socket(ctx, connect, 16, max_frame_bytes, keys, events=HANDSHAKE_FAILED)  # type: ignore[arg-type, return-value]  # any context


actor_socket = client_socket  # the name existing callers use


async def socket_events(sock: zmq.asyncio.Socket, events: int) -> AsyncGenerator[dict[str, Any], None]:
    """Yield `sock`'s monitor events of the mask `events` (parsed: "event", "value", "endpoint").

    libzmq allows one monitor per socket (a second replaces the first), so a client that must
    hear several kinds of event watches them all here, with one mask. Give the same mask to
    `client_socket(events=...)`: this then reads the monitor attached before the socket connected
    (pyzmq returns the existing monitor), and misses nothing.
    """
    monitor = sock.get_monitor_socket(events)
    try:
        while True:
            yield dict(parse_monitor_message(await monitor.recv_multipart()))
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


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


async def send(sock: zmq.asyncio.Socket, msg: Message, identity: bytes | None = None, flags: int = 0) -> None:
    """`flags=zmq.NOBLOCK`: raise zmq.Again at the peer's HWM instead of waiting."""
    frames: list[Any] = encode(msg)
    if identity is not None:
        frames = [identity, *frames]
    await sock.send_multipart(frames, flags=flags, copy=False)


def decode_frames(frames: list[Any], max_frame_bytes: int) -> Message:
    """Decode received frames (zmq.Frame or bytes). Raises ProtocolError."""
    return decode(frames, max_frame_bytes)
