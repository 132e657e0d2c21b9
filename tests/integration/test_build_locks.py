"""Stale JIT build locks (learner/build_locks.py) with real processes: a killed build must not hang the next learner.
The rules without a process: tests/unit/test_build_lock_rules.py."""

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

from learner.build_locks import clear_stale_build_locks, extensions_root, holders
from tests.unit.test_build_lock_rules import _lock, _no_sleep

REPO = Path(__file__).resolve().parents[2]


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
