"""The hub thread: its own uvloop loop, the ROUTER socket behind the CURVE gate, and HubState under the hub's lock.

    actors --frames--> [ROUTER + CURVE gate] --> decode --> HubState.handle --> send what it returns
    once a second: HubState.tick, RUN_DIR/control.toml, the allow-list; before each message: the disconnect monitor
    training thread (learner/hub/server.py) --> kick() (grants may be due) / send(outs) (Shutdown, WeightSync)

Only this thread touches the socket. It shares the HubState with the training thread under `cond` (a
Condition on one lock) and never waits on the network while holding it: it sends what the state returned
after letting the lock go.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import uvloop
import zmq
import zmq.asyncio

from learner.hub.core import control
from learner.hub.core.records import MAX_DETAIL, Out
from learner.hub.core.state import HubState
from learner.hub.gatekeeper import Gatekeeper
from protocol import auth, transport
from protocol import messages as m
from protocol.config import Config, ConfigError
from protocol.logs import Throttle, get_logger

DRAIN = 256  # messages read per poll of the hub's socket
CLOSED_GRACE_S = 5.0  # how long messages of a closed connection are dropped (what it queued before closing)
SEND_TIMEOUT_S = 10.0  # how long a grant or a WeightSync may wait for room in a peer's queue
YIELD_EVERY = 64  # sends in one burst (a WeightSync to every actor) between turns for the socket's reader


class HubThread:
    def __init__(self, cfg: Config, state: HubState, cond: threading.Condition, control_file: Path | None):
        self.cfg, self.state, self.cond = cfg, state, cond
        self.log = get_logger()
        self.stopping = False
        self.control_file = control.ControlFile(control_file) if control_file is not None else None
        # CURVE keys (None: off, loopback only); a missing or bad key file fails here, before anything starts.
        self._keys = auth.server_keys(cfg)
        self._gate: Gatekeeper | None = None
        self._throttles: dict[str, Throttle] = {name: Throttle(1.0) for name in ("bad_message", "send_failed")}
        # Which connection (fd) each routing id last spoke on, so a closed connection names its actor at once.
        self._fd_identity: dict[int, bytes] = {}
        # Connections seen to close -> when. Messages such a connection queued before it closed can still be in the
        # socket; handled after the removal, a queued Register would bring a dead actor back. ROUTER gives each new
        # connection a new routing id, so these are dropped; only for a while (CLOSED_GRACE_S): an fd wrongly
        # named (reused before its close was heard) must not silence the connection that reused it for good.
        self._closed: dict[bytes, float] = {}
        self._monitor: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleetrl-hub", daemon=True)
        self._start_error: BaseException | None = None

    # ---- called from the training thread -----------------------------------------------------------
    def start(self) -> None:
        """Bind and serve; raises (a ConfigError for a bind that failed) once the thread is ready or has given up."""
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def alive(self) -> bool:
        return self._loop is not None and self._thread.is_alive()

    def stop(self) -> None:
        self.stopping = True
        self._thread.join(timeout=10)

    def send(self, outs: list[Out], timeout_s: float) -> None:
        """Deliver `outs` from the hub thread and wait for it; raises TimeoutError after `timeout_s`."""
        assert self._loop is not None, "hub thread not started"
        asyncio.run_coroutine_threadsafe(self._deliver(outs), self._loop).result(timeout=timeout_s)

    def kick(self) -> None:
        """The state changed in a way that may allow grants."""
        if self._loop is not None and not self.stopping:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._pump()))

    def auth_counts(self) -> dict[str, int]:
        """The CURVE gate's counters (none when CURVE is off)."""
        return dict(self._gate.counts) if self._gate is not None else {}

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _pump(self) -> None:
        with self.cond:
            outs = self.state.pump(time.monotonic())
        await self._deliver(outs)

    async def _serve(self) -> None:
        ctx = zmq.asyncio.Context()
        if self._keys is not None:
            self._gate = Gatekeeper(ctx, self._keys)  # the ZAP handler must exist before the socket binds
        try:
            self._sock = transport.hub_socket(ctx, self.cfg.hub.bind, self.cfg.hub.hwm, self.cfg.hub.max_frame_bytes, self._keys)
        except zmq.ZMQError as e:
            self._start_error = ConfigError(
                f"hub.bind {self.cfg.hub.bind}: {e}: choose a free port on an address of this host (tcp://0.0.0.0:PORT binds them all)"
            )
            self._ready.set()
            if self._gate is not None:
                self._gate.stop()
            ctx.term()
            return
        self.log.info("hub.listening", bind=self.cfg.hub.bind, curve=self._keys is not None)
        monitor = transport.watch_disconnects(self._sock)
        self._monitor = zmq.Socket.shadow(monitor.underlying)  # drained synchronously, see _drain_disconnects
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self._ready.set()
        housekeeping = asyncio.ensure_future(self._housekeeping())
        try:
            while not self.stopping:
                ready = dict(await poller.poll(200))
                self._drain_disconnects()
                if self._sock not in ready:
                    continue
                # Read what is queued before polling again: one poll per burst, not per message (under a
                # flood the poll's own overhead was most of the cost). Bounded, so stopping stays prompt.
                for _ in range(DRAIN):
                    try:
                        frames = await self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    await self._on_frames(frames)
        finally:
            housekeeping.cancel()
            self._monitor = None
            self._sock.disable_monitor()
            monitor.close(linger=0)
            self._sock.close(linger=0)
            if self._gate is not None:
                self._gate.stop()
            ctx.term()

    async def _on_frames(self, frames: list) -> None:
        identity, body = frames[0].bytes, frames[1:]
        key = None
        if self._gate is not None:
            key = self._gate.admits(body[0]) if body else None
            if key is None:
                return  # its key was revoked after it connected: dropped unanswered (counted by the gate)
        # Disconnects first: a closed connection's fd can be reused by the very connection this message came on.
        self._drain_disconnects()
        if self._closed and identity in self._closed:
            if time.monotonic() - self._closed[identity] < CLOSED_GRACE_S:
                with self.cond:
                    self.state.counters["from_closed_connections"] += 1  # queued before the close: its actor is gone
                return
            del self._closed[identity]
        fd = transport.peer_fd(frames[0])
        if fd is not None and self._fd_identity.get(fd) != identity:
            self._fd_identity[fd] = identity
        try:
            msg = transport.decode_frames(body, self.cfg.hub.max_frame_bytes)
        except m.ProtocolError as e:
            detail = str(e)[:MAX_DETAIL]
            with self.cond:
                self.state.counters["protocol_errors"] += 1
            if (suppressed := self._throttles["bad_message"].ready()) is not None:
                self.log.warning("hub.bad_message", error=detail, suppressed=suppressed)
            await self._deliver([Out(identity, m.Error(code="protocol", detail=detail))])
            return
        now = time.monotonic()
        with self.cond:
            # Operations (learner/hub/core/control.py): one request, one reply; the client is not an actor.
            if isinstance(msg, m.ControlRequest):
                outs = [
                    Out(identity, control.apply(self.state, msg.key, msg.value, source="fleetrl ctl"), reply=False),
                    *self.state.pump(now),
                ]
            elif isinstance(msg, m.StatusRequest):
                outs = [Out(identity, control.status_reply(self.state, now), reply=False)]
            else:
                outs = self.state.handle(identity, msg, now, key)
            self.cond.notify_all()  # a group buffered or an eval answered: the training thread may be waiting on it
        await self._deliver(outs)

    async def _deliver(self, outs: list[Out]) -> None:
        for i, out in enumerate(outs):
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a send with room never yields: let the socket's reader in during a long burst
            if out.reply:
                await self._reply(out.identity, out.msg)
            else:
                await self._send(out.identity, out.msg)

    async def _send(self, identity: bytes, msg: m.Message) -> bool:
        assert self._sock is not None, "hub socket used before bind"
        try:
            try:  # at once when its queue has room (nearly always): a timed wait costs a task per message
                await transport.send(self._sock, msg, identity, flags=zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: wait for room, a while
                await asyncio.wait_for(transport.send(self._sock, msg, identity), timeout=SEND_TIMEOUT_S)
            return True
        except (zmq.ZMQError, TimeoutError) as e:  # EHOSTUNREACH: the peer is gone
            with self.cond:
                self.state.counters["send_failures"] += 1
            if (suppressed := self._throttles["send_failed"].ready()) is not None:
                self.log.warning("hub.send_failed", msg=type(msg).__name__, error=str(e), suppressed=suppressed)
            return False

    async def _reply(self, identity: bytes, msg: m.Message) -> None:
        """An answer (Error, RegisterAck) that never waits: a peer that sends without reading its replies fills its
        queue (HWM); waiting for room would hold up the hub's loop, and every honest actor with it, for up to
        SEND_TIMEOUT_S. Dropped at the HWM and counted (hub/replies_dropped), never buffered."""
        assert self._sock is not None, "hub socket used before bind"
        try:
            await transport.send(self._sock, msg, identity, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN: its queue is full; EHOSTUNREACH: it is gone
            with self.cond:
                self.state.counters["replies_dropped"] += 1

    def _drain_disconnects(self) -> None:
        """Remove, at once, every actor whose connection closed (a killed process: its kernel closes the socket).

        A link that silently dies closes nothing; the heartbeat timeout catches that. The fd names the
        actor: it is the fd its last message came on (transport.peer_fd). Drained before each message,
        so the event of a closed connection is handled before a new connection on the same fd is heard.
        """
        if self._monitor is None:
            return
        fds = transport.disconnected_fds(self._monitor)
        if not fds:
            return
        now = time.monotonic()
        with self.cond:
            for fd in fds:
                identity = self._fd_identity.pop(fd, None)
                if identity is not None:
                    self._closed = {i: t for i, t in self._closed.items() if now - t < CLOSED_GRACE_S}
                    self._closed[identity] = now
                    self.state.registry.connection_closed(identity)
        self.kick()

    async def _housekeeping(self) -> None:
        """Once a second: expire leases and declare silent actors dead, apply RUN_DIR/control.toml if it changed,
        re-read the CURVE allow-list if it changed."""
        while True:
            await asyncio.sleep(1.0)
            if self._gate is not None:
                self._gate.reload()
            settings = self.control_file.poll() if self.control_file is not None else []
            now = time.monotonic()
            with self.cond:
                self.state.tick(now)
                for key, value in settings:
                    control.apply(self.state, key, value, source=f"file {self.control_file.path}")  # type: ignore[union-attr]
                outs = self.state.pump(now)
            await self._deliver(outs)
