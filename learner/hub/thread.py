"""The hub thread: a plain loop over zmq_poll, the ROUTER socket behind the CURVE gate, and HubState under the hub's lock.

    actors --frames--> [ROUTER + CURVE gate] --> decode --> HubState.handle --> send what it returns
    once a second: HubState.tick, RUN_DIR/control.toml, the allow-list; before each message: the disconnect monitor
    training thread (learner/hub/server.py) --> kick() (grants may be due) / send(outs) (Shutdown, WeightSync),
        through a queue and a wake-up pipe the loop polls with the socket

Only this thread touches the socket. It shares the HubState with the training thread under `cond` (a
Condition on one lock) and never waits on the network while holding it: it sends what the state returned
after letting the lock go.

Why a plain loop and not asyncio: at 1,000 actors the hub thread's CPU was mostly asyncio's per-message cost
(a Future per receive and per send). zmq_poll is level-triggered, so a message already queued always wakes
the loop; an asyncio socket wakes on edges of ZMQ_FD, and any read or send outside it can take an edge (a
first try at mixing the two lost wake-ups and raised the p99 grant latency to the 200 ms poll timeout).
A send that finds a peer's queue full never blocks the loop: it waits in that peer's own queue (its later
messages behind it, in order) and is retried every few milliseconds until SEND_TIMEOUT_S.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from learner.hub.core import control
from learner.hub.core.records import MAX_DETAIL, Out
from learner.hub.core.state import HubState
from learner.hub.gatekeeper import Gatekeeper
from protocol import auth, transport
from protocol import messages as m
from protocol.codec import encode
from protocol.config import Config, ConfigError
from protocol.logs import Throttle, get_logger

DRAIN = 256  # messages read per turn of the loop (then the training thread's requests and the housekeeping get theirs)
CLOSED_GRACE_S = 5.0  # how long messages of a closed connection are dropped (what it queued before closing)
SEND_TIMEOUT_S = 10.0  # how long a grant or a WeightSync may wait for room in a peer's queue
POLL_MS = 200  # the longest the loop sleeps with nothing to do (the housekeeping keeps its own time)
RETRY_MS = 5  # how often sends waiting for room in a peer's queue are tried again
YIELD_EVERY = 64  # sends of one request (a WeightSync to every actor) between turns for the socket's reader


@dataclass(slots=True)
class Request:
    """Sends the training thread asked for (`HubThread.send`), done once each has left or failed."""

    left: int
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def one_done(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.done.set_result(None)


@dataclass(slots=True)
class Waiting:
    """A send that found its peer's queue full."""

    frames: list[Any]
    what: str  # the message's type, for the log
    deadline: float
    request: Request | None


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
        self._sock: zmq.Socket | None = None
        self._waiting: dict[bytes, deque[Waiting]] = {}  # per peer whose queue was full, in order
        # The training thread's side: requests to send, a kick, and the pipe that wakes the loop for them.
        self._requests: queue.SimpleQueue[tuple[list[Out], Request]] = queue.SimpleQueue()
        self._kicked = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()  # the pipe is closed once (stop), never under a writer
        self._pipe_open = True
        self._running = False
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
        return self._running and self._thread.is_alive()

    def stop(self) -> None:
        self.stopping = True
        self._wake()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            with self._pipe_lock:
                if self._pipe_open:
                    self._pipe_open = False
                    os.close(self._wake_r)
                    os.close(self._wake_w)

    def send(self, outs: list[Out], timeout_s: float) -> None:
        """Deliver `outs` from the hub thread and wait until each has left (or failed); raises TimeoutError after `timeout_s`,
        or at once when the hub thread is not running."""
        if not self.alive:
            raise TimeoutError("the hub thread is not running")
        if not outs:
            return
        request = Request(left=len(outs))
        self._requests.put((outs, request))
        self._wake()
        request.done.result(timeout=timeout_s)

    def kick(self) -> None:
        """The state changed in a way that may allow grants."""
        if self._running and not self.stopping:
            self._kicked = True
            self._wake()

    def auth_counts(self) -> dict[str, int]:
        """The CURVE gate's counters (none when CURVE is off)."""
        return dict(self._gate.counts) if self._gate is not None else {}

    def _wake(self) -> None:
        with self._pipe_lock:
            if not self._pipe_open:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: the loop has wake-ups enough to read
                pass

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            self._serve(ctx)
        except BaseException as e:  # the thread ends here: say why (the training thread sees `alive` go false)
            self.log.error("hub.thread_failed", error=f"{type(e).__name__}: {e}", exc_info=True)
        finally:
            self._running = False
            self._end_requests()
            ctx.term()

    def _end_requests(self) -> None:
        """The loop is over: requests still queued will not be sent; their senders stop waiting now."""
        while not self._requests.empty():
            outs, request = self._requests.get_nowait()
            for out in outs:
                self._send_failed(type(out.msg).__name__, "the hub stopped")
                request.one_done()

    def _serve(self, ctx: zmq.Context) -> None:
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
            return
        self.log.info("hub.listening", bind=self.cfg.hub.bind, curve=self._keys is not None)
        sock = self._sock
        self._monitor = transport.watch_disconnects(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._running = True
        self._ready.set()
        next_tick = time.monotonic() + 1.0
        try:
            while not self.stopping:
                wait_ms = max(0, min(POLL_MS, int((next_tick - time.monotonic()) * 1000)))
                ready = dict(poller.poll(min(wait_ms, RETRY_MS) if self._waiting else wait_ms))
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._drain_disconnects()
                while not self._requests.empty():
                    outs, request = self._requests.get_nowait()
                    self._deliver(outs, request)
                if self._kicked:
                    self._kicked = False
                    self._pump()
                if sock in ready:
                    # Read what is queued before polling again: one poll per burst, not per message. Bounded, so
                    # the training thread's requests and stopping stay prompt under a flood.
                    self._read(DRAIN)
                if self._waiting:
                    self._retry_waiting(time.monotonic())
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + 1.0
                    self._housekeeping()
        finally:
            for peer in list(self._waiting):  # the loop ends: what still waits for room will not leave
                self._fail_waiting(peer, "the hub stopped")
            monitor, self._monitor = self._monitor, None
            sock.disable_monitor()
            monitor.close(linger=0)  # left to the garbage collector, a socket still open holds ctx.term() forever
            sock.close(linger=0)
            if self._gate is not None:
                self._gate.stop()

    def _read(self, most: int) -> None:
        assert self._sock is not None
        for _ in range(most):
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _pump(self) -> None:
        with self.cond:
            outs = self.state.pump(time.monotonic())
        self._deliver(outs)

    def _on_frames(self, frames: list) -> None:
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
            self._deliver([Out(identity, m.Error(code="protocol", detail=detail))])
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
        self._deliver(outs)

    def _deliver(self, outs: list[Out], request: Request | None = None) -> None:
        for i, out in enumerate(outs):
            if request is not None and i and i % YIELD_EVERY == 0:
                self._read(YIELD_EVERY)  # a long burst lets the actors' messages in (what they send goes out at once)
            if out.reply:
                self._reply(out.identity, out.msg)
                if request is not None:
                    request.one_done()
            else:
                self._send(out.identity, out.msg, request)

    def _send(self, identity: bytes, msg: m.Message, request: Request | None) -> None:
        """At once when the peer's queue has room (nearly always); else in its waiting line, behind what waits already."""
        assert self._sock is not None, "hub socket used before bind"
        frames: list[Any] = [identity, *encode(msg)]
        line = self._waiting.get(identity)
        if line is None:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its queue is full: wait for room, a while, without holding up anyone else
                line = self._waiting[identity] = deque()
            except zmq.ZMQError as e:  # EHOSTUNREACH: the peer is gone
                self._send_failed(type(msg).__name__, str(e))
        if line is None:  # it left, or failed
            if request is not None:
                request.one_done()
            return
        line.append(Waiting(frames, type(msg).__name__, time.monotonic() + SEND_TIMEOUT_S, request))

    def _retry_waiting(self, now: float) -> None:
        assert self._sock is not None
        for peer in list(self._waiting):
            line = self._waiting[peer]
            while line:
                head = line[0]
                try:
                    self._sock.send_multipart(head.frames, flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    if now < head.deadline:
                        break  # still no room: the rest of its line waits behind it
                    self._send_failed(head.what, f"no room in the peer's queue for {SEND_TIMEOUT_S:g} s")
                except zmq.ZMQError as e:
                    self._send_failed(head.what, str(e))
                line.popleft()
                if head.request is not None:
                    head.request.one_done()
            if not line:
                del self._waiting[peer]

    def _fail_waiting(self, peer: bytes, why: str) -> None:
        for head in self._waiting.pop(peer, deque()):
            self._send_failed(head.what, why)
            if head.request is not None:
                head.request.one_done()

    def _send_failed(self, what: str, error: str) -> None:
        with self.cond:
            self.state.counters["send_failures"] += 1
        if (suppressed := self._throttles["send_failed"].ready()) is not None:
            self.log.warning("hub.send_failed", msg=what, error=error, suppressed=suppressed)

    def _reply(self, identity: bytes, msg: m.Message) -> None:
        """An answer (Error, RegisterAck) that never waits: a peer that sends without reading its replies fills its
        queue (HWM); waiting for room would hold up its line for up to SEND_TIMEOUT_S. Dropped at the HWM and
        counted (hub/replies_dropped), never buffered."""
        assert self._sock is not None, "hub socket used before bind"
        frames: list[Any] = [identity, *encode(msg)]
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
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
        self._pump()

    def _housekeeping(self) -> None:
        """Once a second: expire leases and declare silent actors dead, apply RUN_DIR/control.toml if it changed,
        re-read the CURVE allow-list if it changed."""
        if self._gate is not None:
            self._gate.reload()
        settings = self.control_file.poll() if self.control_file is not None else []
        now = time.monotonic()
        with self.cond:
            self.state.tick(now)
            for key, value in settings:
                control.apply(self.state, key, value, source=f"file {self.control_file.path}")  # type: ignore[union-attr]
            outs = self.state.pump(now)
        self._deliver(outs)
