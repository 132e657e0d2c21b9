"""Where a run lives: its uid (one per concurrent run) and its temporary directory, and what is cleared after it.

Why a uid per run, not one shared `nobody`: RLIMIT_NPROC counts every process of a uid, so with a shared uid
a fork bomb in one run would make a concurrent honest run's fork (or its exec) fail. Each run holds a slot
(an flock on a file in a root-only directory, so concurrent reward workers and actors never share one) and runs
as UID_BASE + slot. A slot where a process of its uid is still alive (left by a supervisor that was SIGKILLed)
is skipped. Without root there is no uid to switch to: the run keeps the caller's.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

UID_BASE = 1_500_000_000  # far above login, system and container (subuid) ranges; no passwd entry needed
SLOTS = 1024  # concurrent runs per machine
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")  # the run's uid can write here too: cleared of its files after


def is_root() -> bool:
    return os.geteuid() == 0


def slot_locks() -> Path:
    """Where each slot's lock file is: a run holds an flock on its slot's file while it lasts."""
    return Path(tempfile.gettempdir()) / "fleetrl-sandbox-uids"


@contextlib.contextmanager
def uid_slot() -> Iterator[int | None]:
    """A uid no other run is using (root), or None (not root: the run keeps this process's uid)."""
    if not is_root():
        yield None
        return
    locks = slot_locks()
    locks.mkdir(mode=0o700, exist_ok=True)
    busy = set(sandbox_processes().values())
    first = random.randrange(SLOTS)
    for i in range(SLOTS):
        slot = (first + i) % SLOTS
        if UID_BASE + slot in busy:
            continue
        fd = os.open(locks / str(slot), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield UID_BASE + slot
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"all {SLOTS} sandbox uids are in use")


def sandbox_processes() -> dict[int, int]:
    """Every process of a sandbox uid now, pid -> uid (the owner of /proc/PID is the process's effective uid)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                uid = os.stat(f"/proc/{entry}").st_uid
                if UID_BASE <= uid < UID_BASE + SLOTS:
                    out[int(entry)] = uid
    return out


_BASE: list[Path] = []


def _base() -> Path:
    """This process's parent of run directories: root's, mode 0711, so a run can enter its own directory but not
    list or write its neighbours or the parent."""
    if not _BASE:
        _BASE.append(Path(tempfile.mkdtemp(prefix="fleetrl-sandbox-")))
        os.chmod(_BASE[0], 0o711)
        atexit.register(shutil.rmtree, _BASE[0], ignore_errors=True)
    return _BASE[0]


def make_workdir(uid: int | None) -> tuple[Path, Path]:
    """(the run's directory, owned by its uid, mode 0700; the supervisor's status file, outside it)."""
    workdir = Path(tempfile.mkdtemp(dir=_base()))
    if uid is not None:
        os.chown(workdir, uid, uid)
    return workdir, workdir.with_suffix(".status")


def clear(workdir: Path, status: Path, uid: int | None) -> None:
    """Remove the run's directory and status file, and its uid's files in the world-writable directories."""
    shutil.rmtree(workdir, ignore_errors=True)
    status.unlink(missing_ok=True)
    if uid is None:
        return
    for top in WORLD_WRITABLE:
        with contextlib.suppress(OSError), os.scandir(top) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            os.unlink(entry.path)
