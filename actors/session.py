"""An actor's session with the hub: its connection, registration, heartbeats, requests for work.

    heartbeat(): Register (again with backoff while nothing answers) -> Heartbeat + WorkRequest every hub.heartbeat_s
    messages():  every valid message from the hub (one that fails to decode is logged and skipped)
    losses():    the connection's events: closed while registered -> the learner is lost (yielded: the actor acts
                 on it); a failed CURVE handshake -> its likely cause, logged; a refused client key -> it ends

It holds what the hub and this actor agree on: whether the actor is registered, and the grants it holds. It reads
the version the engine serves (actors/served.py), and calls nothing of the actor's (actors/main.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import zmq
import zmq.asyncio

from actors.served import ServedWeights
from protocol import auth, transport
from protocol import messages as m
from protocol.config import Config

# What the actor hears from its connection's monitor: a closed connection, a failed or completed CURVE handshake.
CONNECTION_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
)


class HubSession:
    def __init__(self, cfg: Config, learner: str, actor_id: str, keys: auth.ClientKeys | None, weights: ServedWeights, log: Any):
        self.cfg, self.learner, self.actor_id, self.weights, self.log = cfg, learner, actor_id, weights, log
        self.keys = keys  # CURVE keys (protocol/auth.py client_keys), or None on loopback
        self.registered = asyncio.Event()
        self.held = 0  # training grants in hand: received, their group neither sent nor given up
        self.handshake_error: str | None = None  # why the last CURVE handshake with the learner failed (auth.handshake_failure)
        self.devices: list[str] = []  # each engine worker's device identity: its weight-group ranks
        self.sock: zmq.asyncio.Socket | None = None

    def connect(self, ctx: zmq.asyncio.Context, devices: list[str]) -> None:
        self.devices = devices
        self.sock = transport.client_socket(
            ctx, self.learner, self.cfg.hub.hwm, self.cfg.hub.max_frame_bytes, self.keys, events=CONNECTION_EVENTS
        )

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)

    async def send(self, msg: m.Message) -> None:
        assert self.sock is not None
        await transport.send(self.sock, msg)

    async def register(self) -> None:
        self.registered.clear()
        await self.send(
            m.Register(
                actor_id=self.actor_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                served_version=self.weights.version,
                devices=self.devices,
            )
        )

    async def accepted(self, ack: m.RegisterAck) -> None:
        if not self.registered.is_set():
            self.registered.set()
            self.log.info("actor.registered", learner_version=ack.policy_version)
            await self.request_work()

    @property
    def is_registered(self) -> bool:
        return self.registered.is_set()

    def lost(self) -> None:
        """The learner is gone, or forgot this actor: register again (heartbeat)."""
        self.registered.clear()

    def granted(self) -> None:
        self.held += 1

    def released(self) -> None:
        """A grant's task ended (done, failed or cancelled): its slot is free."""
        self.held -= 1

    async def request_work(self) -> None:
        """Ask for work while there is room; the request names the actor's whole capacity (the hub subtracts
        what it has granted and not yet received back: requests in flight cannot make it grant twice)."""
        if self.held < self.cfg.actor.max_groups and self.registered.is_set():
            await self.send(m.WorkRequest(actor_id=self.actor_id, max_prompts=self.cfg.actor.max_groups))

    async def heartbeat(self) -> None:
        backoff = 1.0
        await self.register()
        while True:
            try:
                await asyncio.wait_for(self.registered.wait(), timeout=backoff)
            except TimeoutError:
                # A failed handshake is the likely cause; without one nothing answered at that address (a refused client
                # key never gets here: losses() ends and the actor stops).
                why = {"cause": self.handshake_error} if self.handshake_error else {"hint": "is the learner up, at this address?"}
                self.log.warning("actor.waiting_for_learner", learner=self.learner, retry_s=backoff, curve=self.keys is not None, **why)
                backoff = min(backoff * 2, 30.0)
                await self.register()
                continue
            backoff = 1.0
            await self.send(m.Heartbeat(actor_id=self.actor_id, served_version=self.weights.version, groups_in_flight=self.held))
            await self.request_work()
            await asyncio.sleep(self.cfg.hub.heartbeat_s)

    async def messages(self) -> AsyncGenerator[m.Message, None]:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                msg = transport.decode_frames(frames, self.cfg.hub.max_frame_bytes)
            except m.ProtocolError as e:  # count, log, carry on: bad input never kills the actor
                self.log.warning("actor.bad_message", error=str(e))
                continue
            yield msg

    async def losses(self) -> AsyncGenerator[str, None]:
        """Why the learner was lost, each time it is; ends when the learner refuses this actor's key. From the
        connection's one monitor (libzmq allows one per socket):
        - closed: the first sign of a dead learner (a restarted one would answer unknown_actor);
        - key refused: final (libzmq does not retry a refused handshake), so say so and end, for the actor to
          exit non-zero instead of waiting forever;
        - handshake dropped (another server key, most likely): libzmq retries it on every reconnect, so say why
          once here, and again in every actor.waiting_for_learner line until one succeeds."""
        assert self.sock is not None
        async with aclosing(transport.socket_events(self.sock, CONNECTION_EVENTS)) as events:
            async for event in events:
                kind, value = event["event"], int(event["value"])
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.handshake_error = None
                    continue
                cause = auth.handshake_failure(kind, value, client_curve=self.keys is not None)
                if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.log.error(
                        "actor.key_refused",
                        learner=self.learner,
                        status=value,
                        key=self.cfg.auth.client_key,
                        cause=cause,
                        hint="add its public key to the learner's auth.authorized folder (fleetrl keys), then restart this actor",
                    )
                    return
                if cause is not None:
                    if cause != self.handshake_error:
                        self.log.error("actor.handshake_failed", learner=self.learner, server_key=self.cfg.auth.server_key, cause=cause)
                    self.handshake_error = cause
                elif kind == zmq.EVENT_DISCONNECTED and self.registered.is_set():
                    yield "connection closed"
