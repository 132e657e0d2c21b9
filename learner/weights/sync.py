"""Learner rank 0's side of the weight group: serve each version to every live actor, through joins and deaths.

    sync(v) ----> serving thread for v (lives while the parameters hold v) -----------------------+
                    attempt: live actors that lack v (regular members first, those on probation    |
                    after) -> their group epoch (the last group if it is exactly them, else a new  |
                    one) -> WeightSync to each -> joins (weights.join_timeout_s) -> buckets        |
                    ok: they hold v.  failed: give the epoch up, retry with whoever is still live  |
                    then sleep until an actor registers (it gets v now), one is removed, or stop   |
    next sync(v') / the optimizer step (guard) -> stop: an attempt in flight finishes first ------+

Elastic membership. Each membership is a numbered group epoch with its own store prefix; a
newcomer is sent the current version at once, in an epoch of its own (the others keep serving),
and once it has joined one, the next sync forms an epoch of everyone. A member that dies is
removed by the hub (its connection closed: at once; silent: after hub.actor_timeout_s), which
tells this sender; an attempt it was part of is given up (store key `abort`, so the other members
stop waiting too, protocol/abortable.py) and retried without it. Joining a new epoch has a deadline
of its own, weights.join_timeout_s: a member that has not set its joined key by then is evicted
from the hub and the epoch re-formed at once without it; learner/weights/membership.py keeps
newcomers and members that failed a join out of the sync's own epoch until they have joined one,
so such a member holds the training up once at most (tests/integration/test_weight_join.py). Nothing waits
inside gloo, so neither the learner nor the survivors wait for a dead member's timeout
(tests/integration/test_weight_death.py).

Where the bytes come from (see learner/weights/buckets.py):
- ZeRO-3 (parameters sharded over the learner ranks): `sync` is given a `snapshot` that
  gathers each bucket on every rank and copies it out on rank 0 (Trainer.snapshot).
- ZeRO-0/1/2 (rank 0 holds every parameter), unguarded: `sync` copies every bucket on the
  learner thread (one memcpy each when the parameters are DeepSpeed's flat buffer).
- After `guard(optimizer)`: the optimizer's step first stops the serving thread (and waits for
  the attempt in flight), so every attempt reads the parameters in place: no copy, and `sync`
  holds nothing up. A catch-up for a newcomer can therefore only start while no step runs.
Either way the serving thread only ever sends version v: the copies are of v, and the guard
keeps the parameters at v while it runs.

On GPUs every one of those buffers is on the learner's GPU and NCCL sends from there
(protocol/weights.py picks the backend per epoch from the devices the members registered).
The serving thread queues its GPU work on a stream of its own, after an event recorded on the
training thread's stream at `sync` (the snapshot's and the optimizer's writes come first), so
training kernels never queue behind a broadcast. An epoch that falls back to gloo (a member
shares the learner's GPU) copies each bucket to pinned host memory first.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from learner.hub.server import Hub
from learner.weights.buckets import Buckets, Staging
from learner.weights.membership import Membership
from protocol import messages as m
from protocol import weights as wg
from protocol.abortable import Abortable, Aborted, Graveyard, abort_key, joined_key
from protocol.config import WeightsConfig
from protocol.logs import get_logger
from protocol.progress import phase

Snapshot = Callable[[list[torch.Tensor] | None], list[torch.Tensor] | None]
POLL_S = 0.02  # how often a long wait re-checks for a removed member: the latency of an abort
JOIN_POLL_S = 0.005  # how often rank 0 looks for the members' joined keys
RETRY_S, RETRY_MAX_S = 0.2, 10.0  # backoff after a failure that no removal explains (yet)


def _backoff(failures: int) -> float:
    """When to try again after `failures` failures in a row that no removal explains (monotonic clock)."""
    return time.monotonic() + min(RETRY_MAX_S, RETRY_S * 2 ** (failures - 1))


@dataclass(kw_only=True, slots=True)
class Attempt:
    """One try at giving `version` to `members` in group epoch `epoch`."""

    version: int
    epoch: int
    members: list[str]  # member k holds ranks plan.first[k] .. plan.first[k] + plan.counts[k] - 1
    plan: wg.GroupPlan  # backend, world size, ranks
    new_group: bool  # the epoch is new: members join before the broadcast
    gens: dict[str, int]  # each member's registration count when the attempt began (a re-registered one lacks v)
    catchup: bool = False  # not the sync's own attempt: a stop (the optimizer step) gives it up instead of waiting for it
    joins_by: float = 0.0  # new epoch: when every member must have joined (monotonic clock; WeightSyncs sent + join_timeout_s)
    # Members on probation (learner/weights/membership.py): their epoch's group is used for this attempt only, and
    # the sender's group (the everyone epoch, reused by the next sync) is kept meanwhile.
    side: bool = False
    side_group: dist.ProcessGroup | None = None
    # Its failure repeats what an earlier attempt of the same members' registrations logged: cut short again before
    # they joined, or at the deadline that evicts them (hub.actor_removed counts the attempts). Logged at debug.
    repeat: bool = False


@dataclass(kw_only=True, slots=True)
class Joining:
    """A member's join in one registration, across attempts cut short (WeightSender._join_by)."""

    by: float  # when it must have joined (monotonic clock): the first attempt's deadline
    attempts: int = 0  # how many attempts it has been sent so far


@dataclass(kw_only=True, slots=True)
class Serving:
    """What serving one version took, reported by the next `wait`."""

    version: int
    broadcast_s: float | None = None  # the first complete attempt (normally the sync's own)
    failed: int = 0  # attempts given up
    catchups: int = 0  # complete attempts after the first: newcomers, and survivors of a failed one
    epochs: list[int] = field(default_factory=list)


class WeightSender:
    def __init__(
        self,
        cfg: WeightsConfig,
        names: list[str],
        shapes: list[list[int]],
        dtype: str,
        params: list[torch.Tensor] | None = None,
        device: torch.device | None = None,
    ):
        """`params`: the full parameters when rank 0 holds them (ZeRO <= 2); None under ZeRO-3 (sync gets a snapshot).
        `device`: the learner's own device, where the snapshots are (default: the parameters', else the CPU)."""
        self.cfg = cfg
        self.names = names
        self.shapes = shapes  # full (unsharded) shapes
        self.dtype = dtype
        self.torch_dtype = wg.DTYPES[dtype]
        self.bucket_bytes = cfg.bucket_mb << 20
        self.ranges = wg.plan_buckets(shapes, self.torch_dtype.itemsize, self.bucket_bytes)
        self.buckets = None if params is None else Buckets(params, self.torch_dtype, self.bucket_bytes)
        assert self.buckets is None or self.buckets.ranges == self.ranges
        self.device = device or (params[0].device if params else torch.device("cpu"))
        assert params is None or all(p.device == self.device for p in params), f"parameters not all on {self.device}"
        self.identity = wg.device_identity(self.device)  # what plan_group compares with the members' devices
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None  # recorded on the training stream at sync: what the serving stream waits for
        self._staging = Staging()  # buckets copied across the PCIe bus: GPU -> host for gloo, host -> GPU for NCCL
        self._flats: list[torch.Tensor] | None = None  # the last given snapshot (ZeRO-3)
        self.store = wg.open_store(cfg.host, cfg.port, is_master=True, timeout_s=cfg.timeout_s)
        self.port = self.store.port
        # Our own client for the joined/abort keys: gloo's rendezvous blocks in `get` holding a client's lock.
        self.control = wg.open_store(cfg.host, self.port, is_master=False, timeout_s=cfg.timeout_s)
        self.epoch = 0  # the last epoch number given out
        self.members: list[str] = []  # of `group`
        self.group: dist.ProcessGroup | None = None
        self.group_epoch = 0  # of `group` (epochs of probation members' own come and go beside it)
        self.plan: wg.GroupPlan | None = None  # of `group`
        self.graveyard = Graveyard()
        self._hub: Hub | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # membership changed, or stop
        # Shared with the hub thread's membership listener, under _lock (never held while calling the hub).
        self._lock = threading.Lock()
        self._holds: dict[str, int] = {}  # actor -> the version it was given (this registration)
        self._gens: Counter[str] = Counter()  # registrations and removals seen per actor id
        self._group_stale = False  # a member of `group` left or re-registered: the next attempt needs a new epoch
        self.membership = Membership()  # who is on probation (kept out of the sync's own epoch)
        # (actor, registration) -> its deadline (the first attempt's) and attempts so far, kept across attempts cut
        # short (a catch-up ends when the next update begins), so a member that never joins is evicted once its
        # join_timeout_s has passed in all, not never (a step shorter than the deadline ended every attempt early).
        self._join_by: dict[tuple[str, int], Joining] = {}
        self._attempt: Attempt | None = None
        self._abort_why: str | None = None  # set when a member of the attempt in flight is removed
        self._serving: Serving | None = None
        self._guarded = False
        self._guard_wait_s = 0.0
        self.log = get_logger()

    @classmethod
    def for_params(cls, cfg: WeightsConfig, named: list[tuple[str, torch.Tensor]], dtype: str) -> WeightSender:
        """A sender over full parameters held here (a single process, or rank 0 under ZeRO <= 2)."""
        return cls(cfg, [n for n, _ in named], [list(p.shape) for _, p in named], dtype, params=[p for _, p in named])

    def guard(self, optimizer: Any) -> None:
        """Broadcast from the parameters in place: `optimizer`'s step first stops the serving thread.

        Pass the optimizer that writes the parameters; DeepSpeed's wrappers are unwrapped to the
        torch optimizer inside, whose step runs before ZeRO copies the new values into the
        parameters. Anything else that writes the parameters (loading a checkpoint) must call
        `wait()` first.
        """
        inner = optimizer
        while not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(inner, "optimizer", None)  # DeepSpeedZeroOptimizer and friends keep the torch one here
            if inner is None:
                raise TypeError(f"WeightSender.guard: no torch.optim.Optimizer inside {type(optimizer).__name__}")
        inner.register_step_pre_hook(lambda *_: self._join_timed())
        self._guarded = True

    def _join_timed(self) -> None:
        t0 = time.perf_counter()
        self._stop_serving()
        self._guard_wait_s += time.perf_counter() - t0

    # ---- training thread --------------------------------------------------------------------------
    def sync(self, version: int, hub: Hub, snapshot: Snapshot | None = None) -> dict[str, float]:
        """Start serving `version` to every live actor (and to any that joins until the next sync); returns
        how long the learner was held up, and what serving the previous version took.

        `snapshot(out)`, required without `params`: copies the weights into one flat tensor per
        bucket of `self.ranges` (reusing `out`). It is collective under ZeRO-3 (every learner
        rank joins the gathers), so it runs on every sync, with or without members.
        The hub grants work only to actors that serve the current version, so an actor is
        idle from this sync until its copy of `version` lands.
        """
        t0 = time.perf_counter()
        out = self.wait()
        self._watch(hub)
        if snapshot is not None:  # reused across syncs; safe because wait() stopped the thread that read them
            self._flats = snapshot(self._flats)
            flats = self._flats
        else:
            assert self.buckets is not None, "WeightSender without params needs a snapshot"
            flats = None if self._guarded else self.buckets.snapshot()
        if self._stream is not None:  # the serving stream starts after everything the training stream wrote so far
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.device))
        live = hub.live_actors()
        with self._lock:  # those on probation are served after, by the serving thread, in epochs of their own
            members = self.membership.regular(live)
            self.membership.serving = True
        self._serving = Serving(version=version)
        first = self._begin(version, members) if members else None  # WeightSync goes out before sync returns
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(version, flats, first), name="fleetrl-weights", daemon=True)
        self._thread.start()
        out.update(
            {
                "time/weight_sync": time.perf_counter() - t0,
                "weights/members": float(len(members)),
                "weights/probation": float(len(live) - len(members)),
            }
        )
        return out

    def start(self, version: int, hub: Hub, snapshot: Snapshot | None = None) -> None:
        """At learner start: take the first snapshot (collective under ZeRO-3: the other ranks join it at
        start) and, if `version` > 0 (a resumed learner), serve it to every actor that registers: they
        come back serving -1 (actors/main.py), and the hub grants only to actors serving `version`.
        Version 0 is what every actor loads from model.path: nothing to send."""
        assert self._thread is None, "start() runs once, before any sync"
        if snapshot is not None:
            self._flats = snapshot(self._flats)
        if version > 0:
            self.sync(version, hub, None if snapshot is None else (lambda flats: flats))

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The last snapshot as named full tensors (views of the buckets), for a checkpoint; None without one."""
        if self._flats is None:
            return None
        out: dict[str, torch.Tensor] = {}
        for flat, bucket in zip(self._flats, self.ranges, strict=True):
            views = wg.split_bucket(flat, [self.shapes[i] for i in bucket])
            out.update(zip([self.names[i] for i in bucket], views, strict=True))
        return out

    def wait(self) -> dict[str, float]:
        """Stop serving (an attempt in flight finishes first); report what serving the last version took."""
        self._stop_serving()
        out: dict[str, float] = {}
        s, self._serving = self._serving, None
        if s is not None:
            if s.broadcast_s is not None:
                out["time/broadcast"] = s.broadcast_s
            if s.failed:
                out["weights/failed"] = float(s.failed)
            if s.catchups:
                out["weights/catchups"] = float(s.catchups)
            out["weights/epoch"] = float(self.epoch)
        if self._guarded:
            out["time/weight_guard_wait"], self._guard_wait_s = self._guard_wait_s, 0.0
        return out

    def _stop_serving(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None

    def _watch(self, hub: Hub) -> None:
        if self._hub is None:
            self._hub = hub
            hub.add_membership_listener(self._on_membership)
        assert self._hub is hub, "one sender serves one hub"

    # ---- hub thread (under the hub's lock: set flags, nothing more) -------------------------------
    def _on_membership(self, actor_id: str, joined: bool) -> None:
        with self._lock:
            self._join_by.pop((actor_id, self._gens[actor_id]), None)  # that registration is over
            self._gens[actor_id] += 1
            self._holds.pop(actor_id, None)
            if joined:
                self.membership.registered(actor_id)
            else:
                self.membership.removed(actor_id)
            if actor_id in self.members:
                self._group_stale = True
            att = self._attempt
            if not joined and att is not None and actor_id in att.members and self._abort_why is None:
                self._abort_why = f"member {actor_id} was removed by the hub"
        self._wake.set()

    # ---- serving thread ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """The serving thread's GPU work: on the learner's device (a new thread's current device is 0) and its own stream."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if self._ready is not None:
                self._stream.wait_event(self._ready)
            yield

    def _serve(self, version: int, flats: list[torch.Tensor] | None, attempt: Attempt | None) -> None:
        with self._on_device():
            self._serve_loop(version, flats, attempt)

    def _serve_loop(self, version: int, flats: list[torch.Tensor] | None, attempt: Attempt | None) -> None:
        retry_at, unexplained = 0.0, 0
        while True:
            if attempt is not None:
                if self._run(attempt, flats):
                    unexplained = 0
                elif self._abort_why is None:  # e.g. gloo saw a peer close before the hub did: give the hub a moment
                    unexplained += 1
                    retry_at = _backoff(unexplained)
                attempt = None
            # Clear before looking at _stop: a stop that sets both after this check still wakes the wait below.
            self._wake.clear()
            if self._stop.is_set():
                return
            need = self._next_members(version)
            wait_s = retry_at - time.monotonic()
            if need and wait_s <= 0:
                try:
                    attempt = self._begin(version, need, catchup=True)
                except Exception as e:  # the hub could not send the WeightSyncs (its loop stopping, a send timed out)
                    with self._lock:
                        self._attempt = None
                    unexplained += 1
                    retry_at = _backoff(unexplained)
                    self.log.warning("weights.begin_failed", version=version, members=need, error=repr(e)[:300])
                continue
            if self._wake.wait(wait_s if need else None):
                retry_at = 0.0  # membership changed (the hub removed someone): retry now

    def _next_members(self, version: int) -> list[str]:
        """Whom to serve `version` next: the live actors that lack it, regular members before those on probation."""
        assert self._hub is not None
        live = self._hub.live_actors()
        with self._lock:
            lacking = [a for a in live if self._holds.get(a) != version]
            return self.membership.next_group(lacking) if lacking else []

    def _begin(self, version: int, members: list[str], catchup: bool = False) -> Attempt:
        """Pick the group epoch for `members` and send each its WeightSync."""
        assert self._hub is not None
        devices = self._hub.devices(members)  # before the lock: never held while calling the hub
        old: tuple[dist.ProcessGroup, str] | None = None  # closed after the lock: NCCL's abort can take a while
        with self._lock:
            side = any(a in self.membership.probation for a in members)
            reuse = not side and self.group is not None and not self._group_stale and members == self.members and self.plan is not None
            if reuse:
                assert self.plan is not None
                plan, epoch = self.plan, self.group_epoch
            elif side:
                plan = wg.plan_group(self.identity, list(zip(members, devices, strict=True)))
                self.epoch += 1
                epoch = self.epoch
            else:
                # The old group has nothing in flight (a failed attempt already dropped it): it can go.
                if self.group is not None and self.plan is not None:
                    old = (self.group, self.plan.backend)
                plan = wg.plan_group(self.identity, list(zip(members, devices, strict=True)))
                self.group, self.members, self.plan, self._group_stale = None, list(members), plan, False
                self.epoch += 1
                epoch = self.group_epoch = self.epoch
            att = Attempt(
                version=version,
                epoch=epoch,
                members=list(members),
                plan=plan,
                new_group=not reuse,
                gens={a: self._gens[a] for a in members},
                catchup=catchup,
                side=side,
            )
            self._attempt, self._abort_why = att, None
        if old is not None:
            wg.close_group(*old)
        if att.new_group:
            self.log.info(
                "weights.new_group_epoch",
                epoch=att.epoch,
                members=att.members,
                version=version,
                backend=plan.backend,
                world_size=plan.world_size,
                probation=side,
            )
            if plan.fallback:
                self.log.warning(
                    "weights.gloo_fallback",
                    epoch=att.epoch,
                    why=plan.fallback,
                    how="each bucket goes GPU -> pinned host memory -> gloo -> the members' GPUs",
                )
        rank_of = {a: (plan.first[k], plan.counts[k]) for k, a in enumerate(members)}

        def make(actor_id: str) -> m.WeightSync:
            first, count = rank_of[actor_id]
            return m.WeightSync(
                policy_version=version,
                group_epoch=att.epoch,
                store_host=self.cfg.host,
                store_port=self.port,
                rank=first,
                ranks=count,
                world_size=plan.world_size,
                backend=plan.backend,
                timeout_s=self.cfg.timeout_s,
                names=self.names,
                shapes=self.shapes,
                dtype=self.dtype,
                bucket_bytes=self.bucket_bytes,
            )

        self._hub.send_weight_sync(members, make)
        att.joins_by = time.monotonic() + self.cfg.join_timeout_s
        gone = set(members) - set(self._hub.live_actors())  # removed before the attempt was registered above
        if gone:
            with self._lock:
                self._abort_why = self._abort_why or f"{sorted(gone)} removed before the attempt began"
        return att

    def _run(self, att: Attempt, flats: list[torch.Tensor] | None) -> bool:
        """One attempt; True when every member holds att.version. A failure gives the epoch up."""
        assert self._serving is not None
        waits = Abortable(should_abort=lambda: self._why_abort(att), timeout_s=self.cfg.timeout_s, graveyard=self.graveyard, poll_s=POLL_S)
        t0 = time.perf_counter()
        try:
            # Milliseconds normally; a member that dies ends it within POLL_S of the hub noticing.
            with phase(self.log, "weights.broadcast", quiet=True, epoch=att.epoch, members=len(att.members), version=att.version):
                if (why := self._why_abort(att)) is not None:
                    raise Aborted(why)
                group = self.group
                if att.new_group:
                    self._await_joins(att)
                    group = self._connect(att)
                assert group is not None
                on = wg.group_device(att.plan.backend, self.device)

                def send(g: dist.ProcessGroup, flat: torch.Tensor) -> None:
                    waits.broadcast(g, self._staging.to(on, flat))  # the same tensor unless the bucket is on the other side

                if self.buckets is None:
                    assert flats is not None
                    for flat in flats:
                        send(group, flat)
                else:
                    self.buckets.send(group, flats, bcast=send)  # guarded (flats None): the step waits for this thread
            if att.side_group is not None:  # the members join the everyone epoch at the next sync
                wg.close_group(att.side_group, att.plan.backend)
                att.side_group = None
        except RuntimeError as e:  # Aborted; gloo's DistBackendError (a peer closed, a timeout)
            self._give_up(att, e, time.perf_counter() - t0)
            return False
        finally:
            with self._lock:
                self._attempt = None
        elapsed = time.perf_counter() - t0
        with self._lock:
            for a in att.members:
                if self._gens[a] == att.gens[a]:  # still the registration it was sent to
                    self._holds[a] = att.version
        s = self._serving
        if s.broadcast_s is None:
            s.broadcast_s = elapsed
        else:
            s.catchups += 1
            self.log.info("weights.caught_up", version=att.version, epoch=att.epoch, members=att.members, seconds=round(elapsed, 3))
        s.epochs.append(att.epoch)
        return True

    def _await_joins(self, att: Attempt) -> None:
        """Until every member has set its joined key; one that has not by att.joins_by is evicted from the hub,
        which gives the attempt up: the serving loop re-forms the epoch at once without it."""
        assert self._hub is not None
        plan = att.plan
        keys = {
            a: [joined_key(att.epoch, r) for r in range(plan.first[k], plan.first[k] + plan.counts[k])] for k, a in enumerate(att.members)
        }  # one per rank: each engine worker joins on its own
        every = [key for ks in keys.values() for key in ks]
        with self._lock:  # a registration that has ended since the attempt began gets no entry (none would drop it)
            joining = {
                a: self._join_by.setdefault((a, att.gens[a]), Joining(by=att.joins_by))
                if self._gens[a] == att.gens[a]
                else Joining(by=att.joins_by)
                for a in att.members
            }
            for j in joining.values():
                j.attempts += 1

        def settle(carry: bool) -> list[str]:
            """A member that set its key has shown it can join: its next attempt starts afresh. One that has not keeps
            its deadline only when `carry` (a catch-up cut short by the next update); any other end starts it afresh.
            Returns the members that have not joined."""
            joined = {a for a, ks in keys.items() if self.control.check(ks)}  # store round trips, outside the lock
            with self._lock:
                for a in att.members:
                    if a in joined or not carry:
                        self._join_by.pop((a, att.gens[a]), None)
            return [a for a in att.members if a not in joined]

        def repeat(blamed: list[str]) -> bool:
            """Whether each member to blame had an earlier attempt in this registration (cut short: it was logged)."""
            return bool(blamed) and all(joining[a].attempts > 1 for a in blamed)

        while not self.control.check(every):
            now = time.monotonic()
            late = [a for a, ks in keys.items() if now > joining[a].by and not self.control.check(ks)]
            if late:  # checked before a cut-short: the deadline counts across attempts
                settle(carry=False)
                missed = f"did not join a weight group epoch within weights.join_timeout_s = {self.cfg.join_timeout_s} s"
                with self._lock:  # only the registration it was sent to: one that came back since is not to blame
                    stale = [a for a in late if self._gens[a] == att.gens[a]]
                for a in stale:
                    n = joining[a].attempts
                    self._hub.evict(a, f"{missed} ({n} attempt{'s' if n > 1 else ''})")
                att.repeat = repeat(late)
                raise Aborted(f"{late} {missed} (epoch {att.epoch})")
            if (why := self._why_abort(att)) is not None:
                cut_short = att.catchup and self._stop.is_set() and self._abort_why is None
                waiting = settle(carry=cut_short)
                att.repeat = cut_short and repeat(waiting)
                raise Aborted(why)
            time.sleep(JOIN_POLL_S)
        settle(carry=False)

    def _connect(self, att: Attempt) -> dist.ProcessGroup:
        """Build the epoch's group (every member said it joined) by att.joins_by. A group that does not connect
        in time names no culprit: learner/weights/membership.py decides who is tried apart, or evicted."""
        assert self._hub is not None
        waits = Abortable(
            should_abort=lambda: self._why_abort(att),
            timeout_s=max(0.0, att.joins_by - time.monotonic()),
            graveyard=self.graveyard,
            poll_s=POLL_S,
        )
        try:
            group = waits.build(lambda made: self._build(att, made), lambda g: wg.close_group(g, att.plan.backend))
        except Aborted:
            if self._why_abort(att) is None:  # the deadline, not a removal or a stop
                with self._lock:
                    current = [a for a in att.members if self._gens[a] == att.gens[a]]
                    evict = self.membership.connect_failed(current)
                why = f"weight group epoch {att.epoch} did not connect within weights.join_timeout_s = {self.cfg.join_timeout_s} s"
                self.log.warning("weights.connect_failed", epoch=att.epoch, members=att.members, evicted=evict, backend=att.plan.backend)
                for a in evict:
                    self._hub.evict(a, why + " (its only member: nobody else to blame)")
            raise
        with self._lock:
            if att.side:
                att.side_group = group
            else:
                self.group = group
            self.membership.joined([a for a in att.members if self._gens[a] == att.gens[a]])
        return group

    def _why_abort(self, att: Attempt) -> str | None:
        """Why the attempt in flight must end now: a member was removed, or (a catch-up only) the sender is
        stopping: the optimizer step waits for this thread, and a newcomer's catch-up must not hold it up."""
        if self._abort_why is not None:
            return self._abort_why
        if att.catchup and self._stop.is_set():
            return "the sender stopped serving this version (the next update has begun)"
        return None

    def _build(self, att: Attempt, made: Callable[[dist.ProcessGroup], None]) -> dist.ProcessGroup:
        # A store client of its own: an abandoned rendezvous keeps blocking in it until its timeout.
        store = wg.open_store(self.cfg.host, self.port, is_master=False, timeout_s=self.cfg.timeout_s)
        backend = att.plan.backend
        return wg.open_group(
            store,
            self.cfg.host,
            att.epoch,
            0,
            att.plan.world_size,
            self.cfg.timeout_s,
            backend,
            wg.group_device(backend, self.device),
            made,
        )

    def _give_up(self, att: Attempt, error: RuntimeError, elapsed: float) -> None:
        """Tell the members the epoch is over (before returning: the optimizer may write the parameters next)."""
        assert self._serving is not None
        self.control.set(abort_key(att.epoch), str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
        with self._lock:  # the hub thread takes this lock: NCCL's abort (close_group) waits until it is released
            if att.side:  # the everyone epoch was not part of it
                dead, att.side_group = att.side_group, None
            else:
                dead, self.group, self.members, self.plan = self.group, None, [], None  # an operation in flight lives on in the graveyard
        if dead is not None:
            wg.close_group(dead, att.plan.backend)
        self._staging.drop()  # an abandoned gloo send may still read it: the next epoch stages into fresh memory
        self._serving.failed += 1
        # A newcomer's catch-up is cut short at every update until it joins or its deadline evicts it: its first
        # attempt's failure is the warning, the eviction (hub.actor_removed) counts the attempts.
        (self.log.debug if att.repeat else self.log.warning)(
            "weights.attempt_failed",
            epoch=att.epoch,
            version=att.version,
            members=att.members,
            seconds=round(elapsed, 3),
            error=(str(error).splitlines() or [type(error).__name__])[0][:300],
        )
