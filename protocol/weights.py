"""The weight group: a torch.distributed process group made only for weight broadcast.

Learner rank 0 is rank 0 and hosts the TCPStore; each actor's engine worker is
one more rank. It never touches either side's default process group (the
learner's DeepSpeed group, vLLM's own). Each membership is a numbered group
epoch with its own store prefix, so a re-formed group never meets keys of an
old one.

Parameters travel as flat buckets of at most `bucket_bytes`, one broadcast per
bucket: a round trip per parameter is what makes naive syncs slow. Both sides
derive the same bucket layout from (names, shapes, dtype) with `plan_buckets`. Rank 0's
side of a bucket (which memory it is sent from) is learner/weights/buckets.py.

Backend and device, decided here and nowhere else (`plan_group`, per group epoch, by the
learner, which names the backend in each WeightSync): NCCL when every rank is on a GPU of
its own, its tensors on each rank's GPU; gloo otherwise, its tensors in host memory. NCCL
refuses two ranks on one GPU (a learner and an actor sharing a one-GPU machine, or two
engines packed on one GPU), so such an epoch falls back to gloo through pinned host memory
(docs/architecture.md says why this and not CUDA IPC). Ranks report their GPUs at
registration (Register.devices); a member may hold several ranks, one per engine worker
(tensor parallelism): each receives every bucket and vLLM's load_weights keeps its shard.

Failure mode: a collective with a dead member blocks until `timeout` and then
raises; the caller must treat the whole group as broken and form a new epoch.
protocol/abortable.py waits so that an abort ends that sooner, on both sides.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol.abortable import IN_FLIGHT, Abortable, Graveyard
from protocol.config.fleet import GLOO_MESH_RANKS
from protocol.messages import WEIGHT_BACKENDS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU = ""  # the device identity of a rank without a GPU


def device_identity(device: torch.device) -> str:
    """What names a rank's device across processes and hosts: "cuda:<GPU UUID>", or "" (CPU).

    The UUID, not hostname + index: CUDA_VISIBLE_DEVICES renumbers GPUs per process, and two
    containers on one machine have different hostnames but the same GPUs.
    """
    if device.type != "cuda":
        return CPU
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def local_device() -> torch.device:
    """This thread's CUDA device (a vLLM worker's own: vLLM sets it at init), or the CPU without CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One group epoch's layout: rank 0 is the learner; member k holds ranks first[k] .. first[k] + counts[k] - 1."""

    backend: str  # "nccl" | "gloo"
    world_size: int
    first: tuple[int, ...]
    counts: tuple[int, ...]
    fallback: str  # why an epoch with GPUs in it runs on gloo ("" when it does not): logged by the learner
    lazy: bool = False  # gloo: connect only the pairs the broadcast uses, when first used (`open_group`)


def plan_group(learner: str, members: list[tuple[str, list[str]]], mesh_ranks: int = GLOO_MESH_RANKS) -> GroupPlan:
    """The backend and rank layout for rank 0 on device `learner` plus `members` as (actor id, device identities).

    A gloo group of more than `mesh_ranks` ranks connects lazily: each rank then holds the few connections of
    the broadcast's tree (about log2 N) instead of one to every other rank (N - 1), and forming it costs no
    N² connects (docs/architecture.md, "How large one weight group can be")."""
    first, counts, rank = [], [], 1
    owners: dict[str, list[str]] = {}  # device identity -> who has a rank on it
    if learner != CPU:
        owners[learner] = ["the learner"]
    for actor, devices in members:
        assert devices, f"{actor}: no ranks"
        first.append(rank)
        counts.append(len(devices))
        rank += len(devices)
        for i, d in enumerate(devices):
            if d != CPU:
                owners.setdefault(d, []).append(actor if len(devices) == 1 else f"{actor} worker {i}")
    identities = [learner] + [d for _, devices in members for d in devices]
    gpus = [d for d in identities if d != CPU]
    shared = {d: who for d, who in owners.items() if len(who) > 1}
    if gpus and len(gpus) == len(identities) and not shared:
        return GroupPlan(backend="nccl", world_size=rank, first=tuple(first), counts=tuple(counts), fallback="")
    why = ""
    if shared:
        why = "; ".join(f"{' and '.join(who)} share GPU {d}" for d, who in shared.items()) + " (NCCL takes one rank per GPU)"
    elif gpus:
        why = f"{len(identities) - len(gpus)} of {len(identities)} ranks are on the CPU"
    lazy = rank > mesh_ranks
    return GroupPlan(backend="gloo", world_size=rank, first=tuple(first), counts=tuple(counts), fallback=why, lazy=lazy)


def group_device(backend: str, local: torch.device) -> torch.device:
    """Where a rank's weight-group tensors live: its own GPU for NCCL (which refuses anything else:
    "Tensors must be CUDA and dense"), host memory for gloo. `local` is the rank's own device."""
    assert backend in WEIGHT_BACKENDS, backend  # WeightSync.check refuses others
    if backend == "nccl":
        if local.type != "cuda":  # the learner picked NCCL from the devices this rank registered: they disagree
            raise RuntimeError(f"the weight group uses NCCL but this rank has no GPU (it runs on {local})")
        return local
    return torch.device("cpu")


def landing_buffer(numel: int, dtype: torch.dtype, backend: str, local: torch.device) -> torch.Tensor:
    """A receiver's reused bucket buffer. On gloo beside a GPU (the shared-GPU fallback) it is pinned: the
    copy into the GPU parameters is then a DMA, not a staged copy through pageable memory."""
    device = group_device(backend, local)
    pin = device.type == "cpu" and local.type == "cuda"
    return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)


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


class BuildStore:
    """The store client group builds rendezvous on, reused from one build to the next.

    A build blocks in its client while a member is missing (gloo's rendezvous `get`, a lazy group's connect),
    holding the client's lock, and an abandoned build goes on blocking until its timeout: so a build never
    shares its client with anything else. But a client whose build has returned is free again. Opening a new
    one per build instead makes every member of a new epoch connect to rank 0's store at the same moment, a
    connect storm that takes seconds at a few hundred members (docs/benchmarks.md).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # an abandoned build may return on its own thread while the next one takes
        self._free: tuple[str, int, dist.TCPStore] | None = None

    @contextmanager
    def client(self, host: str, port: int, timeout_s: float) -> Iterator[dist.TCPStore]:
        """The free client for host:port, or a new one (a build still holding the free one keeps it). Free again
        once the block returns; a block that raises keeps it (its build may still be blocked in it)."""
        with self._lock:
            free, self._free = self._free, None
        store = free[2] if free is not None and free[:2] == (host, port) else open_store(host, port, False, timeout_s)
        yield store
        with self._lock:
            self._free = (host, port, store)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on `host`'s address only (IPv4 or IPv6, as `host` resolves)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return socket.create_server(addr[:2], family=family, backlog=1024)


def open_group(
    store: dist.Store,
    bind_host: str,
    epoch: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    backend: str = "gloo",
    device: torch.device | None = None,
    made: Callable[[dist.ProcessGroup], None] | None = None,
    lazy: bool = False,
) -> dist.ProcessGroup:
    """Join weight-group `epoch`: gloo bound to `bind_host` (this side's own address), or NCCL on `device`.

    Blocks until all `world_size` members have joined, or raises after the timeout. `made(group)` is told
    of an NCCL group as soon as it exists, before its communicator connects, so that a caller that stops
    waiting can abort it (protocol/abortable.py's `Abortable.build`); gloo's group exists only once connected.

    gloo connects every pair of ranks as the group is built, unless `lazy` (every rank must agree: the
    learner's plan_group decides). A lazy group connects a pair when an operation first uses it, and its
    constructor returns without waiting for the others. So a lazy build ends with one broadcast of a single
    element, which connects the pairs the weight broadcasts will use (gloo's broadcast is a binomial tree from
    rank 0 whatever the size), and rank 0 then waits for every member's "connected" key: "built" still means
    "connected", and a member that cannot be reached fails the join, within the join deadline, not the first
    bucket.
    """
    prefixed = dist.PrefixStore(f"fleetrl-weights/epoch-{epoch}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        assert device is not None and device.type == "cuda", f"NCCL weight group on {device}"
        return _nccl_group(prefixed, rank, world_size, timeout, device, made)
    # _Options is private torch API, but the only way to bind gloo to one address without env vars.
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    # Bind gloo's transport to the given address only, not to whatever the hostname resolves to.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host, lazy_init=lazy)]
    group = typing.cast(dist.ProcessGroup, dist.ProcessGroupGloo(prefixed, rank, world_size, opts))
    if lazy:
        broadcast(group, torch.zeros(1))
        # Rank 0's part ends once its own children hold the element, not the whole tree: it waits for every
        # member's word that its part (its parent's and its children's connections) is done too.
        if rank == 0:
            prefixed.wait([f"connected/{r}" for r in range(1, world_size)], timeout)
        else:
            prefixed.set(f"connected/{rank}", "1")
    return group


# What ProcessGroupNCCL's constructor reads from the environment, and what ours must have.
_NCCL_ENV = {
    # torch's default (3) has the group's watchdog thread take the whole process down when a collective times
    # out or NCCL reports a remote error: one member dying mid-broadcast would kill the learner and every other
    # member. 2 (CleanUpOnly) aborts the communicator and fails the work instead, which protocol/abortable.py
    # turns into a given-up epoch.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # 1 (set for DeepSpeed's groups, say) would make Work.wait() block the calling thread until the broadcast
    # has run or timed out: the serving thread would wait out weights.timeout_s for a dead member instead of
    # polling for its removal. protocol/abortable.py waits on a CUDA event instead.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}
_env_lock = threading.Lock()


def _nccl_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    device: torch.device,
    made: Callable[[dist.ProcessGroup], None] | None,
) -> dist.ProcessGroup:
    """An NCCL group that fails its operations instead of killing the process, connected before it returns.

    The environment it needs (_NCCL_ENV) is set only around the constructor, so the process's other groups
    (DeepSpeed's, vLLM's) keep theirs; the lock keeps two of ours from interleaving (setenv racing a getenv
    on another thread is the residual risk).
    """
    # Called on a join thread, whose current device is 0 (a new thread's): anything on it that touches CUDA before the
    # group's own device guard would make a context on GPU 0, taking memory from the engine or rank that owns it.
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    with _env_lock:
        before = {k: os.environ.get(k) for k in _NCCL_ENV}
        os.environ.update(_NCCL_ENV)
        try:
            group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        finally:
            for k, v in before.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    if made is not None:
        made(typing.cast(dist.ProcessGroup, group))
    # NCCL connects lazily, at the first collective, inside the broadcast call where no abort can reach it.
    # Connecting here instead puts that wait (every rank's ncclCommInitRank) on the caller's join thread, which
    # protocol/abortable.py can abandon like gloo's rendezvous. The init is blocking (torch's default): a
    # communicator torch has not yet registered cannot be aborted, so an abandoned init keeps its thread until
    # NCCL's bootstrap gives up; `made` lets the caller abort whatever torch has registered by then. (Non-blocking
    # init, which abort() could end, is not used: eager connect in that mode returns before the communicator is
    # ready, and the first broadcast would then wait for it where nothing can abort it.)
    group.eager_connect_single_device(device)
    return typing.cast(dist.ProcessGroup, group)


def close_group(group: dist.ProcessGroup, backend: str) -> None:
    """Let a group go that will not be used again (replaced by a new epoch, or given up).

    NCCL: abort() now, which is local (ncclCommAbort never waits for peers, some of which may be
    dead) and ends any kernel still stuck in it. Left to its destructor instead, torch warns and
    tears the communicator down at some later garbage collection. gloo: dropping it is enough (its
    abort() releases nothing); an operation still in flight keeps it alive from the graveyard.
    """
    if backend == "nccl":
        group.abort()


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast from rank 0 in place; raises on timeout or a dead member.

    On CUDA the work's wait() only makes the current stream wait for NCCL's; the stream sync
    after it makes "returned" mean "the bytes are there" on the host, as with gloo (a caller may
    overwrite a sent buffer next, or read a received one on another stream).
    """
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def bucket_numels(shapes: list[list[int]], buckets: list[range]) -> list[int]:
    return [sum(math.prod(shapes[i]) for i in bucket) for bucket in buckets]


def landing_numel(shapes: list[list[int]], dtype: torch.dtype, bucket_bytes: int) -> int:
    """Elements of the one buffer a receiver needs: the largest bucket (a tensor above bucket_bytes is its own)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return max(bucket_numels(shapes, plan_buckets(shapes, itemsize, bucket_bytes)), default=0)


def ring_offsets(numels: list[int], capacity: int) -> list[int]:
    """Where each bucket sits in one reused buffer of `capacity` elements: right after the bucket before, or back at
    the start when it does not fit there. A bucket then shares elements with the one before only when it wrapped
    onto it, and buffers as large as the largest tensor (the embedding) hold many ordinary buckets side by side."""
    out, at = [], 0
    for n in numels:
        assert n <= capacity, f"a bucket of {n} elements in a buffer of {capacity}"
        at = at if at + n <= capacity else 0
        out.append(at)
        at += n
    return out


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether element ranges [start, end) a and b share an element."""
    return a[0] < b[1] and b[0] < a[1]


def receive_buckets(
    group: dist.ProcessGroup,
    names: list[str],
    shapes: list[list[int]],
    dtype: torch.dtype,
    bucket_bytes: int,
    buffer: torch.Tensor | None = None,
    waits: Abortable | None = None,
    backend: str = "gloo",
    local: torch.device | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Other ranks: yield each received bucket as (name, tensor view) pairs, in broadcast order.

    The buckets land in one reused `buffer` (allocated here, on the device `backend` needs, if missing or too
    small), placed as `ring_offsets` says. A bucket is live from its receive until the caller asks for the next
    one, and a receive starts only into elements no live bucket holds: while the caller loads one bucket the next
    arrives beside it (up to IN_FLIGHT live at once), else after it. So the views are valid until the next bucket is
    requested: load them before asking for more. `waits` receives them (protocol/abortable.py: it gives up on an
    abort; by default only the group's own timeout ends a stuck receive); a bucket is yielded once its bytes are in
    the buffer, whichever stream reads them.
    """
    waits = waits or Abortable(should_abort=lambda: None, timeout_s=math.inf, graveyard=Graveyard())
    local = local or torch.device("cpu")
    itemsize = torch.tensor([], dtype=dtype).element_size()
    buckets = plan_buckets(shapes, itemsize, bucket_bytes)
    numels = bucket_numels(shapes, buckets)
    largest = max(numels, default=0)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < largest:
        buffer = landing_buffer(largest, dtype, backend, local)
    regions = [(at, at + n) for at, n in zip(ring_offsets(numels, buffer.numel()), numels, strict=True)]
    pinned_for_gpu = buffer.device.type == "cpu" and local.type == "cuda"  # the shared-GPU fallback
    live: list[int] = []  # buckets received into the buffer or on their way, the caller's first
    with waits.pipeline(IN_FLIGHT) as pipe:

        def start_what_fits(first: int) -> int:
            """Start receiving buckets from `first` on while each has room; the first not started."""
            while first < len(buckets) and len(live) < IN_FLIGHT and not any(overlap(regions[first], regions[j]) for j in live):
                pipe.start(group, buffer[regions[first][0] : regions[first][1]])
                live.append(first)
                first += 1
            return first

        nxt = start_what_fits(0)  # with nothing live, a bucket always has room: each one is started by the time it is due
        for i, bucket in enumerate(buckets):
            flat = pipe.finish()
            yield list(zip([names[j] for j in bucket], split_bucket(flat, [shapes[j] for j in bucket]), strict=True))
            # The caller is done with bucket i. NCCL's next write waits for the copies its load queued on this stream
            # (the broadcast orders NCCL's stream after it); gloo writes host memory from its own threads at once, so a
            # copy out of pinned memory that may still be running must end first.
            done = live.pop(0)
            assert done == i, (done, i)
            if pinned_for_gpu and nxt < len(buckets):
                torch.cuda.current_stream(local).synchronize()
            nxt = start_what_fits(nxt)
