"""Reward worker processes, driven from the actor's event loop without blocking it.

    score(contexts) -> one task per completion: take an idle worker -> send the context -> await its answer
                       (the connection's fd readable, rollout.reward_timeout_s at most) -> give the worker back
    timeout / dead worker / cancelled: kill it, start a replacement in the background, score 0 with an error

A worker runs one call at a time, so a call stuck in an infinite loop holds only its worker; killing it is
the only way to stop Python code that never returns (a thread cannot be interrupted), so each worker is a
process. The replacement loads the reward again before it takes work; until then the pool is a worker
short. If a replacement cannot start, the pool is broken: score() raises and the actor stops, since every
later group would wait forever for a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from actors.rewards.base import Outcome, RewardContext

START_TIMEOUT_S = 60.0  # a worker that has not loaded the reward by then is a failed start (imports can be slow)


class RewardPool:
    def __init__(self, spec: str, workers: int, timeout_s: float, on_replace: Callable[[str], None] | None = None):
        assert workers >= 1 and timeout_s > 0
        self.spec, self.size, self.timeout_s = spec, workers, timeout_s
        self.on_replace = on_replace  # called with the reason each time a worker is replaced (the actor logs it)
        self.idle: asyncio.Queue[_Worker | None] = asyncio.Queue()  # None: the pool is broken
        self.busy: set[_Worker] = set()
        self.broken: str | None = None
        self.replaced = 0  # workers killed and started again (timeouts, deaths, cancellations)
        self._starting: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Start every worker and wait until each has loaded the reward; ValueError naming rollout.reward_fn if not."""
        results = await asyncio.gather(*(_Worker.start(self.spec) for _ in range(self.size)), return_exceptions=True)
        started = [w for w in results if isinstance(w, _Worker)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for w in started:
                w.close()
            raise failed[0]
        for w in started:
            self.idle.put_nowait(w)

    async def score(self, contexts: list[RewardContext]) -> list[Outcome]:
        """One Outcome per context, in order; an error is an Outcome. Raises RuntimeError once the pool is broken."""
        return list(await asyncio.gather(*(self._score(c) for c in contexts)))

    async def _score(self, ctx: RewardContext) -> Outcome:
        worker = await self.idle.get()
        if worker is None:
            self.idle.put_nowait(None)  # for the next taker
            raise RuntimeError(f"reward pool broken: {self.broken}")
        self.busy.add(worker)
        try:
            outcome = await worker.call(ctx, self.timeout_s)
        except BaseException as e:  # cancelled mid-call (its answer would reach the next caller), or a bug: not reused
            self._replace(worker, f"call ended by {type(e).__name__}")
            raise
        if outcome.error is not None and worker.dead:
            self._replace(worker, outcome.error)
        else:
            self.busy.discard(worker)
            self.idle.put_nowait(worker)
        return outcome

    def _replace(self, worker: _Worker, why: str) -> None:
        self.busy.discard(worker)
        worker.close()
        self.replaced += 1
        if self.on_replace is not None:
            self.on_replace(why)
        task = asyncio.ensure_future(self._start_replacement())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_replacement(self) -> None:
        try:
            self.idle.put_nowait(await _Worker.start(self.spec))
        except Exception as e:  # the reward loaded before; if it cannot now, no later group can be scored
            self.broken = f"a replacement reward worker failed to start: {e}"
            self.idle.put_nowait(None)

    async def close(self) -> None:
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        while not self.idle.empty():
            worker = self.idle.get_nowait()
            if worker is not None:
                worker.close()
        for worker in list(self.busy):
            worker.close()
        self.busy.clear()


class _Worker:
    """A worker process and the parent's end of its socket pair."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self.conn = proc, conn
        self.dead = False  # killed, or found dead: never reused

    @classmethod
    async def start(cls, spec: str) -> _Worker:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "actors.rewards.worker", str(theirs.fileno()), spec],
                pass_fds=(theirs.fileno(),),
                env=_child_env(),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        worker = cls(proc, Connection(ours.detach()))
        try:
            await worker._readable(START_TIMEOUT_S)
            kind, detail = worker.conn.recv()
        except (TimeoutError, EOFError, OSError) as e:
            worker.close()
            raise RuntimeError(f"reward worker for {spec!r} did not start ({type(e).__name__}, exit code {proc.poll()})") from e
        except BaseException:  # cancelled (the pool is closing): do not leave the process behind
            worker.close()
            raise
        if kind != "ready":
            worker.close()
            raise ValueError(f"rollout.reward_fn: {detail}")  # the worker's load failed (it loaded in the actor)
        return worker

    async def _exit_code(self, within_s: float = 1.0) -> int | None:
        """The dead worker's exit code: its socket closes a moment before the process is reaped, so wait a little."""
        deadline = time.monotonic() + within_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.proc.poll()

    async def call(self, ctx: RewardContext, timeout_s: float) -> Outcome:
        try:
            self.conn.send(ctx)
            await self._readable(timeout_s)
            outcome = self.conn.recv()
        except TimeoutError:
            self.dead = True
            return Outcome(0.0, {}, f"timed out after {timeout_s:g} s (worker replaced)")
        except (EOFError, OSError) as e:  # the worker died (killed, segfault, os._exit in the reward)
            self.dead = True
            return Outcome(0.0, {}, f"reward worker died ({type(e).__name__}, exit code {await self._exit_code()})")
        assert isinstance(outcome, Outcome), f"reward worker sent {type(outcome).__name__}"
        return outcome

    async def _readable(self, timeout_s: float) -> None:
        """Wait, without blocking the loop, until the worker's answer (or its death: EOF) can be read."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, _set_once, ready)
        try:
            await asyncio.wait_for(ready, timeout_s)
        finally:
            loop.remove_reader(fd)

    def close(self) -> None:
        """Kill the process (a hung call never returns) and reap it; close our end."""
        self.dead = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


def _set_once(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _child_env() -> dict[str, str]:
    """The actor's import path, so the worker finds `actors` and the user's reward module wherever it was started."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p or os.getcwd() for p in sys.path))
    return env
