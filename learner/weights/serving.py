"""The serving thread: from one sync to the next, give the current version to every live actor that lacks it.

    start(first attempt) -> run it -> whom next (SenderState.next_members) -> begin a catch-up -> run it -> ...
                            nobody: sleep until the fleet's membership changes (the listener wakes it) or stop
                            a failure no removal explains: back off (RETRY_S doubling up to RETRY_MAX_S), then retry
    stop (the next sync, or the optimizer step under guard): an attempt in flight finishes first; a catch-up
    gives up at once (SenderState.why_abort)

One attempt at a time (learner/weights/attempts.py).

On GPUs every one of the buffers it sends is on the learner's GPU and NCCL sends from there
(protocol/weights.py picks the backend per epoch from the devices the members registered).
The serving thread queues its GPU work on a stream of its own, after an event recorded on the
training thread's stream at `sync` (the snapshot's and the optimizer's writes come first), so
training kernels never queue behind a broadcast. An epoch that falls back to gloo (a member
shares the learner's GPU) copies each bucket to pinned host memory first.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from learner.weights.attempts import Attempts
from learner.weights.fleet import Fleet
from learner.weights.records import Attempt, Serving
from learner.weights.state import SenderState
from protocol.logs import get_logger

RETRY_S, RETRY_MAX_S = 0.2, 10.0  # backoff after a failure that no removal explains (yet)


def _backoff(failures: int) -> float:
    """When to try again after `failures` failures in a row that no removal explains (monotonic clock)."""
    return time.monotonic() + min(RETRY_MAX_S, RETRY_S * 2 ** (failures - 1))


class ServingThread:
    def __init__(
        self,
        attempts: Attempts,
        state: SenderState[dist.ProcessGroup],
        lock: threading.Lock,
        stop: threading.Event,
        device: torch.device,
    ):
        """`state` is shared under `lock` (with the fleet's listener); `stop` ends serving (and a catch-up in flight)."""
        self.attempts = attempts
        self.state = state
        self.lock = lock
        self.device = device
        self._stop = stop
        self._wake = threading.Event()  # membership changed, or stop
        self._thread: threading.Thread | None = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None  # recorded on the training stream at sync: what the serving stream waits for
        self.log = get_logger()

    @property
    def running(self) -> bool:
        return self._thread is not None

    # ---- training thread --------------------------------------------------------------------------
    def after_training(self) -> None:
        """At sync: the serving stream starts after everything the training stream wrote so far (the snapshot's and
        the optimizer's writes)."""
        if self._stream is not None:
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.device))

    def start(self, fleet: Fleet, serving: Serving, flats: list[torch.Tensor] | None, first: Attempt | None) -> None:
        """Serve serving.version (from `flats`, or the parameters in place when None) until `stop`, `first` first."""
        assert self._thread is None
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(fleet, serving, flats, first), name="fleetrl-weights", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (an attempt in flight finishes first, a catch-up gives up); returns when the thread has ended."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._thread = None

    # ---- fleet listener ---------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    # ---- serving thread ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """The serving thread's GPU work: on the learner's device (a new thread's current device is 0) and its own stream."""
        if self._stream is None:
            yield
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if self._ready is not None:
                self._stream.wait_event(self._ready)
            yield

    def _serve(self, fleet: Fleet, serving: Serving, flats: list[torch.Tensor] | None, attempt: Attempt | None) -> None:
        with self._on_device():
            self._loop(fleet, serving, flats, attempt)

    def _loop(self, fleet: Fleet, serving: Serving, flats: list[torch.Tensor] | None, attempt: Attempt | None) -> None:
        version = serving.version
        retry_at, unexplained = 0.0, 0
        while True:
            if attempt is not None:
                elapsed = self.attempts.run(fleet, attempt, flats)
                if elapsed is not None:
                    unexplained = 0
                    self._served(serving, attempt, elapsed)
                else:
                    serving.failed += 1
                    with self.lock:
                        explained = self.state.abort_why is not None
                    if not explained:  # e.g. gloo saw a peer close before the hub did: give the hub a moment
                        unexplained += 1
                        retry_at = _backoff(unexplained)
                attempt = None
            # Clear before looking at _stop: a stop that sets both after this check still wakes the wait below.
            self._wake.clear()
            if self._stop.is_set():
                return
            live = fleet.live_actors()
            with self.lock:
                need = self.state.next_members(version, live)
            wait_s = retry_at - time.monotonic()
            if need and wait_s <= 0:
                try:
                    attempt = self.attempts.begin(fleet, version, need, catchup=True)
                except Exception as e:  # the fleet could not send the WeightSyncs (its loop stopping, a send timed out)
                    with self.lock:
                        self.state.ended()
                    unexplained += 1
                    retry_at = _backoff(unexplained)
                    self.log.warning("weights.begin_failed", version=version, members=need, error=repr(e)[:300])
                continue
            if self._wake.wait(wait_s if need else None):
                retry_at = 0.0  # membership changed (the hub removed someone): retry now

    def _served(self, serving: Serving, att: Attempt, elapsed: float) -> None:
        if serving.broadcast_s is None:
            serving.broadcast_s = elapsed
        else:
            serving.catchups += 1
            self.log.info("weights.caught_up", version=att.version, epoch=att.epoch, members=att.members, seconds=round(elapsed, 3))
        serving.epochs.append(att.epoch)
