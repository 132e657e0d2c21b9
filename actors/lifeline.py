"""Everything an actor starts ends with it, however the actor ends; a stop signal ends the actor within a bound.

Dying with the actor. vLLM's engine core (and each worker, when it has processes of its own) is a
multiprocessing child of the actor, and nothing in vLLM 0.32 ends an engine core whose front end died: it
waits on its sockets, holding its memory (a GPU's, on a GPU node), until someone kills it. SIGKILL and the
OOM killer leave the actor no moment to clean up, so each child asks the kernel itself to SIGKILL it when its
parent dies (prctl PR_SET_PDEATHSIG), as early as it runs FleetRL code (`attach`):
- `root()`, in the actor before it starts anything, exports FLEETRL_LIFELINE=<actor pid>, which every
  descendant inherits, and makes every child forked from a main thread attach (CUDA vLLM forks its engine core).
- A child that multiprocessing spawns (vLLM's CPU build always spawns) first runs its parent's main module, as
  `__mp_main__`: deploy/cli.py attaches at import, before vLLM's code runs. actors/worker_ext.py, which every
  process hosting a vLLM worker imports, attaches too (an actor run from another main module), and so does
  each reward worker (actors/rewards/worker.py).
The signal passes down the tree: a worker dies with its engine core, the engine core with the actor.

How it fails:
- The kernel sends the signal when the parent *thread* that started the child ends. The engine core is started
  from the actor's main thread (actors/engine.py asserts it), vLLM's workers from the engine core's. A child
  forked from any other thread does not attach: that thread's end would kill it.
- A child whose parent died before it attached never gets the signal, so `attach` then checks that the actor is
  still among its ancestors, and kills itself if not.
- An actor run from another main module than deploy/cli.py (in-process, say) has a spawned engine core attach
  only when it hosts the worker (worker_ext). One without (CPU `actor.worker_in_engine = false`, or CUDA tensor
  parallelism when vLLM spawns) outlives that actor, and its workers with it.
- Linux only (prctl): elsewhere `attach` does nothing.

Stopping (`stop_on_signals`). SIGTERM or SIGINT asks the actor to stop cleanly, and a thread ends it `grace_s`
later if it has not: SIGKILL to every descendant, then exit 128 + the signal. A SIGINT on top (Ctrl-C twice) ends
it at once; another SIGTERM does not (a scheduler's cancel often delivers two). The clean stop cannot begin while
vLLM starts (its start blocks the event loop), and a weight sync or a dead engine can hold it up: an actor once
sat in its warm-up with its engine core gone (the launcher's SIGTERM reaches the whole process group) until the
launcher's SIGKILL. The signal handler runs on the main thread between two bytecodes, so a main thread stuck
for good inside one C call would delay the stop; SIGKILL still works, and the children still follow.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

ENV = "FLEETRL_LIFELINE"  # the pid of the process (the actor) whose death must end this one
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Looked up now, not in a forked child: dlopen there could wait forever on a lock another thread held at the fork.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_attached_pid = 0  # the process attach() armed: a forked child is not armed by its parent's call
_fork_hook = False
_main_ident = threading.main_thread().ident  # of the process that registered the fork hook (a fork inherits it)


def root() -> None:
    """In the actor, before it starts any process: every process it starts that attaches dies with it."""
    os.environ[ENV] = str(os.getpid())
    _attach_forks()


def attach() -> None:
    """SIGKILL this process when its parent dies, if an actor's FLEETRL_LIFELINE says so; else do nothing."""
    global _attached_pid
    value = os.environ.get(ENV, "")
    if _prctl is None or not value.isdigit() or int(value) == os.getpid() or _attached_pid == os.getpid():
        return
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    _attached_pid = os.getpid()
    if int(value) not in ancestors():  # the actor died before the line above: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)
    _attach_forks()


def _attach_forks() -> None:
    global _fork_hook, _main_ident
    if not _fork_hook:
        _fork_hook = True
        _main_ident = threading.main_thread().ident
        os.register_at_fork(after_in_child=_attach_forked)


def _attach_forked() -> None:
    # In the child, the forking thread is the only one and keeps its ident: forked from the main thread, or not at all.
    if threading.get_ident() == _main_ident:
        attach()


def _stat(pid: int) -> tuple[str, int]:
    """(state letter, parent pid) from /proc (the command name may hold spaces and parentheses: read after the last ')')."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return fields[0].decode(), int(fields[1])


def ancestors(pid: int | None = None) -> list[int]:
    """Parent, grandparent, ... of `pid` (this process by default), up to pid 1."""
    out: list[int] = []
    pid = os.getpid() if pid is None else pid
    while pid > 1:
        try:
            pid = _stat(pid)[1]
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            break
        out.append(pid)
    return out


def descendants(pid: int | None = None) -> list[int]:
    """The live (not zombie) processes below `pid` (this process by default), read from /proc."""
    root_pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                state, parent = _stat(int(name))
            except (OSError, IndexError, ValueError):  # it exited meanwhile
                continue
            if state != "Z":
                children.setdefault(parent, []).append(int(name))
    out, todo = [], [root_pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def kill_descendants() -> int:
    """SIGKILL every descendant of this process; returns how many were signalled. A second round catches a process
    started while the first was sent (it may already belong to init then: an attached one dies with its parent)."""
    killed: set[int] = set()
    for _ in range(2):
        pids = descendants()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
    return len(killed)


def stop_on_signals(request_stop: Callable[[int], None], grace_s: float, overdue: Callable[[int, int], None]) -> None:
    """From now on SIGTERM and SIGINT call `request_stop(signum)` (the first time), and if this process is still
    alive `grace_s` later, or at a SIGINT after the first signal, every descendant is SIGKILLed and it exits 128 +
    the first signal. More SIGTERMs change nothing: they are the same stop.

    `request_stop` runs in a signal handler, on the main thread between two bytecodes of whatever it was doing:
    keep it to a flag or `loop.call_soon_threadsafe`. `overdue(signum, killed)` reports the hard stop (it gets one
    second: a logging lock held by a stuck thread must not keep the process alive).
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    requested: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full of earlier signals: the deadline runs already
            os.write(write_fd, bytes([signum]))  # no lock taken: the handler may interrupt any code
        if not requested:
            requested.append(signum)
            request_stop(signum)

    def deadline() -> None:
        signum = os.read(read_fd, 1)[0]
        end = time.monotonic() + grace_s
        # A repeated SIGTERM is the same stop, not "kill now": Slurm's scancel signals every process of a step and the
        # launcher (deploy/actors.sh) signals the actor's group too, so one cancel delivers two SIGTERMs milliseconds
        # apart. A SIGINT on top of a stop (Ctrl-C twice) cuts the grace short.
        while (left := end - time.monotonic()) > 0:
            if select.select([read_fd], [], [], left)[0] and os.read(read_fd, 1)[0] == signal.SIGINT:
                break
        killed = kill_descendants()
        reporter = threading.Thread(target=overdue, args=(signum, killed), name="stop-overdue-report", daemon=True)
        reporter.start()
        reporter.join(1.0)
        os._exit(128 + signum)

    threading.Thread(target=deadline, name="stop-deadline", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
