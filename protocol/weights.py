"""The weight group: a torch.distributed process group made only for weight broadcast.

Learner rank 0 is rank 0 and hosts the TCPStore; each actor's engine worker is
one more rank. It never touches either side's default process group (the
learner's DeepSpeed group, vLLM's own). Each membership is a numbered group
epoch with its own store prefix, so a re-formed group never meets keys of an
old one.

Parameters travel as flat buckets of at most `bucket_bytes`, one broadcast per
bucket: a round trip per parameter is what makes naive syncs slow. Both sides
derive the same bucket layout from (names, shapes, dtype) with `plan_buckets`. Rank 0's
side of a bucket (which memory it is sent from) is learner/weight_buckets.py.

Failure mode: a collective with a dead member blocks until `timeout` and then
raises; the caller must treat the whole group as broken and form a new epoch.
protocol/abortable.py waits so that an abort ends that sooner, on both sides.
"""

from __future__ import annotations

import math
import socket
import typing
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def plan_buckets(shapes: list[list[int]], itemsize: int, bucket_bytes: int) -> list[range]:
    """Consecutive parameter index ranges whose bytes fit one bucket (a larger tensor gets its own)."""
    buckets: list[range] = []
    start, size = 0, 0
    for i, shape in enumerate(shapes):
        nbytes = math.prod(shape) * itemsize
        if i > start and size + nbytes > bucket_bytes:
            buckets.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if start < len(shapes):
        buckets.append(range(start, len(shapes)))
    return buckets


def split_bucket(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of `flat` with the given shapes, in order."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    assert offset == flat.numel(), f"bucket holds {flat.numel()} elements, shapes need {offset}"
    return out


def open_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store on `host` only (port 0: pick a free one; read it back from `.port`).

    TCPStore's own server listens on every interface whatever `host` says (checked with
    `ss -ltn` on torch 2.13: `*:PORT`). It has no authentication, so rank 0 binds the
    listening socket itself and hands it over (`master_listen_fd`; the store owns it then).
    """
    timeout = timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    listener = listen_socket(host, port)
    bound = listener.getsockname()[1]
    return dist.TCPStore(host, bound, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=listener.detach())


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`'s address only (IPv4 or IPv6, as `host` resolves)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(addr[:2], family=family, backlog=1024)


def open_group(
    store: dist.Store, bind_host: str, epoch: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
) -> dist.ProcessGroup:
    """Join weight-group `epoch`, with gloo bound to `bind_host` (this side's own address).

    Blocks until all `world_size` members have joined, or raises after the timeout.
    """
    prefixed = dist.PrefixStore(f"fleetrl-weights/epoch-{epoch}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return typing.cast(dist.ProcessGroup, dist.ProcessGroupNCCL(prefixed, rank, world_size, opts))
    # _Options is private torch API, but the only way to bind gloo to one address without env vars.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    # Bind gloo's transport to the given address only, not to whatever the hostname resolves to.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return typing.cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefixed, rank, world_size, opts))


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast from rank 0 in place; raises on timeout or a dead member."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def bucket_numels(shapes: list[list[int]], buckets: list[range]) -> list[int]:
    return [sum(math.prod(shapes[i]) for i in bucket) for bucket in buckets]


def landing_numel(shapes: list[list[int]], dtype: torch.dtype, bucket_bytes: int) -> int:
    """Elements of the one buffer a receiver needs: the largest bucket (a tensor above bucket_bytes is its own)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return max(bucket_numels(shapes, plan_buckets(shapes, itemsize, bucket_bytes)), default=0)


def receive_buckets(
    group: dist.ProcessGroup, names: list[str], shapes: list[list[int]], dtype: torch.dtype, bucket_bytes: int,
    buffer: torch.Tensor | None = None, bcast: Callable[[dist.ProcessGroup, torch.Tensor], None] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Other ranks: yield each received bucket as (name, tensor view) pairs, in broadcast order.

    Every bucket lands in one reused `buffer` (allocated here if missing or too small), so the
    views are valid only until the next bucket is requested: load them before asking for more.
    `bcast` receives one bucket (default `broadcast`; protocol/abortable.py's gives up on an abort).
    """
    bcast = bcast or broadcast
    itemsize = torch.tensor([], dtype=dtype).element_size()
    buckets = plan_buckets(shapes, itemsize, bucket_bytes)
    numels = bucket_numels(shapes, buckets)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < max(numels, default=0):
        buffer = torch.empty(max(numels, default=0), dtype=dtype)
    for bucket, numel in zip(buckets, numels, strict=True):
        flat = buffer[:numel]
        bcast(group, flat)
        yield list(zip([names[i] for i in bucket], split_bucket(flat, [shapes[i] for i in bucket]), strict=True))
