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

import atexit
import ipaddress
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

from learner.build_locks import clear_stale_build_locks
from protocol.net import interface_with, local_addr_towards


@dataclass(frozen=True, slots=True)
class Topology:
    rank: int
    world: int
    sp_size: int
    dp_size: int
    dp_rank: int
    sp_rank: int
    sp_group: dist.ProcessGroup | None  # None when sp_size == 1
    mpu: Any  # DeepSpeed's sequence-parallel state (for deepspeed.initialize(mpu=...)); None when sp_size == 1
    device: torch.device

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def init_distributed() -> None:
    """Join (or, for a lone process, create) the learner's default process group.

    The groups are destroyed at interpreter exit (atexit), before Python's own teardown. Left to that
    teardown, gloo sometimes killed a rank that had finished cleanly ("terminate called without an active
    exception", SIGABRT), and torchrun reported the run failed: the learner's ranks, the test drivers. It still
    did now and then (other references keep a group's backend alive): a finished rank ends with `exit_process`.
    """
    import deepspeed

    if "RANK" not in os.environ:
        from protocol.net import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    clear_stale_build_locks(structlog.get_logger())  # else a build killed earlier hangs DeepSpeed's op loading
    if not torch.cuda.is_available():
        bind_gloo_towards_master()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    atexit.register(_destroy_groups)


def bind_gloo_towards_master() -> None:
    """GLOO_SOCKET_IFNAME = the interface on this node's route to MASTER_ADDR, unless set or the master is on
    loopback (every rank on this machine: gloo's own choice works, and nothing is written that the processes this
    one starts would inherit).

    Left unset, gloo binds to the address this node's hostname resolves to, and where the hostname does not
    resolve (no DNS entry for a compute node's name) it falls back to loopback: every rank then advertises
    127.0.0.1, and a group across nodes fails with "connection refused" (seen under Slurm, learner on two nodes).
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    master, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    log = structlog.get_logger()
    try:
        local = local_addr_towards(master, port)
    except OSError as e:  # a name that does not resolve, no route: gloo's own choice, and its error if that fails
        log.warning("learner.gloo_interface_unknown", master_addr=master, error=str(e))
        return
    if ipaddress.ip_address(local).is_loopback:
        return
    if (name := interface_with(local)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("learner.gloo_interface", interface=name, address=local, master_addr=master)


def _destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a learner rank's process, its work done, without the interpreter's own teardown: the exit handlers run
    (the process groups are destroyed, logs flushed), then the streams are flushed and the process exits `code`.

    destroy_process_group drops only torch's own references to a group; DeepSpeed's engine holds others, so the
    backend lives on until the interpreter's teardown, and gloo there sometimes aborts a rank that had finished
    cleanly ("terminate called without an active exception", SIGABRT: a resumed 2-rank learner in CI, after its
    last checkpoint). Returns, for a normal exit, if a thread that is not a daemon still runs (Python would wait
    for it) or if this process is not a learner rank (no process group: a test calling in).
    """
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if not dist.is_initialized() or others:
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a reader that has gone: nothing more to say there
            pass
    os._exit(code)


def make_topology(sp_size: int) -> Topology:
    """Build the SP groups (DeepSpeed's own, consecutive ranks). Collective: every rank calls it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % sp_size:
        raise ValueError(f"train.sequence_parallel_size: {sp_size} does not divide the {world} learner ranks")
    sp_group = mpu = None
    if sp_size > 1:
        from learner.train.sequence_parallel import init_sequence_parallel

        # DeepSpeed then sums gradients over SP peers and averages over the data-parallel replicas.
        mpu = init_sequence_parallel(sp_size)
        sp_group = mpu.get_sequence_parallel_group()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return Topology(
        rank=rank,
        world=world,
        sp_size=sp_size,
        dp_size=world // sp_size,
        dp_rank=rank // sp_size,
        sp_rank=rank % sp_size,
        sp_group=sp_group,
        mpu=mpu,
        device=device,
    )
