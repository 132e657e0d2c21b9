"""Learner rank 0's side of the weight group: form the group for the current members, broadcast.

Membership changes only at sync boundaries: when the set of live actors differs
from the last group's, the next sync forms a new group epoch (every member gets
a WeightSync naming it, a newcomer included, and joins before the broadcast).
A failed broadcast (a member died: gloo times out) leaves no group behind; the
next sync forms a new epoch without the dead member.

Only the sending thread touches the group; `sync` and `wait` hand work to it.

Where the bytes come from (see learner/weight_buckets.py): unguarded, `sync` copies every
bucket on the learner thread (one memcpy each when the parameters are DeepSpeed's flat
buffer) and the broadcast runs from the copies. After `guard(optimizer)`, the optimizer's
step first waits for the broadcast in flight, so the broadcast reads the parameters in
place: no copy, and the learner is not held at all by `sync`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from learner.hub import Hub
from learner.weight_buckets import Buckets
from protocol import messages as m
from protocol import weights as wg
from protocol.config import WeightsConfig
from protocol.logs import get_logger


class WeightSender:
    def __init__(self, cfg: WeightsConfig, named_params: list[tuple[str, torch.nn.Parameter]], dtype: str):
        self.cfg = cfg
        self.params = named_params
        self.names = [n for n, _ in named_params]
        self.shapes = [list(p.shape) for _, p in named_params]
        self.dtype = dtype
        self.torch_dtype = wg.DTYPES[dtype]
        self.bucket_bytes = cfg.bucket_mb << 20
        self.buckets = Buckets([p for _, p in named_params], self.torch_dtype, self.bucket_bytes)
        self.store = wg.open_store(cfg.host, cfg.port, is_master=True, timeout_s=cfg.timeout_s)
        self.port = self.store.port
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.epoch = 0
        self.members: list[str] = []
        self.group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._last_s = 0.0
        self._outcome: dict[str, float] = {}  # of the broadcast last joined, until `wait` reports it
        self._guarded = False
        self._guard_wait_s = 0.0
        self.log = get_logger()

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

    def sync(self, version: int, hub: Hub) -> dict[str, float]:
        """Start sending `version` to every live actor; returns how long the learner was held up.

        The broadcast runs in a background thread on a snapshot of the parameters, so the
        next update overlaps it. That is safe for any max_staleness: the hub grants work
        only to actors that report serving the current version. The next sync first
        waits for this one (one collective sequence per group at a time).
        """
        t0 = time.perf_counter()
        out = self.wait()
        members = hub.live_actors()
        if not members:
            out.update({"time/weight_sync": time.perf_counter() - t0, "weights/members": 0.0})
            return out
        if members != self.members or self.group is None:
            self.epoch += 1
            self.members, self.group = members, None
            self.log.info("weights.new_group_epoch", epoch=self.epoch, members=members)
        epoch, world = self.epoch, len(members) + 1

        def make(actor_id: str, rank: int) -> m.WeightSync:
            return m.WeightSync(
                policy_version=version, group_epoch=epoch, store_host=self.cfg.host, store_port=self.port,
                rank=rank, world_size=world, timeout_s=self.cfg.timeout_s, names=self.names,
                shapes=self.shapes, dtype=self.dtype, bucket_bytes=self.bucket_bytes)

        # The copies are reused across syncs; safe because wait() above finished the broadcast that read them.
        flats = None if self._guarded else self.buckets.snapshot()
        hub.send_weight_sync(members, make)
        self._thread = threading.Thread(target=self._broadcast, args=(flats, epoch, world), name="fleetrl-weights", daemon=True)
        self._thread.start()
        out.update({"time/weight_sync": time.perf_counter() - t0, "weights/members": float(len(members))})
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
            if self.group is None:
                self.group = wg.open_group(self.store, self.cfg.host, epoch, 0, world, self.cfg.timeout_s, self.backend)
            self.buckets.send(self.group, flats)  # guarded (flats None): the parameters wait for this thread
        except RuntimeError as e:  # gloo/NCCL raise RuntimeError (DistBackendError) on timeout or a dead peer
            self._error = str(e)
        self._last_s = time.perf_counter() - t0
