"""Learner rank 0's side of the weight group: form the group for the current members, broadcast.

Membership changes only at sync boundaries: when the set of live actors differs
from the last group's, the next sync forms a new group epoch (every member gets
a WeightSync naming it, a newcomer included, and joins before the broadcast).
A failed broadcast (a member died: gloo times out) leaves no group behind; the
next sync forms a new epoch without the dead member.

Only the sending thread touches the group; `sync` and `wait` hand work to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from learner.hub import Hub
from protocol import messages as m
from protocol import weights as wg
from protocol.config import WeightsConfig
from protocol.logs import get_logger
from protocol.progress import phase

Snapshot = Callable[[list[torch.Tensor] | None], list[torch.Tensor] | None]


class WeightSender:
    def __init__(self, cfg: WeightsConfig, names: list[str], shapes: list[list[int]], dtype: str):
        self.cfg = cfg
        self.names = names
        self.shapes = shapes  # full (unsharded) shapes
        self.dtype = dtype
        self.torch_dtype = wg.DTYPES[dtype]
        self.bucket_bytes = cfg.bucket_mb << 20
        itemsize = torch.tensor([], dtype=self.torch_dtype).element_size()
        self.buckets = wg.plan_buckets(self.shapes, itemsize, self.bucket_bytes)
        self.store = wg.open_store(cfg.host, cfg.port, is_master=True, timeout_s=cfg.timeout_s)
        self.port = self.store.port
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.epoch = 0
        self.members: list[str] = []
        self.group: dist.ProcessGroup | None = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._last_s = 0.0
        self._flats: list[torch.Tensor] | None = None
        self.log = get_logger()

    def sync(self, version: int, hub: Hub, snapshot: Snapshot) -> dict[str, float]:
        """Start sending `version` to every live actor; returns how long the learner was held up.

        `snapshot(out)` copies the weights into one flat tensor per bucket of `self.buckets`
        (reusing `out`). It is collective under ZeRO-3 (every learner rank joins the gathers),
        so it runs on every sync, with or without members.

        The broadcast runs in a background thread on a snapshot of the parameters, so the
        next update overlaps it. That is safe for any max_staleness: the hub grants work
        only to actors that report serving the current version. The next sync first
        waits for this one (one collective sequence per group at a time).
        """
        t0 = time.perf_counter()
        out = self.wait()
        # Reused across syncs; safe because wait() above finished the broadcast that read them.
        self._flats = flats = snapshot(self._flats)
        assert flats is not None
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

        hub.send_weight_sync(members, make)
        self._thread = threading.Thread(target=self._broadcast, args=(flats, epoch, world), name="fleetrl-weights", daemon=True)
        self._thread.start()
        out.update({"time/weight_sync": time.perf_counter() - t0, "weights/members": float(len(members))})
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The last snapshot as named full tensors (views of the buckets), for a checkpoint."""
        assert self._flats is not None, "no snapshot yet: sync() has not run"
        out: dict[str, torch.Tensor] = {}
        for flat, bucket in zip(self._flats, self.buckets, strict=True):
            views = wg.split_bucket(flat, [self.shapes[i] for i in bucket])
            out.update(zip([self.names[i] for i in bucket], views, strict=True))
        return out

    def wait(self) -> dict[str, float]:
        """Finish the broadcast in flight; report its duration, or its failure."""
        if self._thread is None:
            return {}
        self._thread.join()
        self._thread = None
        if self._error is not None:
            self.log.error("weights.broadcast_failed", epoch=self.epoch, error=self._error)
            self._error, self.group, self.members = None, None, []  # the next sync forms a new epoch
            return {"weights/failed": 1.0}
        return {"time/broadcast": self._last_s}

    def _broadcast(self, flats: list[torch.Tensor], epoch: int, world: int) -> None:
        t0 = time.perf_counter()
        try:
            # Milliseconds normally; a dead member blocks it up to weights.timeout_s, and then it says so.
            with phase(self.log, "weights.broadcast", quiet=True, epoch=epoch, members=world - 1):
                if self.group is None:
                    self.group = wg.open_group(self.store, self.cfg.host, epoch, 0, world, self.cfg.timeout_s, self.backend)
                for flat in flats:
                    wg.broadcast(self.group, flat)
        except RuntimeError as e:  # gloo/NCCL raise RuntimeError (DistBackendError) on timeout or a dead peer
            self._error = str(e)
        self._last_s = time.perf_counter() - t0
