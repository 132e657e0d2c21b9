"""Weight-group waits that a dead or hung member cannot stretch to the timeout.

How gloo fails (torch 2.13; tests/integration/test_weight_death.py runs each case): a broadcast to a member that
was SIGKILLed fails at once on the sender ("Connection closed by peer"), but the
other receivers keep waiting for their data until `weights.timeout_s`; a member that
is alive but stuck (SIGSTOP, a wedged worker) blocks the sender until the timeout.
`ProcessGroupGloo.abort()` and `shutdown()` return at once and release neither wait,
and destroying a group with an operation in flight blocks in its destructor until
that operation ends. A blocking TCPStore `get` holds the store client's lock, so
another call on the same client waits behind it.

So nothing here waits inside gloo or on a shared store client:
- every wait is on an Event set by the operation's completion, re-checked against
  `should_abort` every `poll_s`; an aborted operation is abandoned, not cancelled.
  gloo finishes it (or times it out) on its own thread, so the group and the tensor
  stay referenced in a `Graveyard` until then: neither may be reused meanwhile;
- a blocking call (building a group: gloo's rendezvous, NCCL's communicator init) runs on a
  helper thread with its own store client, and is abandoned the same way (`Abortable.build`
  aborts an NCCL group it made meanwhile).

How NCCL differs (read from torch's ProcessGroupNCCL; not run on this machine):
- its Work's future is marked done when the kernel is enqueued, not when it has run (torch
  documents `Future.done()` so for CUDA tensors), and `Work.wait()` only makes the current
  stream wait for NCCL's stream: neither says the bytes have arrived. So a broadcast here
  waits on a CUDA event recorded after it (on a side stream, so the caller's stream is not
  held behind it), synchronised on a helper thread that sets the same kind of Event as
  gloo's callback; a receiver's load_weights therefore reads a complete bucket, and a
  sender's buffer may be written again once the wait returns;
- `abort()` works (ncclCommAbort): the stuck kernel ends, the event completes, the helper
  thread returns. An abandoned NCCL broadcast is aborted, where gloo's is left to time out;
- a group that fails a collective would take the whole process down from torch's watchdog
  thread by default; protocol/weights.py builds ours so that it fails the work instead;
- a communicator init (ncclCommInitRank, blocking) waits for every rank, for as long as NCCL's
  bootstrap allows. Given up, its group is aborted (`Abortable.build`), which frees what torch
  registered of it; the init's own thread may stay blocked until NCCL gives up, holding the group.

Buckets are pipelined (`Abortable.pipeline`): up to IN_FLIGHT broadcasts are started before the host
waits for the oldest, so the next bucket is on the wire while the host waits; one at a time, the
link would sit idle for a host round trip per bucket. Each broadcast in flight owns its buffer on
every rank (rank 0's staging buffer, a receiver's landing slot) until its wait has returned.

Each group epoch has two keys of our own in the store, beside gloo's:
  joined/<rank>  set by a member just before it builds the group: rank 0 can name who never came;
  abort          set by rank 0 when it gives the epoch up: members stop waiting, drop the group, and
                 discard what they received (it may be torn: rank 0 lets the optimizer write the
                 parameters once it has given up, and an abandoned send can still deliver later).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# Broadcasts of one epoch started before the host waits for the oldest. Two keep the link busy through each host wait;
# each costs a bucket-sized buffer on every rank (weights.bucket_mb), so more would buy memory, not overlap.
IN_FLIGHT = 2


class Aborted(RuntimeError):
    """A weight-group wait was given up: a member is gone, rank 0 gave the epoch up, or the deadline passed."""


def epoch_key(epoch: int, name: str) -> str:
    """A key of group epoch `epoch` in the weight store (beside gloo's own, which live under the same prefix)."""
    return f"fleetrl-weights/epoch-{epoch}/{name}"


def joined_key(epoch: int, rank: int) -> str:
    return epoch_key(epoch, f"joined/{rank}")


def abort_key(epoch: int) -> str:
    return epoch_key(epoch, "abort")


@dataclass(slots=True)
class Graveyard:
    """Abandoned operations and what they hold, kept until the backend is done with them.

    Dropping the last reference to a group with an operation in flight would block the
    dropping thread in the group's destructor until that operation times out.
    """

    _graves: list[tuple[Any, threading.Event]] = field(default_factory=list)

    def keep(self, holding: Any, done: threading.Event) -> None:
        """Hold `holding` until `done` is set (the abandoned operation ended, one way or another)."""
        self._graves.append((holding, done))
        self.prune()

    def prune(self) -> None:
        self._graves = [(h, d) for h, d in self._graves if not d.is_set()]

    def __len__(self) -> int:
        return len(self._graves)


@dataclass(kw_only=True, slots=True)
class Abortable:
    """How one side waits on a weight-group epoch: `should_abort()` names a reason to give up, or None."""

    should_abort: Callable[[], str | None]
    timeout_s: float  # a single wait fails after this long (the same bound gloo applies itself)
    graveyard: Graveyard
    poll_s: float = 0.05  # how often a long wait re-checks should_abort: the latency of an abort

    def wait(self, done: threading.Event, what: str) -> None:
        """Until `done` is set; raises Aborted when should_abort() says so or the timeout passes."""
        deadline = time.monotonic() + self.timeout_s
        while not done.wait(self.poll_s):
            why = self.should_abort()
            if why is not None:
                raise Aborted(f"{what}: {why}")
            if time.monotonic() > deadline:
                raise Aborted(f"{what}: not done after {self.timeout_s} s")

    def broadcast(self, group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
        """Broadcast from rank 0 in place, abortably; raises RuntimeError (the backend's) or Aborted.

        Returns once the bytes are in `tensor` (receiver) or out of it (sender), on the host's clock.
        """
        self.finish(self.start(group, tensor))

    def start(self, group: dist.ProcessGroup, tensor: torch.Tensor) -> InFlight:
        """Start a broadcast from rank 0 in place; `finish` waits for it. Until then `tensor` is the backend's."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        work = group.broadcast([tensor], opts)
        done = threading.Event()
        if tensor.is_cuda:  # NCCL
            # The event is recorded on a side stream: the caller's own stream is not made to wait, so what it queues
            # meanwhile (a receiver's copies out of the bucket before this one) runs beside the broadcast.
            side = torch.cuda.Stream(tensor.device)
            with torch.cuda.stream(side):
                work.wait()  # raises at once if the communicator already failed; else orders `side` after NCCL's stream
                ran = torch.cuda.Event(blocking=True)  # blocking: the helper thread sleeps in the sync, it does not spin
                ran.record(side)
            threading.Thread(target=_set_when_ran, args=(ran, tensor.device, done), name="fleetrl-nccl-wait", daemon=True).start()
        else:  # gloo completes its future when the operation has ended, data and all
            work.get_future().add_done_callback(lambda _: done.set())
        return InFlight(group=group, tensor=tensor, work=work, done=done)

    def finish(self, op: InFlight) -> None:
        """Until `op` has ended (its bytes are in or out of its tensor, on the host's clock); raises Aborted, having
        abandoned it, or the error it ended with."""
        try:
            self.wait(op.done, "broadcast")
        except Aborted:
            self.abandon(op)
            raise
        op.work.wait()  # already complete: raises the error it ended with (a peer closed the connection, NCCL's abort)

    def abandon(self, op: InFlight) -> None:
        """Give `op` up: the graveyard holds it until the backend is done with it. On NCCL the group is aborted
        (ncclCommAbort ends the kernel, else it and every stream made to wait for it would hang until the group's
        timeout); the group is dead afterwards, as the caller already assumes."""
        if op.tensor.is_cuda:
            op.group.abort()
        self.graveyard.keep((op.group, op.tensor, op.work), op.done)

    @contextlib.contextmanager
    def pipeline(self, depth: int = IN_FLIGHT) -> Iterator[Pipeline]:
        """Broadcasts with up to `depth` in flight; every one has ended when the block exits normally, and every one
        still in flight is abandoned when it exits with an error."""
        pipe = Pipeline(self, depth)
        try:
            yield pipe
            pipe.drain()
        except BaseException:  # GeneratorExit too: a receiver that stops asking for buckets
            pipe.abandon()
            raise

    def call(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` on a helper thread; raises Aborted (abandoning the thread) or whatever fn raised.

        Abandoned is all: an NCCL rendezvous (ncclCommInitRank) stays blocked on its thread until NCCL's
        own bootstrap gives up; `build` also aborts the group it is connecting.
        """
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller, who decides
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"fleetrl-{what}", daemon=True).start()
        self.wait(done, what)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def build(self, make: Callable[[Callable[[Any], None]], T], drop: Callable[[Any], None], what: str = "join") -> T:
        """`make(made)` abandonably, as `call` runs it; `make` hands `made` each object an abandoned join must
        release at once, and `drop` releases it (an NCCL group whose communicator is still connecting: its abort,
        which is local, frees what torch has registered of it instead of leaving it to NCCL's bootstrap)."""
        made = _Made(drop)
        try:
            return self.call(lambda: make(made), what)
        except Aborted:
            made.abandon()
            raise


@dataclass(kw_only=True, slots=True)
class InFlight:
    """A broadcast started and not yet waited for, with what it holds until it ends."""

    group: dist.ProcessGroup
    tensor: torch.Tensor
    work: Any  # the backend's Work
    done: threading.Event  # set when it has ended, one way or another


class Pipeline:
    """Broadcasts ended in the order they were started, at most `depth` in flight (made by `Abortable.pipeline`).

    The caller reuses a buffer only after the broadcast that used it has ended: with `depth` buffers taken in
    turn, `room()` before filling the next one (rank 0's staging), or starting the next receive only once the
    caller is done with the bucket `finish()` returned `depth` buckets earlier (a receiver's landing slots).
    """

    def __init__(self, waits: Abortable, depth: int):
        assert depth >= 1
        self.waits, self.depth = waits, depth
        self._out: deque[InFlight] = deque()

    def room(self) -> None:
        """Make room for one more: with `depth` in flight, wait for the oldest."""
        if len(self._out) == self.depth:
            self.finish()

    def start(self, group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
        assert len(self._out) < self.depth, "room() first"
        self._out.append(self.waits.start(group, tensor))

    def finish(self) -> torch.Tensor:
        """Wait for the oldest in flight; its tensor (a receiver's: the bucket that arrived)."""
        op = self._out.popleft()  # off the list first: a failed finish has already abandoned it
        self.waits.finish(op)
        return op.tensor

    def drain(self) -> None:
        while self._out:
            self.finish()

    def abandon(self) -> None:
        while self._out:
            self.waits.abandon(self._out.popleft())


class _Made:
    """What a join made so far; once it is abandoned, whatever it still makes is dropped as it appears."""

    def __init__(self, drop: Callable[[Any], None]):
        self._drop = drop
        self._lock = threading.Lock()
        self._made: list[Any] = []
        self._abandoned = False

    def __call__(self, thing: Any) -> None:
        with self._lock:
            if not self._abandoned:
                self._made.append(thing)
                return
        self._drop(thing)

    def abandon(self) -> None:
        with self._lock:
            self._abandoned, made, self._made = True, self._made, []
        for thing in made:
            self._drop(thing)


def _set_when_ran(ran: torch.cuda.Event, device: torch.device, done: threading.Event) -> None:
    try:
        # A new thread's current device is 0: without this a worker on another GPU would make a CUDA context on
        # GPU 0, taking memory from the engine that owns it.
        torch.cuda.set_device(device)
        ran.synchronize()  # returns when the kernel has run, or has been ended by an abort
    finally:
        done.set()  # work.wait() on the caller's thread then says which
