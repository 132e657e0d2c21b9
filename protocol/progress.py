"""Long phases say where they are: a line when they begin, "still ..." while they last, one when they end.

    with phase(log, "checkpoint.save", path=str(path)):
        write(path)
    -> checkpoint.save.begin path=...
    -> checkpoint.save.still waited_s=5.0 ...       (every `every_s`, from a helper thread)
    -> checkpoint.save.done  duration_s=7.3 ...     (or .failed with the error, re-raised)

The "still" lines come from a thread, so they appear even when the phase blocks its
own thread or event loop (vLLM's engine start blocks the actor's loop). A phase that
usually takes milliseconds (a weight broadcast each step) passes `quiet=True`: its
begin/done lines are debug, unless it ran long enough to print a "still" line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
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
        log.warning(f"{name}.failed", duration_s=round(time.perf_counter() - t0, 3), error=f"{type(e).__name__}: {e}", **fields)
        raise
    finally:
        done.set()
        ticker.join()
    (log.info if slow.is_set() or not quiet else log.debug)(f"{name}.done", duration_s=round(time.perf_counter() - t0, 3), **fields)
