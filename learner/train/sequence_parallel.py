"""Sequence parallelism: one packed row split over the `train.sequence_parallel_size` ranks of an SP group.

    packed row  [ s0 s0 s0 s0 s1 s1 s1 s2 s2 s2 | pad pad ]   N padded to a multiple of P
    rank 0      [ s0 s0 s0 s0 s1 s1 ]
    rank 1      [ s1 s2 s2 s2 pad pad ]                        pads: their own segment, score nothing

Targets and score positions are fixed on the whole row before the split, so the
logit at the last position of rank r still predicts the first token of rank r + 1.
Each rank scores the completion tokens whose predicting position lies in its chunk;
position_ids stay the per-sample positions of the whole row (RoPE is unchanged).
Attention across chunks is the ring (learner/train/attention/ring.py).

Loss and gradients: rank r's loss is its tokens' share, sum / total tokens of the
whole step (the policy loss with the step's `total_tokens`, unchanged), so the SP
ranks' losses add up to the unsplit loss and their parameter gradients must be
summed over the group. DeepSpeed gets this from its own sequence-parallel hook:
`deepspeed.initialize(mpu=...)` with the mpu returned by `init_sequence_parallel`
(DeepSpeed's parallel_state_sp, the one its Ulysses/ALST path uses). DeepSpeed then
shards ZeRO state over all ranks (data x sequence) and divides the all-reduced sum
by world / sp_size: a mean over data-parallel replicas of a sum over SP peers.
Scaling the loss by sp_size and letting DeepSpeed average over every rank would
give the same numbers, but would leave a factor in the loss that every metric has
to undo. Every rank of an SP group must run forward and backward even when it
scores no token: the ring is a collective, and a rank that skips it hangs its peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from learner.train.attention.ring import RingContext
from learner.train.packing import PackedBatch


def init_sequence_parallel(sp_size: int) -> ModuleType:
    """Form the SP groups (consecutive ranks, so peers share a node) and return the mpu for deepspeed.initialize.

    Needs the default group (deepspeed.init_distributed) and world_size % sp_size == 0.
    The group this rank shares a row with is `mpu.get_sequence_parallel_group()`.
    """
    world = dist.get_world_size()
    if sp_size < 2 or world % sp_size:
        raise ValueError(f"train.sequence_parallel_size={sp_size} must be >= 2 and divide the learner's {world} ranks")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp_size)
    return parallel_state_sp


@dataclass(kw_only=True, slots=True)
class SequenceShard:
    input_ids: torch.Tensor  # int64 [1, n]: chunk `rank` of the padded row (n = N_pad / P)
    position_ids: torch.Tensor  # int64 [1, n]: per-sample positions of the whole row
    ring: RingContext  # group and whole-row cu_seqlens (pad tail included)
    tokens: slice  # which of the PackedBatch's completion tokens this rank scores (a contiguous range)
    score_rows: torch.Tensor  # int64 [T_r]: all 0
    score_cols: torch.Tensor  # int64 [T_r]: local position whose logit predicts the token
    targets: torch.Tensor  # int64 [T_r]
    behaviour_logp: torch.Tensor  # float32 [T_r]
    token_adv: torch.Tensor  # float32 [T_r]
    on_policy: torch.Tensor  # bool [T_r]
    useful: int  # positions of this chunk that hold a sample's token (the rest is SP padding)

    def model_kwargs(self) -> dict:
        """Forward kwargs for a model whose attention is "fleetrl_ring" (learner/train/attention/hf.py)."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, fleetrl_ring=self.ring)


def shard_packed(packed: PackedBatch, group: dist.ProcessGroup, pad_id: int = 0) -> SequenceShard:
    """This rank's chunk of `packed`, padded to a multiple of the group size with tokens of no sample."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    total, device = packed.input_ids.shape[1], packed.input_ids.device
    pad = -total % size
    ids = torch.cat([packed.input_ids[0], torch.full((pad,), pad_id, dtype=packed.input_ids.dtype, device=device)])
    positions = torch.cat([packed.position_ids[0], torch.arange(pad, device=device)])
    cu_seqlens = packed.cu_seqlens.cpu()
    if pad:
        cu_seqlens = torch.cat([cu_seqlens, torch.tensor([total + pad], dtype=cu_seqlens.dtype)])
    n = (total + pad) // size
    lo, hi = rank * n, (rank + 1) * n
    # score_cols ascend (samples in order, tokens in order), so this rank's tokens are one contiguous range
    t0, t1 = (int(x) for x in torch.searchsorted(packed.score_cols, torch.tensor([lo, hi], device=device)))
    cols = packed.score_cols[t0:t1] - lo
    return SequenceShard(
        input_ids=ids[lo:hi][None],
        position_ids=positions[lo:hi][None],
        ring=RingContext(group=group, cu_seqlens=cu_seqlens),
        tokens=slice(t0, t1),
        score_rows=torch.zeros_like(cols),
        score_cols=cols,
        targets=packed.targets[t0:t1],
        behaviour_logp=packed.behaviour_logp[t0:t1],
        token_adv=packed.token_adv[t0:t1],
        on_policy=packed.on_policy[t0:t1],
        useful=max(0, min(n, total - lo)),
    )
