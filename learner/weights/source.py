"""Where the weight sender reads the policy, on every learner rank, whatever the ZeRO stage.

    ZeRO <= 2   rank 0 holds every parameter: the sender reads them in place, and the next
                optimizer step waits until a broadcast has read them (WeightSender.guard).
    ZeRO-3      the parameters are sharded: each sync gathers them bucket by bucket, on every
                rank at once (collective), into rank 0's snapshot; the other ranks join the
                same gathers with `follow()`, at start and after each update.

One object owns the choice, so the rank loops (learner/main.py) and the trainer never branch on
the ZeRO stage for the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from learner.weights.sync import Snapshot, WeightSender
from protocol import weights as wg
from protocol.config import Config

if TYPE_CHECKING:
    from learner.train.trainer import Trainer


class WeightSource:
    def __init__(self, cfg: Config, trainer: Trainer):
        self.trainer = trainer
        self.sharded = cfg.train.zero_stage == 3
        self.host = cfg.weights.snapshot == "host"  # rank 0's snapshot in pinned host memory, not on its device
        self.dtype = wg.DTYPES[cfg.model.dtype]
        self.buckets = wg.plan_buckets(trainer.full_shapes(), self.dtype.itemsize, cfg.weights.bucket_mb << 20)

    def sender(self, cfg: Config) -> WeightSender:
        """Rank 0's sender, reading the parameters in place or through the snapshot (see `snapshot`)."""
        names = [n for n, _ in self.trainer.named_parameters()]
        params: list[torch.Tensor] | None = None if self.sharded else [p for _, p in self.trainer.named_parameters()]
        sender = WeightSender(
            cfg.weights, names, self.trainer.full_shapes(), cfg.model.dtype, params=params, device=self.trainer.topo.device
        )
        assert sender.ranges == self.buckets, "the sender's buckets and the followers' gathers must match"
        if not self.sharded:
            sender.guard(self.trainer.engine.optimizer)
        return sender

    @property
    def snapshot(self) -> Snapshot | None:
        """Rank 0's side of the gather, for WeightSender.start and sync; None when the sender reads in place."""
        if not self.sharded:
            return None
        return lambda out: self.trainer.snapshot(self.buckets, self.dtype, out, self.host)

    def follow(self) -> None:
        """Ranks 1..N-1: join rank 0's snapshot (at start, and after each update); nothing to do unless sharded."""
        if self.sharded:
            self.trainer.snapshot(self.buckets, self.dtype, None)
