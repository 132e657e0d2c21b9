"""Where the weight sender reads the policy, on every learner rank, whatever the ZeRO stage.

    ZeRO <= 2   rank 0 holds every parameter: the sender reads them in place, and the next
                optimizer step waits until a broadcast has read them (WeightSender.guard).
    ZeRO-3      the parameters are sharded: each sync gathers them bucket by bucket, on every
                rank at once (collective), into rank 0's snapshot; the other ranks join the
                same gathers with `follow()`, at start and after each update.

One object owns the choice, and the export (gathers, snapshots) with it, so the rank loops
(learner/main.py, learner/root.py) and the trainer never branch on the ZeRO stage for the weights.
It reads the DeepSpeed engine's module and optimizer; it knows nothing of the update.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from learner.train.distributed import Topology
from learner.weights.sync import Snapshot, WeightSender
from protocol import weights as wg
from protocol.config import Config


class WeightSource:
    def __init__(self, cfg: Config, engine: Any, topo: Topology):
        """`engine`: the policy's DeepSpeed engine (its `module` and `optimizer`)."""
        self.engine, self.topo = engine, topo
        self.sharded = cfg.train.zero_stage == 3
        self.host = cfg.weights.snapshot == "host"  # rank 0's snapshot in pinned host memory, not on its device
        self.dtype = wg.DTYPES[cfg.model.dtype]
        named = list(engine.module.named_parameters())
        self.names = [n for n, _ in named]
        self.params: list[torch.nn.Parameter] = [p for _, p in named]
        # Unsharded shapes: ZeRO-3 leaves an empty placeholder in `.shape` and the real one in `.ds_shape`.
        self.shapes = [list(getattr(p, "ds_shape", p.shape)) for p in self.params]
        self.buckets = wg.plan_buckets(self.shapes, self.dtype.itemsize, cfg.weights.bucket_mb << 20)
        self._flats: list[torch.Tensor] | None = None  # this source's own snapshot (`take`), reused

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def sender(self, cfg: Config) -> WeightSender:
        """Rank 0's sender, reading the parameters in place or through the snapshot (see `sender_snapshot`)."""
        params: list[torch.Tensor] | None = None if self.sharded else list(self.params)
        sender = WeightSender(cfg.weights, self.names, self.shapes, cfg.model.dtype, params=params, device=self.topo.device)
        assert sender.ranges == self.buckets, "the sender's buckets and the followers' gathers must match"
        if not self.sharded:
            sender.guard(self.engine.optimizer)
        return sender

    @property
    def sender_snapshot(self) -> Snapshot | None:
        """Rank 0's side of the gather, for WeightSender.start and sync; None when the sender reads in place."""
        if not self.sharded:
            return None
        return lambda out: self.snapshot(out)

    def follow(self) -> None:
        """Ranks 1..N-1: join rank 0's snapshot (at start, and after each update); nothing to do unless sharded."""
        if self.sharded:
            self.snapshot(None)

    def take(self) -> list[torch.Tensor] | None:
        """Collective on every stage: the weights copied into this source's own buckets (rank 0's; None elsewhere).
        For drivers and benchmarks that read the weights a run would send."""
        self._flats = self.snapshot(self._flats)
        return self._flats

    @contextlib.contextmanager
    def gathered(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """Collective under ZeRO-3: the full values of `params` on every rank inside the block."""
        if self.sharded:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                yield
        else:
            yield

    def snapshot(self, out: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Collective: rank 0 copies the weights into one flat tensor per bucket (reusing `out`); others join the gathers.

        The buffers are on this rank's device, so on GPUs the weight group sends from GPU memory with no trip
        through the host (learner/weights/sync.py); weights.snapshot = "host" keeps them in pinned host memory
        instead (a model whose full weights do not fit beside training). ZeRO-3 gathers one bucket at a time: no
        rank holds more than a bucket of full parameters beyond its shard, but rank 0 keeps the whole snapshot
        until the next sync.
        """
        device = torch.device("cpu") if self.host else self.topo.device
        if self.topo.is_root and out is None:
            pin = device.type == "cpu" and self.topo.device.type == "cuda"
            out = [
                torch.empty(sum(math.prod(self.shapes[i]) for i in b), dtype=self.dtype, device=device, pin_memory=pin)
                for b in self.buckets
            ]
        for k, bucket in enumerate(self.buckets):
            chunk = [self.params[i] for i in bucket]
            with self.gathered(chunk), torch.no_grad():
                if self.topo.is_root:
                    assert out is not None and out[k].device == device, f"snapshot buffer {k} not on {device}"
                    flat = [p.detach().reshape(-1).to(self.dtype) for p in chunk]
                    if flat[0].device == device:
                        torch.cat(flat, out=out[k])
                    else:  # to host memory: one device-to-host copy per bucket
                        out[k].copy_(torch.cat(flat))
        return out if self.topo.is_root else None
