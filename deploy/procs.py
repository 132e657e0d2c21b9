"""Child processes in their own process groups, stopped as groups: the launcher, the benchmarks' fleets and
the network-namespace tests start and stop the learner and actors the same way.

    spawn(argv)  ->  a new session: the child and everything it starts (torchrun's ranks, vLLM's
                     engine-core and workers) share one process group
    stop(procs)  ->  SIGTERM to each group, GRACE_S to exit, then SIGKILL to each group (it also reaps
                     what a child left behind in its group), then reap the children
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
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
