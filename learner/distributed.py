"""The learner group's layout: data-parallel (DP) x sequence-parallel (SP) ranks.

    world = DP x SP ranks, consecutive ranks share a sequence:
        SP group of rank r: [r - r % SP, ..., r - r % SP + SP - 1]      (ring attention runs here)
        DP group of rank r: [r % SP, r % SP + SP, ...]                  (one rank per SP group)
    rank 0 runs the hub and hands each DP rank its share of every rollout batch; the SP
    peers of a DP rank get the same share and split each packed sequence between them.

Launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the environment) or, for a lone
process, with a local rendezvous made here. gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Topology:
    rank: int
    world: int
    sp_size: int
    dp_size: int
    dp_rank: int
    sp_rank: int
    sp_group: dist.ProcessGroup | None  # None when sp_size == 1
    dp_group: dist.ProcessGroup | None  # None when dp_size == world (the default group serves)
    device: torch.device

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def init_distributed() -> None:
    """Join (or, for a lone process, create) the learner's default process group."""
    import deepspeed

    if "RANK" not in os.environ:
        from protocol.net import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


def make_topology(sp_size: int) -> Topology:
    """Build the SP and DP groups. Collective: every rank calls it, in the same order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % sp_size:
        raise ValueError(f"train.sequence_parallel_size: {sp_size} does not divide the {world} learner ranks")
    dp_size = world // sp_size
    sp_group = dp_group = None
    if sp_size > 1:  # new_group is collective over the default group: create every group on every rank
        for start in range(0, world, sp_size):
            group = dist.new_group(list(range(start, start + sp_size)))
            if start <= rank < start + sp_size:
                sp_group = group
        for offset in range(sp_size):
            group = dist.new_group(list(range(offset, world, sp_size)))
            if rank % sp_size == offset:
                dp_group = group
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Topology(rank=rank, world=world, sp_size=sp_size, dp_size=dp_size, dp_rank=rank // sp_size,
                    sp_rank=rank % sp_size, sp_group=sp_group, dp_group=dp_group, device=device)
