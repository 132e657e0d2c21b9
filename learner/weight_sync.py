"""Learner rank 0's side of the weight group: form the group for the current members, broadcast.

Membership changes only at sync boundaries: when the set of live actors differs
from the last group's, the next sync forms a new group epoch (every member gets
a WeightSync naming it, a newcomer included, and joins before the broadcast).
A failed broadcast (a member died: gloo times out) leaves no group behind; the
next sync forms a new epoch without the dead member.
"""

from __future__ import annotations

import time

import torch

from learner.hub import Hub
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
        itemsize = torch.tensor([], dtype=self.torch_dtype).element_size()
        self.buckets = wg.plan_buckets(self.shapes, itemsize, self.bucket_bytes)
        self.store = wg.open_store(cfg.host, cfg.port, is_master=True, timeout_s=cfg.timeout_s)
        self.port = self.store.port
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.epoch = 0
        self.members: list[str] = []
        self.group = None
        self.log = get_logger()

    def sync(self, version: int, hub: Hub) -> dict[str, float]:
        """Send `version` to every live actor. Returns timings; raises nothing on a dead member."""
        members = hub.live_actors()
        if not members:
            return {"time/weight_sync": 0.0, "weights/members": 0.0}
        t0 = time.perf_counter()
        if members != self.members or self.group is None:
            self.epoch += 1
            self.members, self.group = members, None
            self.log.info("weights.new_group_epoch", epoch=self.epoch, members=members)

        def make(actor_id: str, rank: int) -> m.WeightSync:
            return m.WeightSync(
                policy_version=version, group_epoch=self.epoch, store_host=self.cfg.host, store_port=self.port,
                rank=rank, world_size=len(members) + 1, timeout_s=self.cfg.timeout_s, names=self.names,
                shapes=self.shapes, dtype=self.dtype, bucket_bytes=self.bucket_bytes)

        hub.send_weight_sync(members, make)
        try:
            if self.group is None:
                self.group = wg.open_group(self.store, self.cfg.host, self.epoch, 0, len(members) + 1, self.cfg.timeout_s, self.backend)
            self.broadcast()
        except RuntimeError as e:  # gloo/NCCL raise RuntimeError (DistBackendError) on timeout or a dead peer
            self.log.error("weights.broadcast_failed", epoch=self.epoch, error=str(e))
            self.group, self.members = None, []
            return {"time/weight_sync": time.perf_counter() - t0, "weights/failed": 1.0}
        return {"time/weight_sync": time.perf_counter() - t0, "weights/members": float(len(members))}

    @torch.no_grad()
    def broadcast(self) -> None:
        wg.send_buckets(self.group, [p for _, p in self.params], self.buckets, self.torch_dtype)
