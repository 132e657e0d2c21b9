"""Stale build locks of DeepSpeed's JIT-compiled ops, found and removed before DeepSpeed starts.

DeepSpeed compiles its C++ ops on first use through torch.utils.cpp_extension: on CPU the learner's
`deepspeed.init_distributed` loads `deepspeed_shm_comm` this way, on GPUs ops such as fused Adam. Each
op has a build folder under the extensions root (TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions/py311_cpu/), and every load, built or not, goes through `<op>/lock`: torch's
FileBaton creates the file exclusively, holds it open while it builds (about 45 s for the shm op on a
2-core machine), then deletes it. Another process finding the file waits, polling, with no time limit,
and the file records no owner. So a learner killed while it held the lock (Ctrl-C during a first start,
a test or job time limit) leaves the file behind, and every later learner on that machine hangs in
`deepspeed.init_distributed`, printing nothing.

`clear_stale_build_locks` runs before DeepSpeed is initialised. A lock is live while some process on
this machine has it open (the builder holds the fd: found in /proc/*/fd). A lock that no process here
has open is stale at once when it lies on a local filesystem; no other machine can be building there.
On a network filesystem (an extensions root in a home directory shared by the nodes), a build on
another node looks the same, so the lock is waited on and removed only once it is `stale_s` old.
Builds in another container that shares the folder through a bind mount are not seen; run such
containers with their own TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.sshfs",
                        "fuse.glusterfs", "glusterfs", "9p", "afs", "panfs", "wekafs", "fuse.juicefs"})
RECHECK_S = 0.5  # a builder deletes the lock microseconds after closing it
STALE_S = 600.0  # a lock on a network filesystem with no holder here: another node's build, until this old


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


def holders(path: Path) -> list[int]:
    """Pids of the processes on this machine (those /proc lets us see) that have `path` open."""
    target, pids = os.path.realpath(path), []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` lies on, from /proc/self/mountinfo ("" if unknown)."""
    real, best, fstype = os.path.realpath(path), "", ""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, fstype = mount, right.split()[0]
    return fstype


def clear_stale_build_locks(log: Any, root: Path | None = None, stale_s: float = STALE_S,
                            clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> list[Path]:
    """Remove the build locks under `root` (default: `extensions_root()`) that no build holds; return them.

    Returns once no lock is left that could still be stale: a live one (open here) is left to torch,
    which waits for it; one on a network filesystem is waited on until it goes or is `stale_s` old.
    Safe to run in several processes at once (every learner rank does).
    """
    root = extensions_root() if root is None else root
    removed: list[Path] = []
    pending = sorted(root.glob("*/lock")) if root.is_dir() else []
    last_note = -math.inf
    while pending:
        waiting = []
        for lock in pending:
            if (seen := _unheld(lock, log)) is None:
                continue  # gone, or a build holds it (torch waits for that one)
            age = clock() - seen.st_mtime
            fstype = filesystem_type(lock)
            if fstype in NETWORK_FS and age < stale_s:
                waiting.append(lock)
                continue
            # A builder closes the file just before deleting it: look again after that moment has surely
            # passed, and remove only the same file (another process may have taken a new lock since).
            sleep(RECHECK_S)
            again = _unheld(lock, log)
            if again is None or (again.st_ino, again.st_ctime_ns) != (seen.st_ino, seen.st_ctime_ns):
                continue
            try:
                lock.unlink()
            except FileNotFoundError:
                continue  # another rank removed it first
            removed.append(lock)
            log.warning("learner.build_lock_removed", lock=str(lock), age_s=round(age, 1), filesystem=fstype,
                        reason="no process has it open: a build was killed while it held the lock")
        pending = waiting
        if pending:
            if clock() - last_note >= 30:
                last_note = clock()
                log.warning("learner.build_lock_wait", locks=[str(p) for p in pending], removed_at_age_s=stale_s,
                            hint="on a network filesystem another node may be building; remove them by hand if none is")
            sleep(1.0)
    return removed


def _unheld(lock: Path, log: Any) -> os.stat_result | None:
    """The lock's stat if it exists and no process here has it open, else None."""
    try:
        st = lock.stat()
    except FileNotFoundError:
        return None
    if pids := holders(lock):
        log.info("learner.build_lock_held", lock=str(lock), pids=pids)
        return None
    return st
