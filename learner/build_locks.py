"""Stale build locks of DeepSpeed's JIT-compiled ops, found and removed before DeepSpeed starts.

DeepSpeed compiles its C++ ops on first use through torch.utils.cpp_extension: on CPU the learner's
`deepspeed.init_distributed` loads `deepspeed_shm_comm` this way, on GPUs ops such as fused Adam. Each
op has a build folder under the extensions root (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions/py311_cpu/), and every load, built or not, goes through `<op>/lock`: torch's
FileBaton creates the file exclusively, holds it open while it builds (about 45 s for the shm op on a
2-core machine), then closes and deletes it. Another process finding the file waits, polling, with no
time limit, and the file records no owner. So a learner killed while it held the lock (Ctrl-C during a
first start, a test or job time limit) leaves the file behind, and every later learner on that machine
hangs in `deepspeed.init_distributed`, printing nothing.

`clear_stale_build_locks` runs on every learner rank before DeepSpeed starts. A lock is removed only
when it is certainly stale:
- no process on this machine has it open (the builder holds its fd: every /proc/<pid>/fd is read; if
  one cannot be, nothing is certain), at two looks half a second apart, the same file both times; and
- it lies on a local filesystem, where no other machine can be building.
Any other lock is left to torch, which waits for it. One on a network or unknown filesystem (an
extensions root in a home directory the nodes share) could be another node's build, which looks the
same from here: it is reported every 30 s until it goes, so the wait is no longer silent, and an
operator who knows no node is building removes it by hand. Containers that share the folder through a
bind mount cannot see each other's builders: give each its own TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "f2fs", "jfs", "reiserfs", "ramfs"})
RECHECK_S = 0.5  # a builder deletes the lock microseconds after closing it
NOTE_EVERY_S = 30.0


def extensions_root() -> Path:
    """The folder torch builds extensions in: the same rule as torch.utils.cpp_extension._get_build_directory."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if (root := os.environ.get("TORCH_EXTENSIONS_DIR")) is not None:
        return Path(root)
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def holders(path: Path, proc: Path = Path("/proc")) -> list[int] | None:
    """Pids of the processes on this machine that have `path` open; None if some process's fds could not be read."""
    target, pids, complete = os.path.realpath(path), [], True
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            fds = list((pid / "fd").iterdir())
        except FileNotFoundError:  # exited
            continue
        except OSError:  # another user's process, or /proc mounted with hidepid
            complete = False
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    pids.append(int(pid.name))
                    break
            except OSError:  # that fd was closed meanwhile
                continue
    return pids if complete or pids else None


def mount_type(mountinfo: str, path: str) -> str:
    """The filesystem type of the mount holding `path` (a real path), from /proc/self/mountinfo text."""
    best, fstype = "", ""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space, and so on
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # the longest match; of equal ones the later mount, which hides the earlier
            best, fstype = mount, right.split()[0]
    return fstype


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` lies on ("" if /proc/self/mountinfo cannot be read)."""
    try:
        return mount_type(Path("/proc/self/mountinfo").read_text(), os.path.realpath(path))
    except OSError:
        return ""


def clear_stale_build_locks(
    log: Any, root: Path | None = None, sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic
) -> list[Path]:
    """Remove the build locks under `root` (default: `extensions_root()`) that are certainly stale; return them.

    Returns when no lock is left but live ones (open here, left to torch). Waits, with a warning every
    NOTE_EVERY_S, while one that could be another node's build is there. Safe to run in several
    processes at once.
    """
    root = extensions_root() if root is None else root
    try:
        pending = sorted(root.glob("*/lock"))
    except OSError as e:
        log.warning("learner.build_locks_unreadable", root=str(root), error=str(e))
        return []
    removed: list[Path] = []
    next_note = clock()
    while pending:
        unsure = []
        for lock in pending:
            state = _look(lock, log)
            if state is None:
                continue  # gone, or a build here holds it
            seen, certain = state
            if not certain:
                unsure.append(lock)
                continue
            # A builder closes the file just before it deletes it: look again once that moment has surely
            # passed, and remove only the same file (another process may have taken a new lock since).
            sleep(RECHECK_S)
            again = _look(lock, log)
            if again is None or not again[1] or (again[0].st_ino, again[0].st_ctime_ns) != (seen.st_ino, seen.st_ctime_ns):
                continue
            try:
                lock.unlink()
            except FileNotFoundError:
                continue  # another rank removed it first
            except OSError as e:
                log.warning("learner.build_lock_kept", lock=str(lock), error=str(e))
                continue
            removed.append(lock)
            log.warning(
                "learner.build_lock_removed",
                lock=str(lock),
                filesystem=filesystem_type(lock),
                reason="no process has it open: a build was killed while it held the lock",
            )
        pending = unsure
        if pending:
            if clock() >= next_note:
                next_note = clock() + NOTE_EVERY_S
                log.warning(
                    "learner.build_lock_wait",
                    locks=[str(p) for p in pending],
                    filesystem=[filesystem_type(p) for p in pending],
                    hint="no process here has these open, but another node (shared filesystem) or another "
                    "user may be building; DeepSpeed would wait for them forever. If none is, delete them.",
                )
            sleep(1.0)
    return removed


def _look(lock: Path, log: Any) -> tuple[os.stat_result, bool] | None:
    """None if the lock is gone or a process here holds it; else its stat, and whether it is certainly stale."""
    try:
        st = lock.stat()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("learner.build_lock_kept", lock=str(lock), error=str(e))
        return None
    pids = holders(lock)
    if pids:
        log.info("learner.build_lock_held", lock=str(lock), pids=pids)
        return None
    return st, pids is not None and lock.is_file() and filesystem_type(lock) in LOCAL_FS
