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
from learner.build_locks import clear_stale_build_locks, extensions_root, filesystem_type, holders

REPO = Path(__file__).resolve().parents[1]


def _lock(root: Path, op: str = "deepspeed_shm_comm") -> Path:
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    lock.touch()
    return lock


def _holder(lock: Path) -> subprocess.Popen:
    """A process that holds `lock` open as torch's FileBaton does while it builds."""
    proc = subprocess.Popen([sys.executable, "-c", f"import os, sys, time; fd = os.open({str(lock)!r}, os.O_RDONLY); print('open', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    return proc


def test_a_lock_no_process_holds_is_removed_and_named(tmp_path):
    lock = _lock(tmp_path)
    with capture_logs() as logs:
        removed = clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=lambda s: None)
    assert removed == [lock] and not lock.exists()
    (event,) = [e for e in logs if e["event"] == "learner.build_lock_removed"]
    assert event["lock"] == str(lock) and event["log_level"] == "warning"


def test_a_lock_a_build_holds_is_left_to_torch(tmp_path):
    lock = _lock(tmp_path)
    proc = _holder(lock)
    try:
        assert holders(lock) == [proc.pid]
        with capture_logs() as logs:
            assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=lambda s: None) == []
        assert lock.exists() and any(e["event"] == "learner.build_lock_held" and e["pids"] == [proc.pid] for e in logs)
    finally:
        proc.kill()
        proc.wait()
    assert holders(lock) == []  # its builder died: now it is stale
    assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=lambda s: None) == [lock]


def test_a_lock_replaced_while_looking_again_is_kept(tmp_path):
    """Between the two looks another process finished with the old lock and took a new one: not ours to delete."""
    lock = _lock(tmp_path)

    def replace(_seconds):
        lock.unlink()
        lock.touch()

    assert clear_stale_build_locks(structlog.get_logger(), tmp_path, sleep=replace) == []
    assert lock.exists()


def test_on_a_network_filesystem_a_young_lock_is_waited_for(tmp_path, monkeypatch):
    """Another node may be building there: wait; remove it once it is stale_s old, not before."""
    lock = _lock(tmp_path)
    monkeypatch.setattr(build_locks, "filesystem_type", lambda path: "nfs4")
    now = [lock.stat().st_mtime]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    with capture_logs() as logs:
        removed = clear_stale_build_locks(structlog.get_logger(), tmp_path, stale_s=10, clock=lambda: now[0], sleep=sleep)
    assert removed == [lock]
    assert sum(s for s in slept if s == 1.0) == 10  # waited a second at a time until it was 10 s old
    assert any(e["event"] == "learner.build_lock_wait" for e in logs)

    other = _lock(tmp_path, "fused_adam")  # this time the other node's build finishes while we wait
    young = other.stat().st_mtime
    assert clear_stale_build_locks(structlog.get_logger(), tmp_path, stale_s=10, clock=lambda: young,
                                   sleep=lambda s: other.unlink()) == []


def test_filesystem_type_reads_the_mount_table(tmp_path):
    assert filesystem_type(Path("/proc/self")) == "proc"
    assert filesystem_type(tmp_path) not in ("", "proc")


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
        from learner.distributed import init_distributed
        init_distributed()
        print("initialised", dist.get_world_size(), flush=True)
        dist.destroy_process_group()
    """)
    env.update(TORCH_EXTENSIONS_DIR=str(root), DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the learner hung on the stale lock {lock}: {e.stderr!s:.2000}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "initialised 1" in out.stdout
    assert "learner.build_lock_removed" in out.stdout + out.stderr and str(lock) in out.stdout + out.stderr
    assert not lock.exists()
