"""The hub on learner rank 0: actor registry, ledger, dispatcher and batch buffer.

    actors --Register/Heartbeat/WorkRequest/RolloutGroup/EvalResult/WeightVersion--> [ROUTER]
                                                                                      |
                    hub thread (own uvloop loop; owns the socket)                     v
        registry ---- dispatcher (admission control) ---- ledger ---- buffer
                  +--- eval round (learner/hub/evaluation.py; outside ledger and admission)
                                                                                      |
    training thread <-- take_batch() (blocks on `cond`) ------------------------------+
                    --> begin_update() / finish_update() / send_weight_sync()
                    --> start_eval() / wait_eval() (blocks on `cond`)

Only the hub thread touches the socket. Both threads share the state below under
`cond` (a Condition on one lock); the training thread never waits on the network
while holding it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop
import zmq
import zmq.asyncio

from learner.data.prompts import PromptSet
from learner.hub import control
from learner.hub import staleness as st
from learner.hub.evaluation import EvalRound
from learner.hub.gatekeeper import Gatekeeper
from learner.hub.ledger import Key, Ledger
from protocol import auth, transport
from protocol import messages as m
from protocol.config import Config, ConfigError
from protocol.logs import Throttle, get_logger

DRAIN = 256  # messages read per poll of the hub's socket
MAX_DETAIL = 300  # characters of an error reply: a decode error may quote the peer's input, which may be huge
CLOSED_GRACE_S = 5.0  # how long messages of a closed connection are dropped (what it queued before closing)


@dataclass(slots=True)
class ActorState:
    identity: bytes  # ZeroMQ routing id of the actor's DEALER
    last_seen: float
    served_version: int
    demand: int = 0  # prompts it may still be granted: its capacity minus `held` when it last asked
    held: set[Key] = field(default_factory=set)
    groups: int = 0  # groups accepted from it
    joined_at: float = 0.0
    first_version: int | None = None  # version_min of its first admissible group (a late joiner's must be current)
    key: str | None = None  # name of the CURVE key that registered it (None: CURVE off); only that key may replace it
    arrivals: deque[float] = field(default_factory=deque)  # accept times, last control.RATE_WINDOW_S (samples/s)
    devices: list[str] = field(default_factory=lambda: [""])  # Register.devices: its weight-group ranks' devices


@dataclass(slots=True)
class Accepted:
    """A rollout group in the buffer, with the ledger key it settles."""

    key: Key
    group: m.RolloutGroup
    arrived: float


class Hub:
    def __init__(self, cfg: Config, prompts: PromptSet, control_file: Path | None = None):
        self.cfg = cfg
        self.prompts = prompts
        self.log = get_logger()
        self.cond = threading.Condition()
        self.ledger = Ledger(len(prompts), cfg.data.epochs, cfg.run.seed)
        self.actors: dict[str, ActorState] = {}
        self.buffer: deque[Accepted] = deque()
        self.version = 0
        self.training = False
        self.max_staleness = cfg.staleness.max_staleness
        self.steps = cfg.train.mini_batches * cfg.train.ppo_epochs  # optimizer steps (versions) per update
        self.eval_round: EvalRound | None = None  # at most one; its grants never count as outstanding
        self.counters: Counter[str] = Counter()
        self.stopping = False
        # Operations (learner/hub/control.py): `fleetrl ctl`, `fleetrl status`, RUN_DIR/control.toml.
        self.started = time.monotonic()
        self.batch_max_staleness = self.max_staleness  # the k the current update's batch was checked with
        self.recent_staleness: deque[int] = deque(maxlen=control.RECENT_GROUPS)  # (u + S - 1) - v of taken groups
        self.times = control.UpdateTimes()
        self.control_file = control.ControlFile(control_file) if control_file is not None else None
        # CURVE keys (None: off, loopback only); a missing or bad key file fails here, before anything starts.
        self._keys = auth.server_keys(cfg)
        self._gate: Gatekeeper | None = None
        self._sender_key: str | None = None  # key name of the message being handled (the hub's loop handles one at a time)
        self._throttles: dict[str, Throttle] = {name: Throttle(1.0) for name in ("bad_message", "send_failed")}
        # Elastic membership: who is told when an actor registers or is removed (the weight sender), and which
        # connection (fd) each routing id last spoke on, so a closed connection names its actor at once.
        self._listeners: list[Callable[[str, bool], None]] = []
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

    # ---- training-thread API -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def stop(self, reason: str = "run finished", tell_actors: bool = True) -> None:
        """Tell every actor to shut down (unless `tell_actors` is False: they wait for a resumed learner), then stop
        the hub thread."""
        if self._loop is None or not self._thread.is_alive():
            return
        try:
            if tell_actors:
                asyncio.run_coroutine_threadsafe(self._shutdown_actors(reason), self._loop).result(timeout=10)
        except TimeoutError:
            self.log.warning("hub.shutdown_timeout")
        self.stopping = True
        self._thread.join(timeout=10)

    def take_batch(self, n: int, timeout_s: float | None = None) -> list[Accepted]:
        """Block until `n` admissible groups are buffered, take the oldest; drop (and requeue) any too stale.

        Groups stay in the buffer, counted as outstanding by admission control, until
        the whole batch is there: taking them one by one would let the dispatcher
        over-grant while the batch fills.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while True:
                stale = [i for i in self.buffer if not st.admissible(self.version, i.group.version_min, self.max_staleness, self.steps)]
                if stale:
                    self.buffer = deque(i for i in self.buffer if st.admissible(self.version, i.group.version_min, self.max_staleness, self.steps))
                    for item in stale:
                        self._drop_stale(item)
                if len(self.buffer) >= n:
                    # Oldest versions first (stable in arrival order): they are the ones that would
                    # expire at the next update. Arrival order alone drops late, older groups.
                    batch = sorted(self.buffer, key=lambda i: i.group.version_min)[:n]
                    taken = {id(i) for i in batch}
                    self.buffer = deque(i for i in self.buffer if id(i) not in taken)
                    # A top-up take (learner/hub/intake.py) joins an update already being assembled: its groups
                    # passed an earlier take's k, so the update's bound is the largest k of its takes.
                    k = self.max_staleness
                    self.batch_max_staleness = max(self.batch_max_staleness, k) if self.training else k
                    self.recent_staleness.extend(self.version + self.steps - 1 - i.group.version_min for i in batch)
                    self.training = True
                    return batch
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"only {len(self.buffer)} of {n} groups arrived in {timeout_s} s")
                self.cond.wait(timeout=remaining)

    def finish_update(self, version: int, trained: list[Key]) -> None:
        """The update that consumed `trained` produced `version`; grants may resume."""
        with self.cond:
            for key in trained:
                self.ledger.trained(key)
            self.version = version
            self.training = False
        self._kick()

    def abort_update(self, batch: list[Accepted]) -> None:
        """A failed update returns its prompts to the queue (never silently lost)."""
        with self.cond:
            for item in batch:
                self.ledger.requeue(item.key, "aborted")
            self.training = False
        self._kick()

    def start_eval(self, rnd: EvalRound) -> None:
        """Hand an eval round to the dispatcher: actors serving rnd.version get its prompts."""
        with self.cond:
            assert self.eval_round is None, "one eval round at a time"
            self.eval_round = rnd
        self._kick()

    def wait_eval(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> EvalRound:
        """Block until the round is answered, `timeout_s` passes or `should_stop()`; then close it.

        Results that arrive after this are counted (hub/eval_late) and ignored.
        """
        deadline = time.monotonic() + timeout_s
        with self.cond:
            rnd = self.eval_round
            assert rnd is not None, "wait_eval without start_eval"
            while not rnd.done and not should_stop() and (remaining := deadline - time.monotonic()) > 0:
                self.cond.wait(timeout=min(1.0, remaining))
            self.eval_round = None
        return rnd

    def set_max_staleness(self, k: int, source: str = "api") -> int:
        """Takes effect for admission at once and for every batch taken after it (learner/hub/control.py); returns the old k."""
        if k < self.steps - 1:
            raise ValueError(f"max_staleness: {k} < {self.steps} optimizer steps per update - 1; even fresh samples would break it")
        with self.cond:
            old, self.max_staleness = self.max_staleness, k
            version = self.version
        self.log.info("hub.max_staleness_changed", old=old, new=k, version=version, source=source)
        self._kick()
        return old

    def note_update(self, step_s: float, sync_started: float, sync_s: float, broadcast_s: float | None) -> None:
        """The training thread's timings of the update it just finished, for `fleetrl status`.

        `sync_started` is time.monotonic() at the start of the weight sync; `broadcast_s` the duration
        of the last finished broadcast, None when the sync reported none.
        """
        with self.cond:
            t = self.times
            t.updates, t.step_s, t.syncs, t.sync_started, t.sync_s = t.updates + 1, step_s, t.syncs + 1, sync_started, sync_s
            if broadcast_s is not None:
                t.broadcast_s = broadcast_s

    def live_actors(self) -> list[str]:
        with self.cond:
            return sorted(self.actors)

    def add_membership_listener(self, fn: Callable[[str, bool], None]) -> None:
        """`fn(actor_id, joined)` runs on the hub thread, under the hub's lock, each time an actor registers
        (joined, also again under the same id) or is removed (dead, disconnected, evicted): keep it short."""
        with self.cond:
            self._listeners.append(fn)

    def evict(self, actor_id: str, why: str) -> None:
        """Remove a live actor (its grants go back to the queue). The weight sender evicts a member that never
        joined its group epoch; the actor hears `unknown_actor` on its next message and registers again."""
        with self.cond:
            if actor_id not in self.actors:
                return
            self._release(actor_id, why)
            self.counters["actors_evicted"] += 1
        self._kick()

    def devices(self, actor_ids: list[str]) -> list[list[str]]:
        """Each actor's device identities as it registered them, one per weight-group rank it holds. An actor
        removed meanwhile counts as one CPU rank: the sender gives up any attempt it is part of anyway."""
        with self.cond:
            return [list(s.devices) if (s := self.actors.get(a)) is not None else [""] for a in actor_ids]

    def send_weight_sync(self, members: list[str], make: Callable[[str], m.WeightSync]) -> None:
        """Send `make(actor_id)` (a WeightSync, its ranks chosen by the sender) to each member."""
        assert self._loop is not None

        async def send_all() -> None:
            for actor_id in members:
                state = self.actors.get(actor_id)
                if state is not None:
                    await self._send(state.identity, make(actor_id))

        asyncio.run_coroutine_threadsafe(send_all(), self._loop).result(timeout=30)

    def snapshot(self) -> dict[str, float]:
        """Counters for the metrics line."""
        with self.cond:
            out = {f"hub/{k}": float(v) for k, v in self.counters.items()}
            out.update({f"ledger/{k}": float(v) for k, v in self.ledger.counts.items()})
            out.update({f"ledger/{k}": float(v) for k, v in self.ledger.state_counts().items()})
            if self._gate is not None:
                out.update({f"hub/{k}": float(v) for k, v in self._gate.counts.items()})
            out["hub/actors"] = float(len(self.actors))
            out["hub/buffered"] = float(len(self.buffer))
            out["staleness/max_staleness"] = float(self.max_staleness)
        return out

    # ---- hub thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    def _kick(self) -> None:
        if self._loop is not None and not self.stopping:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._pump()))

    async def _serve(self) -> None:
        ctx = zmq.asyncio.Context()
        if self._keys is not None:
            self._gate = Gatekeeper(ctx, self._keys)  # the ZAP handler must exist before the socket binds
        try:
            self._sock = transport.hub_socket(ctx, self.cfg.hub.bind, self.cfg.hub.hwm, self.cfg.hub.max_frame_bytes, self._keys)
        except zmq.ZMQError as e:
            self._start_error = ConfigError(f"hub.bind {self.cfg.hub.bind}: {e}: choose a free port on an address of this "
                                            "host (tcp://0.0.0.0:PORT binds them all)")
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
        if self._gate is not None:
            self._sender_key = self._gate.admits(body[0]) if body else None
            if self._sender_key is None:
                return  # its key was revoked after it connected: dropped unanswered (counted by the gate)
        # Disconnects first: a closed connection's fd can be reused by the very connection this message came on.
        self._drain_disconnects()
        if self._closed and identity in self._closed:
            if time.monotonic() - self._closed[identity] < CLOSED_GRACE_S:
                self.counters["from_closed_connections"] += 1  # queued before the close: its actor is gone
                return
            del self._closed[identity]
        fd = transport.peer_fd(frames[0])
        if fd is not None and self._fd_identity.get(fd) != identity:
            self._fd_identity[fd] = identity
        try:
            msg = transport.decode_frames(body, self.cfg.hub.max_frame_bytes)
        except m.ProtocolError as e:
            self.counters["protocol_errors"] += 1
            detail = str(e)[:MAX_DETAIL]
            if (suppressed := self._throttles["bad_message"].ready()) is not None:
                self.log.warning("hub.bad_message", error=detail, suppressed=suppressed)
            await self._reply(identity, m.Error(code="protocol", detail=detail))
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.counters["protocol_errors"] += 1
            await self._reply(identity, m.Error(code="protocol", detail=f"{type(msg).__name__} is not for the hub"))
            return
        await handler(self, identity, msg)

    async def _send(self, identity: bytes, msg: m.Message) -> bool:
        assert self._sock is not None, "hub socket used before bind"
        try:
            await asyncio.wait_for(transport.send(self._sock, msg, identity), timeout=10)
            return True
        except (zmq.ZMQError, TimeoutError) as e:  # EHOSTUNREACH: the peer is gone
            self.counters["send_failures"] += 1
            if (suppressed := self._throttles["send_failed"].ready()) is not None:
                self.log.warning("hub.send_failed", msg=type(msg).__name__, error=str(e), suppressed=suppressed)
            return False

    async def _reply(self, identity: bytes, msg: m.Message) -> None:
        """An answer (Error, RegisterAck) that never waits: a peer that sends without reading its replies
        fills its queue (HWM); waiting for room would hold up the hub's loop, and every honest actor with it,
        for up to `_send`'s 10 s. Dropped at the HWM and counted (hub/replies_dropped), never buffered."""
        assert self._sock is not None, "hub socket used before bind"
        try:
            await transport.send(self._sock, msg, identity, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # EAGAIN: its queue is full; EHOSTUNREACH: it is gone
            self.counters["replies_dropped"] += 1

    def _known(self, actor_id: str, identity: bytes) -> ActorState | None:
        state = self.actors.get(actor_id)
        if state is None or state.identity != identity:
            return None
        state.last_seen = time.monotonic()
        return state

    async def _on_register(self, identity: bytes, msg: m.Register) -> None:
        key = self._sender_key
        with self.cond:
            old = self.actors.get(msg.actor_id)
            if old is not None and old.key != key:  # only the key that registered an id may take it over
                self.counters["register_wrong_key"] += 1
                owner = old.key
            else:
                owner = None
        if owner is not None:
            self.log.warning("hub.register_refused", actor=msg.actor_id, key=key, owner=owner)
            await self._reply(identity, m.Error(code="id_taken", detail=f"actor id {msg.actor_id!r} is registered with "
                                                f"another key; pick another id (fleetrl actor --id)"[:MAX_DETAIL]))
            return
        with self.cond:
            old = self.actors.get(msg.actor_id)
            # A retry from the same connection (queued retries arrive together when a learner comes back). But -1
            # from an actor this hub saw serving a version is a rejoin: its sync failed and its worker left the
            # weight group, which must re-form, so it counts as new.
            repeat = old is not None and old.identity == identity and (msg.served_version >= 0 or old.served_version < 0)
            if old is not None and repeat:
                old.last_seen = time.monotonic()
            else:
                if old is not None:  # same id, new connection (the old one is gone), or a rejoin
                    self._release(msg.actor_id, "replaced by a new connection" if old.identity != identity else "rejoined (served -1)")
                # One actor per connection: a peer cycling through ids cannot grow the registry (or the weight
                # group, whose every member must answer) without bound.
                for other in [a for a, s in self.actors.items() if s.identity == identity]:
                    self._release(other, f"its connection registered again as {msg.actor_id!r}")
                    self.counters["reregistered"] += 1
                now = time.monotonic()
                self.actors[msg.actor_id] = ActorState(identity, now, self._trusted(msg.served_version), joined_at=now, key=key,
                                                       devices=list(msg.devices))
                for fn in self._listeners:
                    fn(msg.actor_id, True)
            version = self.version
        if not repeat:
            self.log.info("hub.actor_registered", actor=msg.actor_id, host=msg.host, pid=msg.pid, served=msg.served_version,
                          ranks=len(msg.devices))
        await self._reply(identity, m.RegisterAck(actor_id=msg.actor_id, policy_version=version, heartbeat_s=self.cfg.hub.heartbeat_s))

    async def _unknown(self, identity: bytes, actor_id: str) -> None:
        self.counters["unknown_actor"] += 1
        await self._reply(identity, m.Error(code="unknown_actor", detail=f"actor {actor_id!r} is not registered; register again"[:MAX_DETAIL]))

    async def _served(self, identity: bytes, actor_id: str, served_version: int) -> bool:
        """Record the version an actor serves (max: a heartbeat sent before a sync may arrive after it)."""
        with self.cond:
            state = self._known(actor_id, identity)
            if state is not None:
                state.served_version = max(state.served_version, self._trusted(served_version))
        if state is None:
            await self._unknown(identity, actor_id)
        return state is not None

    async def _on_heartbeat(self, identity: bytes, msg: m.Heartbeat) -> None:
        await self._served(identity, msg.actor_id, msg.served_version)

    async def _on_work_request(self, identity: bytes, msg: m.WorkRequest) -> None:
        with self.cond:
            state = self._known(msg.actor_id, identity)
            if state is not None:
                state.demand = max(0, msg.max_prompts - len(state.held))  # a capacity (protocol 3), not more room
        if state is None:
            await self._unknown(identity, msg.actor_id)
            return
        await self._pump()

    async def _on_weight_version(self, identity: bytes, msg: m.WeightVersion) -> None:
        if await self._served(identity, msg.actor_id, msg.served_version):
            self.log.debug("hub.actor_synced", actor=msg.actor_id, served=msg.served_version, load_s=round(msg.load_s, 4))
            await self._pump()

    async def _on_rollout(self, identity: bytes, msg: m.RolloutGroup) -> None:
        key = (msg.epoch, msg.prompt_id)
        n, expected = msg.lengths.shape[0], self.cfg.rollout.samples_per_prompt
        first: tuple[int, float] | None = None  # (learner version, seconds since it registered) at its first accepted group
        with self.cond:
            state = self._known(msg.actor_id, identity)
            ahead = msg.version_min > self.version  # weights this learner never had (a lost learner's)
            if state is not None and ahead:
                self.counters["rejected_ahead"] += 1
                self._take_back(state, msg.actor_id, key)
            elif state is not None and n == expected:
                state.held.discard(key)
                if self.ledger.receive(key):
                    state.groups += 1
                    item = Accepted(key, msg, time.monotonic())
                    control.note_arrival(state, item.arrived)
                    if st.admissible(self.version, msg.version_min, self.max_staleness, self.steps):
                        self.buffer.append(item)
                        self.cond.notify_all()
                        if state.first_version is None:  # its first group that can be trained
                            state.first_version = msg.version_min
                            first = (self.version, time.monotonic() - state.joined_at)
                    else:  # already too stale on arrival: versions only grow, it can never be used
                        self._drop_stale(item)
            elif state is not None:
                self.counters["bad_group_size"] += 1
                self._take_back(state, msg.actor_id, key)
        if state is not None and n == expected:
            self.log.debug("hub.group_received", actor=msg.actor_id, key=key, version=msg.version_min)
        if first is not None:  # a joining actor's first trainable group: its version must be one it was sent
            self.log.info("hub.actor_first_group", actor=msg.actor_id, version=msg.version_min, learner_version=first[0],
                          after_s=round(first[1], 3))
        if state is None:
            await self._unknown(identity, msg.actor_id)
        elif ahead:
            await self._reply(identity, m.Error(code="rejected", detail=f"group of version {msg.version_min} is newer than the learner's {self.version}"))
        elif n != expected:
            await self._reply(identity, m.Error(code="rejected", detail=f"group has {n} samples, expected {expected}"))
        await self._pump()

    async def _on_eval_result(self, identity: bytes, msg: m.EvalResult) -> None:
        why = None
        with self.cond:
            state = self._known(msg.actor_id, identity)
            rnd = self.eval_round
            if state is not None and rnd is not None and msg.eval_round == rnd.round_id:
                why = rnd.receive(msg)
                if rnd.done:
                    self.cond.notify_all()
            elif state is not None:
                self.counters["eval_late"] += 1  # its round already ended (timeout)
        if state is None:
            await self._unknown(identity, msg.actor_id)
        elif why is not None:
            self.log.warning("hub.eval_result_rejected", actor=msg.actor_id, why=why)
            await self._reply(identity, m.Error(code="rejected", detail=why[:MAX_DETAIL]))
        await self._pump()

    # ---- operations (learner/hub/control.py): one request, one reply; the client is not an actor ----
    async def _on_control(self, identity: bytes, msg: m.ControlRequest) -> None:
        await self._send(identity, control.apply(self, msg.key, msg.value, source="fleetrl ctl"))

    async def _on_status(self, identity: bytes, msg: m.StatusRequest) -> None:
        await self._send(identity, control.status_reply(self))

    _handlers: dict[type, Callable[[Hub, bytes, Any], Awaitable[None]]] = {
        m.Register: _on_register,
        m.Heartbeat: _on_heartbeat,
        m.WorkRequest: _on_work_request,
        m.RolloutGroup: _on_rollout,
        m.EvalResult: _on_eval_result,
        m.WeightVersion: _on_weight_version,
        m.ControlRequest: _on_control,
        m.StatusRequest: _on_status,
    }

    def _trusted(self, served_version: int) -> int:
        """Caller holds the lock. A version above the learner's comes from weights of a learner that died after
        its last checkpoint (the resumed one retrains those versions differently): it counts as none (-1)."""
        if served_version > self.version:
            self.counters["served_ahead"] += 1
            return -1
        return served_version

    def _drop_stale(self, item: Accepted) -> None:
        """Caller holds the lock. The sample may never be trained on; its prompt goes back to the queue."""
        self.counters["dropped_stale"] += 1
        self.log.debug("hub.dropped_stale", key=item.key, sample_version=item.group.version_min, learner_version=self.version, k=self.max_staleness)
        self.ledger.requeue(item.key, "stale")

    def _outstanding(self) -> int:
        return sum(len(a.held) for a in self.actors.values()) + len(self.buffer)

    async def _pump(self) -> None:
        """Grant prompts to actors with demand, as far as admission control allows."""
        sends: list[tuple[bytes, m.WorkGrant]] = []
        granted: list[tuple[str, int, int]] = []  # (actor, epoch, prompt id)
        with self.cond:
            evals = self._eval_grants()  # sent first: the learner is waiting on them
            capacity = st.admission_capacity(self.version, self.training, self.max_staleness, self.cfg.train.prompts_per_step, self._outstanding(), self.steps)
            min_version = st.min_grant_version(self.version)
            deadline = time.monotonic() + self.cfg.staleness.lease_s
            # Fairness: least-loaded actors first.
            for actor_id, state in sorted(self.actors.items(), key=lambda kv: len(kv[1].held)):
                if state.served_version < min_version:
                    continue  # it would generate samples already too stale (or it awaits its first sync)
                while state.demand > 0 and capacity > 0:
                    key = self.ledger.next_pending()
                    if key is None:
                        break
                    self.ledger.grant(key, actor_id, deadline)
                    state.held.add(key)
                    granted.append((actor_id, *key))
                    state.demand -= 1
                    capacity -= 1
                    prompt = self.prompts[key[1]]
                    sends.append((state.identity, m.WorkGrant(
                        prompt_id=key[1], epoch=key[0], prompt_tokens=prompt.tokens, answer=prompt.answer,
                        policy_version=min_version, lease_s=self.cfg.staleness.lease_s, prompt=prompt.text,
                        metadata=prompt.metadata)))
            self.counters["granted"] += len(sends)
        if granted:  # debug: lets an operator (and the multi-host test) follow which actor holds which prompt
            self.log.debug("hub.granted", grants=granted)
        for identity, grant in [*evals, *sends]:
            await self._send(identity, grant)

    def _eval_grants(self) -> list[tuple[bytes, m.EvalGrant]]:
        """Caller holds the lock: prompts of the open eval round for the actors serving exactly its version."""
        rnd = self.eval_round
        if rnd is None:
            return []
        ready = [a for a, s in self.actors.items() if s.served_version == rnd.version]
        out = [(self.actors[a].identity, grant) for a, grant in rnd.assign(ready, self.cfg.actor.max_groups, time.monotonic())]
        self.counters["eval_granted"] += len(out)
        return out

    def _take_back(self, state: ActorState, actor_id: str, key: Key) -> None:
        """Caller holds the lock: a rejected group's prompt goes back to the queue now, not at its lease's end,
        and frees the actor's slot (its requests are capacities)."""
        if key in state.held and self.ledger.entries[key].actor == actor_id:
            state.held.discard(key)
            self.ledger.requeue(key, "rejected")

    def _release(self, actor_id: str, why: str) -> None:
        """Caller holds the lock: forget an actor and requeue what it held."""
        state = self.actors.pop(actor_id)
        if self.eval_round is not None:
            self.eval_round.release_actor(actor_id)
        requeued = [key for key in state.held if self.ledger.entries[key].actor == actor_id]
        for key in requeued:
            self.ledger.requeue(key, "dead")
        for fn in self._listeners:
            fn(actor_id, False)
        self.log.warning("hub.actor_removed", actor=actor_id, why=why, requeued=len(requeued), keys=sorted(requeued))

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
        with self.cond:
            for fd in fds:
                identity = self._fd_identity.pop(fd, None)
                if identity is not None:
                    now = time.monotonic()
                    self._closed = {i: t for i, t in self._closed.items() if now - t < CLOSED_GRACE_S}
                    self._closed[identity] = now
                for actor_id in [a for a, state in self.actors.items() if state.identity == identity]:
                    self._release(actor_id, "connection closed")
                    self.counters["actors_lost"] += 1  # every death; this one seen at once, not after actor_timeout_s
                    self.counters["actors_disconnected"] += 1
        self._kick()

    async def _housekeeping(self) -> None:
        """Expire leases and declare silent actors dead, once a second; re-read the CURVE allow-list if it changed."""
        while True:
            await asyncio.sleep(1.0)
            if self._gate is not None:
                self._gate.reload()
            now = time.monotonic()
            with self.cond:
                for actor_id in [a for a, s in self.actors.items() if now - s.last_seen > self.cfg.hub.actor_timeout_s]:
                    self._release(actor_id, "heartbeat timeout")
                    self.counters["actors_lost"] += 1
                expired = self.ledger.expire(now)
                if self.eval_round is not None:
                    self.eval_round.expire(now)
                for key in expired:
                    for state in self.actors.values():
                        state.held.discard(key)
            if expired:
                self.log.warning("hub.leases_expired", count=len(expired))
            if self.control_file is not None:
                self.control_file.poll(self)
            await self._pump()

    async def _shutdown_actors(self, reason: str) -> None:
        for state in list(self.actors.values()):
            await self._send(state.identity, m.Shutdown(reason=reason))

    # ---- learner restart (learner/resume.py) ------------------------------------------------------
    def export_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the hub: the ledger, the counters, the bound in force."""
        with self.cond:
            return {"ledger": self.ledger.state_dict(), "counters": dict(self.counters), "max_staleness": self.max_staleness}

    def restore(self, state: dict[str, Any], version: int) -> None:
        """Before start(): continue from a checkpoint taken at `version`."""
        assert not self._thread.is_alive(), "restore before the hub starts"
        ledger = Ledger.from_state(state["ledger"], self.cfg.data.epochs)
        if ledger.num_prompts != len(self.prompts):
            raise ValueError(f"data: the checkpoint's ledger has {ledger.num_prompts} prompts, the prompt set now has "
                             f"{len(self.prompts)}; resume with the same data (data.path, data.val_fraction, run.seed)")
        k = state["max_staleness"]  # the bound in force when the checkpoint was taken (it may have been changed live)
        if k < self.steps - 1:
            raise ValueError(f"max_staleness: the checkpoint's {k} < {self.steps} optimizer steps per update - 1")
        if k != self.max_staleness:
            self.log.info("hub.max_staleness_restored", config=self.max_staleness, checkpoint=k)
        with self.cond:
            self.ledger, self.version, self.max_staleness, self.batch_max_staleness = ledger, version, k, k
            self.counters = Counter(state["counters"])
