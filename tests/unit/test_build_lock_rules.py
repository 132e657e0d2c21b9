"""Stale JIT build locks (learner/build_locks.py), in-process: a lock no process holds is removed, one replaced between
the two looks is kept, one that may be another builder's (a network filesystem, an unreadable /proc entry) is waited
for, never removed. A lock a live process holds, and a real learner past a stale lock: tests/integration/test_build_locks.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from learner import build_locks
from learner.build_locks import clear_stale_build_locks, extensions_root, filesystem_type, mount_type


def _lock(root: Path, op: str = "deepspeed_shm_comm") -> Path:
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    lock.touch()
    return lock


def _no_sleep(_seconds: float) -> None:
    pass


def test_a_lock_no_process_holds_is_removed_and_named(tmp_path):
    lock = _lock(tmp_path)
    with capture_logs() as logs:
        removed = clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=_no_sleep)
    assert removed == [lock] and not lock.exists()
    (event,) = [e for e in logs if e["event"] == "learner.build_lock_removed"]
    assert event["lock"] == str(lock) and event["log_level"] == "warning"


def test_a_lock_replaced_between_the_two_looks_is_kept(tmp_path):
    """Between the two looks its builder deleted it and another process took a new lock, held only for an
    instant (a load with nothing to build): not the file we judged stale, so not ours to delete."""
    lock = _lock(tmp_path)

    def replace(_seconds):
        lock.unlink()
        time.sleep(0.02)  # ctime has kernel-tick resolution on older kernels, and the inode number is reused
        lock.touch()

    assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=replace) == []
    assert lock.exists()


@pytest.mark.parametrize("why", ["network filesystem", "unreadable /proc entry"])
def test_a_lock_that_may_be_another_builders_is_waited_for_never_removed(tmp_path, monkeypatch, why):
    """On a shared filesystem a build on another node looks stale from here; so does one by a process whose
    fds we may not read. Wait (and say so), until it goes."""
    lock = _lock(tmp_path)
    if why == "network filesystem":
        monkeypatch.setattr(build_locks, "filesystem_type", lambda path: "nfs4")
    else:
        monkeypatch.setattr(build_locks, "holders", lambda path: None)
    now, slept = [0.0], []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds
        if len(slept) == 100:  # the other builder finishes after 100 s
            lock.unlink()

    with capture_logs() as logs:
        assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=sleep, clock=lambda: now[0]) == []
    assert len(slept) == 100 and slept == [1.0] * 100
    notes = [e for e in logs if e["event"] == "learner.build_lock_wait"]
    assert len(notes) == 4 and notes[0]["locks"] == [str(lock)]  # at 0, 30, 60 and 90 s


def test_mount_type_takes_the_longest_match_and_unescapes():
    mountinfo = "\n".join(
        [
            "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
            "40 27 0:50 / /home rw - nfs4 server:/home rw",
            "41 40 0:51 / /home/a\\040b rw - xfs /dev/vdb rw",
            "42 27 0:52 / /homework rw - tmpfs tmpfs rw",
        ]
    )
    assert mount_type(mountinfo, "/home/u/.cache/torch_extensions") == "nfs4"
    assert mount_type(mountinfo, "/home/a b/x") == "xfs"
    assert mount_type(mountinfo, "/homework/x") == "tmpfs"  # not inside /home
    assert mount_type(mountinfo, "/var/tmp") == "ext4"
    assert filesystem_type(Path("/proc/self")) == "proc"


def test_the_extensions_root_is_torchs():
    from torch.utils.cpp_extension import _get_build_directory

    assert Path(_get_build_directory("deepspeed_shm_comm", verbose=False)).parent == extensions_root()
