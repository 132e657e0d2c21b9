"""Stale JIT build locks (learner/build_locks.py): a killed build must not hang the next learner."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from learner import build_locks
from learner.build_locks import clear_stale_build_locks, extensions_root, filesystem_type, holders, mount_type

REPO = Path(__file__).resolve().parents[2]


def _lock(root: Path, op: str = "deepspeed_shm_comm") -> Path:
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    lock.touch()
    return lock


def _holder(lock: Path) -> subprocess.Popen:
    """A process that holds `lock` open as torch's FileBaton does while it builds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os, time; fd = os.open({str(lock)!r}, os.O_RDONLY); print('open', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    except BaseException:
        proc.kill()
        raise
    return proc


def _no_sleep(_seconds: float) -> None:
    pass


def test_a_lock_no_process_holds_is_removed_and_named(tmp_path):
    lock = _lock(tmp_path)
    with capture_logs() as logs:
        removed = clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=_no_sleep)
    assert removed == [lock] and not lock.exists()
    (event,) = [e for e in logs if e["event"] == "learner.build_lock_removed"]
    assert event["lock"] == str(lock) and event["log_level"] == "warning"


def test_a_lock_a_build_holds_is_left_to_torch(tmp_path):
    lock = _lock(tmp_path)
    proc = _holder(lock)
    try:
        assert holders(lock) == [proc.pid]
        with capture_logs() as logs:
            assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=_no_sleep) == []
        assert lock.exists() and any(e["event"] == "learner.build_lock_held" and e["pids"] == [proc.pid] for e in logs)
    finally:
        proc.kill()
        proc.wait()
    assert holders(lock) == []  # its builder died: now it is stale
    assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=_no_sleep) == [lock]


def test_a_lock_taken_between_the_two_looks_is_kept(tmp_path):
    """At the first look no one held it; by the second a build had opened it (torch's try_acquire racing us)."""
    lock = _lock(tmp_path)
    procs = []
    try:
        assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=lambda s: procs.append(_holder(lock))) == []
        assert lock.exists() and len(procs) == 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


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


def test_a_learner_starts_past_a_lock_a_killed_build_left(tmp_path):
    """The hang this guards against: DeepSpeed's CPU backend loads its shm op through the lock at init.

    The op's built files are copied from this machine's cache when it has them (the load is then a
    no-op ninja run); otherwise the op builds here, once.
    """
    root = tmp_path / "torch_extensions"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    built = extensions_root() / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm.so").exists() and not (built / "lock").exists():
        shutil.copytree(built, root / "deepspeed_shm_comm")
    else:
        (root / "deepspeed_shm_comm").mkdir(parents=True)
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 5, time.time() - 5))
    code = textwrap.dedent("""
        import torch.distributed as dist
        from learner.train.distributed import init_distributed
        init_distributed()
        print("initialised", dist.get_world_size(), flush=True)
        dist.destroy_process_group()
    """)
    env.update(TORCH_EXTENSIONS_DIR=str(root), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the learner hung on the stale lock {lock}: {e.stderr!s:.2000}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "initialised 1" in out.stdout
    assert "learner.build_lock_removed" in out.stdout + out.stderr and str(lock) in out.stdout + out.stderr
    assert not lock.exists()
