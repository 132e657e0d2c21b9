"""Long phases say where they are: a line when they begin, "still ..." while they last, one when they end.

    with phase(log, "checkpoint.save", path=str(path)):
        write(path)
    -> checkpoint.save.begin path=...
    -> checkpoint.save.still waited_s=5.0 ...       (every `every_s`, from a helper thread)
    -> checkpoint.save.done  duration_s=7.3 ...     (or .failed with the error, re-raised)

The "still" lines come from a thread, so they appear even when the phase blocks its
own thread or event loop (vLLM's engine start blocks the actor's loop). A phase that
usually takes milliseconds (a weight broadcast each step) passes `quiet=True`: its
begin/done lines are debug, unless it ran long enough to print a "still" line, and so
is its failed line: its caller reports a failure in its own words (weights.attempt_failed).

A run of many steps says how far it is and how long it has left: `Eta` (the learner's
`learner.step` line reads `step=5/100 eta=1m23s` on the console; protocol/logs.py renders it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def phase(log: Any, name: str, every_s: float = 5.0, quiet: bool = False, **fields: Any) -> Iterator[None]:
    t0 = time.perf_counter()
    done = threading.Event()
    slow = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            slow.set()
            log.info(f"{name}.still", waited_s=round(time.perf_counter() - t0, 1), **fields)

    (log.debug if quiet else log.info)(f"{name}.begin", **fields)
    ticker = threading.Thread(target=tick, name=f"progress-{name}", daemon=True)
    ticker.start()
    try:
        yield
    except BaseException as e:
        done.set()
        failed = log.warning if slow.is_set() or not quiet else log.debug
        failed(f"{name}.failed", duration_s=round(time.perf_counter() - t0, 3), error=f"{type(e).__name__}: {e}", **fields)
        raise
    finally:
        done.set()
        ticker.join()
    (log.info if slow.is_set() or not quiet else log.debug)(f"{name}.done", duration_s=round(time.perf_counter() - t0, 3), **fields)


class Eta:
    """Time left in a run of `total` steps, from the pace since the first step this process finished.

    The first step is left out of the pace: it includes the fleet's start (engines loading, the first weight
    sync), which would inflate every later estimate. A resumed run counts from its own first step.
    """

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total, self.clock = total, clock
        self.first: tuple[int, float] | None = None  # (steps done, time) when the first step here finished

    def update(self, done: int) -> float | None:
        """Seconds left after `done` steps, or None until the pace is known (the first step here)."""
        now = self.clock()
        if self.first is None:
            self.first = (done, now)
            return None
        steps = done - self.first[0]
        if steps <= 0:
            return None
        return (now - self.first[1]) / steps * max(0, self.total - done)
