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
  gathers each bucket on every rank and copies it out on rank 0 (WeightSource.snapshot).
- ZeRO-0/1/2 (rank 0 holds every parameter), unguarded: `sync` copies every bucket on the
  learner thread (one memcpy each when the parameters are DeepSpeed's flat buffer).
- After `guard(optimizer)`: the optimizer's step first stops the serving thread (and waits for
  the attempt in flight), so every attempt reads the parameters in place: no copy, and `sync`
  holds nothing up. A catch-up for a newcomer can therefore only start while no step runs.
Either way the serving thread only ever sends version v: the copies are of v, and the guard
keeps the parameters at v while it runs.

The parts, one idea each:
- this file: the training thread's API (sync, start, wait, guard, state_dict) and the fleet's listener;
- learner/weights/serving.py: the serving thread (whom next, retries, its GPU stream);
- learner/weights/attempts.py: one attempt's I/O (WeightSyncs, joins, connect, broadcast, give up);
- learner/weights/state.py: every decision, with no I/O (reuse or new epoch, who holds v, who is late,
  whom to evict, why an attempt ends), and learner/weights/membership.py: who is on probation;
- learner/weights/fleet.py: what the sender needs of the hub, and the lock rule between the two.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from learner.weights.attempts import Attempts
from learner.weights.buckets import Buckets
from learner.weights.fleet import Fleet
from learner.weights.records import Serving
from learner.weights.serving import ServingThread
from learner.weights.state import SenderState
from protocol import weights as wg
from protocol.config import WeightsConfig
from protocol.logs import get_logger

Snapshot = Callable[[list[torch.Tensor] | None], list[torch.Tensor] | None]


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
        self._flats: list[torch.Tensor] | None = None  # the last given snapshot (ZeRO-3)
        self.store = wg.open_store(cfg.host, cfg.port, is_master=True, timeout_s=cfg.timeout_s)
        # Our own client for the joined/abort keys: gloo's rendezvous blocks in `get` holding a client's lock.
        control = wg.open_store(cfg.host, self.store.port, is_master=False, timeout_s=cfg.timeout_s)
        # `state` is shared with the fleet's membership listener under `_lock` (the rule: learner/weights/fleet.py).
        self._lock = threading.Lock()
        self.state: SenderState[dist.ProcessGroup] = SenderState(self.identity, cfg.join_timeout_s, cfg.gloo_mesh_ranks)
        stop = threading.Event()  # set when serving the version ends: the next sync, or the optimizer step
        self._attempts = Attempts(
            cfg,
            names=names,
            shapes=shapes,
            dtype=dtype,
            device=self.device,
            buckets=self.buckets,
            port=self.store.port,
            control=control,
            state=self.state,
            lock=self._lock,
            stop=stop,
        )
        self._thread = ServingThread(self._attempts, self.state, self._lock, stop, self.device)
        self._fleet: Fleet | None = None
        self._serving: Serving | None = None
        self._guarded = False
        self._guard_wait_s = 0.0
        self.log = get_logger()

    @classmethod
    def for_params(cls, cfg: WeightsConfig, named: list[tuple[str, torch.Tensor]], dtype: str) -> WeightSender:
        """A sender over full parameters held here (a single process, or rank 0 under ZeRO <= 2)."""
        return cls(cfg, [n for n, _ in named], [list(p.shape) for _, p in named], dtype, params=[p for _, p in named])

    # The rendezvous store's port and our client of it: two senders of one learner may share them (a test does).
    @property
    def port(self) -> int:
        return self._attempts.port

    @port.setter
    def port(self, port: int) -> None:
        self._attempts.port = port

    @property
    def control(self) -> dist.TCPStore:
        return self._attempts.control

    @control.setter
    def control(self, control: dist.TCPStore) -> None:
        self._attempts.control = control

    @property
    def epoch(self) -> int:
        """The last group epoch number given out (an epoch number is never reused)."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.state.epoch = epoch

    @property
    def plan(self) -> wg.GroupPlan | None:
        """The everyone epoch's layout (None after it was given up)."""
        return self.state.plan

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
        self._thread.stop()
        self._guard_wait_s += time.perf_counter() - t0

    # ---- training thread --------------------------------------------------------------------------
    def sync(self, version: int, hub: Fleet, snapshot: Snapshot | None = None) -> dict[str, float]:
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
        self._thread.after_training()
        live = hub.live_actors()
        with self._lock:  # those on probation are served after, by the serving thread, in epochs of their own
            members = self.state.start_serving(live)
        self._serving = Serving(version=version)
        first = self._attempts.begin(hub, version, members) if members else None  # WeightSync goes out before sync returns
        self._thread.start(hub, self._serving, flats, first)
        out.update(
            {
                "time/weight_sync": time.perf_counter() - t0,
                "weights/members": float(len(members)),
                "weights/probation": float(len(live) - len(members)),
            }
        )
        return out

    def start(self, version: int, hub: Fleet, snapshot: Snapshot | None = None) -> None:
        """At learner start: take the first snapshot (collective under ZeRO-3: the other ranks join it at
        start) and, if `version` > 0 (a resumed learner), serve it to every actor that registers: they
        come back serving -1 (actors/main.py), and the hub grants only to actors serving `version`.
        Version 0 is what every actor loads from model.path: nothing to send."""
        assert not self._thread.running, "start() runs once, before any sync"
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
        self._thread.stop()
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

    def close(self) -> dict[str, float]:
        """`wait`, then let the weight group go: NCCL's communicator is aborted now (local: it never waits for the
        members), not left to the garbage collector or to whatever runs next in this process. Members see their
        next receive fail and leave, as after any epoch the learner gives up."""
        out = self.wait()
        with self._lock:
            closing = self.state.closing()
        if closing is not None:
            wg.close_group(*closing)
        return out

    def _watch(self, fleet: Fleet) -> None:
        if self._fleet is None:
            self._fleet = fleet
            fleet.add_membership_listener(self._on_membership)
        assert self._fleet is fleet, "one sender serves one hub"

    # ---- the fleet's listener (learner/weights/fleet.py: record and wake, nothing more) ----------
    def _on_membership(self, actor_id: str, joined: bool) -> None:
        with self._lock:
            self.state.on_membership(actor_id, joined)
        self._thread.wake()
