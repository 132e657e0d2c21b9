"""The micro-batch layout and the attention that matches it, both chosen once from [train].

    packing = false              padded rows [B, L]                 sdpa (transformers' own)
    packing = true               one packed row [1, N]              fleetrl_varlen
    sequence_parallel_size > 1   this rank's chunk of the row [1, n] fleetrl_ring (over the SP group)

Every layout yields a TokenBatch (learner/train/batch.py): model kwargs plus the flat
completion tokens in one order, so the loss code is the same for all three.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from learner.train.attention.hf import RING, VARLEN
from learner.train.batch import Sample, TokenBatch, make_micro_batch
from learner.train.packing import pack_samples
from learner.train.sequence_parallel import shard_packed
from protocol.config import TrainConfig

Layout = Callable[[list[Sample], int], TokenBatch]  # (samples, policy version) -> micro-batch


def attention_implementation(train: TrainConfig) -> str:
    """For `model.set_attn_implementation`, before deepspeed.initialize."""
    if train.sequence_parallel_size > 1:
        return RING
    return VARLEN if train.packing else "sdpa"


def micro_batch_layout(train: TrainConfig, sp_group: dist.ProcessGroup | None = None) -> Layout:
    """With SP, every rank of `sp_group` must get the same samples: each builds the row and keeps its chunk."""
    if train.sequence_parallel_size > 1:
        size = dist.get_world_size(sp_group) if sp_group is not None else 0
        if sp_group is None or size != train.sequence_parallel_size:
            raise ValueError(f"train.sequence_parallel_size={train.sequence_parallel_size} but the SP group has {size} ranks")
        group: dist.ProcessGroup = sp_group
        return lambda samples, version: shard_packed(pack_samples(samples, version), group)
    return pack_samples if train.packing else make_micro_batch
