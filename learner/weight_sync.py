"""Learner rank 0's side of the weight group: form the group for the current members, broadcast.

Membership changes only at sync boundaries: when the set of live actors differs
from the last group's, the next sync forms a new group epoch (every member gets
a WeightSync naming it, a newcomer included, and joins before the broadcast).
An actor that registered again (same id, new connection or served -1: its learner went
away and its worker left the old group) counts as a change too: the hub's membership
count. A failed broadcast (a member died: gloo times out) leaves no group behind; the
next sync forms a new epoch without the dead member.

While the learner waits for rollouts, learner/resync.py re-sends the current version
(`resend`) to actors that lag behind it.

Only the sending thread touches the group; `sync` and `wait` hand work to it.

Where the bytes come from (see learner/weight_buckets.py):
- ZeRO-3 (parameters sharded over the learner ranks): `sync` is given a `snapshot` that
  gathers each bucket on every rank and copies it out on rank 0 (Trainer.snapshot).
- ZeRO-0/1/2 (rank 0 holds every parameter), unguarded: `sync` copies every bucket on the
  learner thread (one memcpy each when the parameters are DeepSpeed's flat buffer) and the
  broadcast runs from the copies.
- After `guard(optimizer)`: the optimizer's step first waits for the broadcast in flight,
  so the broadcast reads the parameters in place: no copy, and `sync` holds nothing up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from learner.hub import Hub
from learner.weight_buckets import Buckets
from protocol import messages as m
from protocol import weights as wg
from protocol.config import WeightsConfig
from protocol.logs import get_logger
from protocol.progress import phase

Snapshot = Callable[[list[torch.Tensor] | None], list[torch.Tensor] | None]


class WeightSender:
    def __init__(self, cfg: WeightsConfig, names: list[str], shapes: list[list[int]], dtype: str,
                 params: list[torch.Tensor] | None = None):
        """`params`: the full parameters when rank 0 holds them (ZeRO <= 2); None under ZeRO-3 (sync gets a snapshot)."""
        self.cfg = cfg
        self.names = names
        self.shapes = shapes  # full (unsharded) shapes
        self.dtype = dtype
        self.torch_dtype = wg.DTYPES[dtype]
        self.bucket_bytes = cfg.bucket_mb << 20
        self.ranges = wg.plan_buckets(shapes, self.torch_dtype.itemsize, self.bucket_bytes)
        self.buckets = None if params is None else Buckets(params, self.torch_dtype, self.bucket_bytes)
        assert self.buckets is None or self.buckets.ranges == self.ranges
        self._flats: list[torch.Tensor] | None = None  # the last given snapshot (ZeRO-3)
        self.store = wg.open_store(cfg.host, cfg.port, is_master=True, timeout_s=cfg.timeout_s)
        self.port = self.store.port
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.epoch = 0
        self.members: list[str] = []
        self.membership = -1  # the hub's membership count when the group was formed
        self.group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._last_s = 0.0
        self._outcome: dict[str, float] = {}  # of the broadcast last joined, until `wait` reports it
        self._guarded = False
        self._guard_wait_s = 0.0
        self.log = get_logger()

    @classmethod
    def for_params(cls, cfg: WeightsConfig, named: list[tuple[str, torch.Tensor]], dtype: str) -> WeightSender:
        """A sender over full parameters held here (a single process, or rank 0 under ZeRO <= 2)."""
        return cls(cfg, [n for n, _ in named], [list(p.shape) for _, p in named], dtype, params=[p for _, p in named])

    def guard(self, optimizer: Any) -> None:
        """Broadcast from the parameters in place: `optimizer`'s step first waits for the broadcast in flight.

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
        self._join()
        self._guard_wait_s += time.perf_counter() - t0

    def sync(self, version: int, hub: Hub, snapshot: Snapshot | None = None) -> dict[str, float]:
        """Start sending `version` to every live actor; returns how long the learner was held up.

        `snapshot(out)`, required without `params`: copies the weights into one flat tensor per
        bucket of `self.ranges` (reusing `out`). It is collective under ZeRO-3 (every learner
        rank joins the gathers), so it runs on every sync, with or without members.

        The broadcast runs in a background thread on a snapshot of the parameters, so the
        next update overlaps it. That is safe for any max_staleness: the hub grants work
        only to actors that report serving the current version. The next sync first
        waits for this one (one collective sequence per group at a time).
        """
        t0 = time.perf_counter()
        out = self.wait()
        if snapshot is not None:  # reused across syncs; safe because wait() finished the broadcast that read them
            self._flats = snapshot(self._flats)
        members, membership = hub.members()
        if not members:
            out.update({"time/weight_sync": time.perf_counter() - t0, "weights/members": 0.0})
            return out
        if members != self.members or membership != self.membership or self.group is None:
            self.epoch += 1
            self.members, self.membership, self.group = members, membership, None
            self.log.info("weights.new_group_epoch", epoch=self.epoch, members=members)
        epoch, world = self.epoch, len(members) + 1

        def make(actor_id: str, rank: int) -> m.WeightSync:
            return m.WeightSync(
                policy_version=version, group_epoch=epoch, store_host=self.cfg.host, store_port=self.port,
                rank=rank, world_size=world, timeout_s=self.cfg.timeout_s, names=self.names,
                shapes=self.shapes, dtype=self.dtype, bucket_bytes=self.bucket_bytes)

        # The copies are reused across syncs; safe because wait() above finished the broadcast that read them.
        if snapshot is not None:
            flats = self._flats
        else:
            assert self.buckets is not None, "WeightSender without params needs a snapshot"
            flats = None if self._guarded else self.buckets.snapshot()
        hub.send_weight_sync(members, make)
        self._thread = threading.Thread(target=self._broadcast, args=(flats, epoch, world), name="fleetrl-weights", daemon=True)
        self._thread.start()
        out.update({"time/weight_sync": time.perf_counter() - t0, "weights/members": float(len(members))})
        return out

    def prime(self, snapshot: Snapshot) -> None:
        """Take the snapshot (collective under ZeRO-3) without sending it: at start, so `resend` has weights to send."""
        assert self._thread is None, "a broadcast may be reading the snapshot"
        self._flats = snapshot(self._flats)

    def resend(self, version: int, hub: Hub) -> dict[str, float]:
        """Send `version` again, as it is: the last snapshot (ZeRO-3), or the parameters, which nothing
        changes while the learner waits for rollouts. No collective: the other learner ranks are not involved.
        Under ZeRO-3 a snapshot must be held (a sync or `prime` ran)."""
        assert self.buckets is not None or self._flats is not None, "resend under ZeRO-3 before any snapshot: prime() first"
        return self.sync(version, hub, (lambda flats: flats) if self.buckets is None else None)

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
        """Finish the broadcast in flight; report its duration, or its failure, and any wait the guard imposed."""
        self._join()
        out, self._outcome = self._outcome, {}
        if self._guarded:
            out["time/weight_guard_wait"], self._guard_wait_s = self._guard_wait_s, 0.0
        return out

    def _join(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            self.log.error("weights.broadcast_failed", epoch=self.epoch, error=self._error)
            self._error, self.group, self.members = None, None, []  # the next sync forms a new epoch
            self._outcome = {"weights/failed": 1.0}
        else:
            self._outcome = {"time/broadcast": self._last_s}

    def _broadcast(self, flats: list[torch.Tensor] | None, epoch: int, world: int) -> None:
        t0 = time.perf_counter()
        try:
            # Milliseconds normally; a dead member blocks it up to weights.timeout_s, and then it says so.
            with phase(self.log, "weights.broadcast", quiet=True, epoch=epoch, members=world - 1):
                if self.group is None:
                    self.group = wg.open_group(self.store, self.cfg.host, epoch, 0, world, self.cfg.timeout_s, self.backend)
                if self.buckets is None:
                    assert flats is not None
                    for flat in flats:
                        wg.broadcast(self.group, flat)
                else:
                    self.buckets.send(self.group, flats)  # guarded (flats None): the parameters wait for this thread
        except RuntimeError as e:  # gloo/NCCL raise RuntimeError (DistBackendError) on timeout or a dead peer
            self._error = str(e)
        self._last_s = time.perf_counter() - t0
