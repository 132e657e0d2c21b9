"""An actor's side of the weight group: join the epoch a WeightSync names, receive its buckets, load them.

Runs in vLLM's worker process (actors/worker_ext.py hands it the model's `load_weights`, and
this worker's own rank); nothing here needs vLLM, so tests drive it in plain processes.

Where the buckets land is the group's choice (WeightSync.backend, protocol/weights.py): NCCL
writes them into a buffer on this worker's GPU (its current CUDA device, set by vLLM), gloo
into host memory (pinned beside a GPU). load_weights copies from there into the parameters.

A failure is reported (WeightsReceived.error, protocol/worker_rpc.py), never raised, and leaves no group behind: the learner forms a new
epoch and sends again. Whatever ends a receive, it ends soon (protocol/abortable.py):
- the learner gave the epoch up (a member died): its `abort` key is set; seen within `poll_s`;
- a peer closed its connection (gloo raises at once), or the weight store is gone (the learner died);
- nothing arrives for `timeout_s`.
`buckets_loaded` > 0 in a failure means the model now holds parts of two versions: the caller
must not generate with it until a complete sync lands (actors/engine.py keeps the engine paused).
A receive that completes but whose epoch was given up meanwhile counts as failed too: after
giving up, the learner lets the optimizer write the parameters, and an abandoned send can
still deliver those torn bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from protocol import weights as wg
from protocol.abortable import Abortable, Aborted, Graveyard, abort_key, joined_key
from protocol.messages import WeightSync
from protocol.net import local_addr_towards
from protocol.worker_rpc import WeightsReceived

Load = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    def __init__(self, poll_s: float = 0.05, local: torch.device | None = None):
        self.poll_s = poll_s
        self.local = local or wg.local_device()  # this worker's own device: where an NCCL group's buffer goes
        self.group: dist.ProcessGroup | None = None
        self.joined: tuple[str, int, int] | None = (
            None  # (store host, port, epoch) of `group`: a restarted learner counts epochs from 1 again
        )
        self.backend = "gloo"  # of `group`
        self.control: dist.TCPStore | None = None  # our own store client for the joined/abort keys (see protocol/abortable.py)
        self.control_at: tuple[str, int] | None = None
        self.buffer: torch.Tensor | None = None  # one landing buffer kept across syncs (fresh memory page-faults on first touch)
        self.graveyard = Graveyard()
        self.build_store = wg.BuildStore()  # the store client group builds use, reused while free

    def receive(self, sync: WeightSync, rank: int, load: Load) -> WeightsReceived:
        """Join `sync.group_epoch` as `rank` if it is new, receive every bucket into `load`; a failure comes back as
        its `error`."""
        t0 = time.perf_counter()
        epoch, loaded = sync.group_epoch, 0
        try:
            control = self._control(sync)
            waits = Abortable(
                should_abort=lambda: _given_up(control, epoch), timeout_s=sync.timeout_s, graveyard=self.graveyard, poll_s=self.poll_s
            )
            if (why := waits.should_abort()) is not None:  # queued behind a sync that failed: the epoch is already over
                raise Aborted(f"epoch {epoch}: {why}")
            group = self._join(sync, rank, control, waits)
            t_join = time.perf_counter()
            dtype, backend = wg.DTYPES[sync.dtype], sync.backend
            need = wg.landing_numel(sync.shapes, dtype, sync.bucket_bytes)
            device = wg.group_device(backend, self.local)
            buf = self.buffer
            if buf is None or buf.dtype != dtype or buf.numel() < need or buf.device != device:
                self.buffer = buf = None  # freed before the new one is made: both may not fit on the GPU
                self.buffer = wg.landing_buffer(need, dtype, backend, self.local)
            for pairs in wg.receive_buckets(
                group,
                sync.names,
                sync.shapes,
                dtype,
                sync.bucket_bytes,
                self.buffer,
                waits=waits,
                backend=backend,
                local=self.local,
            ):
                load(pairs)  # on CUDA its copies are queued on the current stream; NCCL's next write into the slot waits for them
                loaded += 1
            if self.local.type == "cuda":
                # The last bucket's copies into the parameters are queued, not done: the engine may run them on
                # another stream next, so they finish here (an error in them surfaces here too).
                torch.cuda.current_stream(self.local).synchronize()
            if (why := waits.should_abort()) is not None:
                raise Aborted(f"epoch {epoch} given up after the last bucket arrived (it may be torn): {why}")
        except RuntimeError as e:  # Aborted; the backend's DistBackendError (peer gone, timeout); DistStoreError (learner gone)
            self.leave(drop_store=not isinstance(e, Aborted))
            first_line = (str(e).splitlines() or [type(e).__name__])[0]
            return WeightsReceived.failure(first_line[:500], loaded, time.perf_counter() - t0)
        return WeightsReceived(join_s=t_join - t0, recv_load_s=time.perf_counter() - t_join)

    def leave(self, drop_store: bool = False) -> None:
        """Drop the group (its abandoned operations live on in the graveyard) and the landing buffer they may still write."""
        if self.group is not None:
            wg.close_group(self.group, self.backend)
        self.group, self.joined, self.buffer = None, None, None
        if drop_store:
            self.control, self.control_at = None, None
            self.build_store = wg.BuildStore()  # its free client may be connected to a store that is gone
        self.graveyard.prune()

    def _control(self, sync: WeightSync) -> dist.TCPStore:
        at = (sync.store_host, sync.store_port)
        if self.control is None or self.control_at != at:
            self.control = wg.open_store(at[0], at[1], is_master=False, timeout_s=sync.timeout_s)
            self.control_at = at
        return self.control

    def _join(self, sync: WeightSync, rank: int, control: dist.TCPStore, waits: Abortable) -> dist.ProcessGroup:
        host, port, epoch = sync.store_host, sync.store_port, sync.group_epoch
        if self.group is not None and self.joined == (host, port, epoch):
            return self.group
        backend = sync.backend  # the learner's choice for this epoch: every rank must agree
        # Resolved here, before saying "joined" (a rank that cannot take part must not), and on this thread: the join
        # thread has a current CUDA device of its own.
        device = wg.group_device(backend, self.local)
        self.leave()
        control.set(joined_key(epoch, rank), "1")
        bind = local_addr_towards(host, port)

        def build(made: Callable[[dist.ProcessGroup], None]) -> dist.ProcessGroup:
            # A store client of its own (not `control`): gloo's rendezvous blocks in it while a member is missing.
            with self.build_store.client(host, port, sync.timeout_s) as store:
                return wg.open_group(store, bind, epoch, rank, sync.world_size, sync.timeout_s, backend, device, made, sync.lazy)

        self.group = waits.build(build, lambda group: wg.close_group(group, backend))
        self.joined, self.backend = (host, port, epoch), backend
        return self.group


def _given_up(control: dist.TCPStore, epoch: int) -> str | None:
    try:
        if control.check([abort_key(epoch)]):
            return f"the learner gave epoch {epoch} up ({control.get(abort_key(epoch)).decode(errors='replace')})"
    except RuntimeError as e:  # DistStoreError / DistNetworkError: the learner's store is gone
        return f"weight store unreachable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return None
