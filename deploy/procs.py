"""Child processes in their own process groups, stopped as groups: the launcher, the benchmarks' fleets and
the network-namespace tests start and stop the learner and actors the same way.

    spawn(argv)  ->  a new session: the child and everything it starts (torchrun's ranks, vLLM's
                     engine-core and workers) share one process group
    stop(procs)  ->  SIGTERM to each group, GRACE_S to exit, then SIGKILL to each group (it also reaps
                     what a child left behind in its group), then reap the children
    run_capped(argv, timeout_s)  ->  run to the end with output captured, or SIGKILL the whole group at the
                     limit: a test's or a benchmark's child (torchrun and its ranks) never outlives its time
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GRACE_S = 20.0  # how long a child gets to exit after SIGTERM before SIGKILL


def path_with(root: str | Path) -> str:
    """PYTHONPATH for a child that must import from `root` too: `root` first, then what this process was given
    (packages installed with --target, as on a machine the project is carried to, are found only through it)."""
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


def spawn(argv: list[str], env: dict[str, str] | None = None, log: Path | None = None, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start `argv` in its own process group, with `env` added to this environment; its output appended to `log`
    (default: inherited)."""
    full = {**os.environ, **(env or {})}
    if log is None:
        return subprocess.Popen(argv, env=full, cwd=cwd, start_new_session=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(argv, env=full, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def signal_group(p: subprocess.Popen, sig: int) -> None:
    """`sig` to `p`'s whole process group; nothing if it is gone."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(procs: Iterable[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM every group still running, wait up to `grace_s` in all, SIGKILL every group, reap."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        signal_group(p, signal.SIGKILL)  # also engine processes left in the group
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@dataclass(frozen=True, slots=True)
class Ran:
    returncode: int | None  # None: it ran out of time and its process group was killed
    stdout: str
    stderr: str  # everything it wrote, up to the kill when it ran out of time


def run_capped(argv: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> Ran:
    """Run `argv` (with exactly `env`, default this environment) in its own process group until it exits or
    `timeout_s` passes; then SIGKILL the whole group. subprocess.run's own timeout kills only the child: torchrun's
    ranks would live on, holding their GPU and a communicator the next test could meet."""
    p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
        return Ran(p.returncode, out, err)
    except subprocess.TimeoutExpired:
        signal_group(p, signal.SIGKILL)
    try:
        out, err = p.communicate(timeout=10)  # the pipes close once the group is dead
    except subprocess.TimeoutExpired:  # something left the group and holds them: what was written is lost
        p.kill()
        out, err = "", ""
    return Ran(None, out, err)
