"""Hugging Face checkpoints in processes of their own: a process killed mid-write leaves nothing that looks complete,
and a real full disk is survived. Rotation, best.json, a failed write and the reload: tests/unit/test_checkpoint_manager.py."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from learner.checkpoint import CheckpointManager
from protocol.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


def test_crash_mid_write_leaves_no_checkpoint_that_looks_complete(tmp_path):
    """The process dies (os._exit) after the model files are written, before the rename."""
    proc = _run(f"""
        import os
        from deploy.tiny import build_model, build_tokenizer
        from learner.checkpoint import CheckpointManager, hf_writer
        from protocol.config import load_config
        tok = build_tokenizer()
        write = hf_writer(build_model(len(tok), seed=0), tok)
        def crash(path):
            write(path)
            os._exit(9)
        CheckpointManager(load_config().checkpoint, {str(tmp_path)!r}, crash).save(1)
    """)
    assert proc.returncode == 9, proc.stderr[-2000:]
    left = os.listdir(tmp_path / "checkpoints")
    assert len(left) == 1 and left[0].startswith(".tmp-step-1-")  # only the temp folder, never step-1
    ckpt = CheckpointManager(load_config().checkpoint, tmp_path, lambda p: None)
    assert ckpt.steps() == [] and os.listdir(tmp_path / "checkpoints") == []  # cleaned at the next start


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_real_full_disk(tmp_path):
    """A 256 KiB tmpfs (private mount namespace, so nothing outside the test sees it): safetensors fails
    with its own SafetensorError wrapping ENOSPC; the manager logs, cleans up and returns."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"""
        import json, os
        from deploy.tiny import build_model, build_tokenizer
        from learner.checkpoint import CheckpointManager, hf_writer
        from protocol.config import load_config
        tok = build_tokenizer()
        ckpt = CheckpointManager(load_config().checkpoint, {str(disk)!r}, hf_writer(build_model(len(tok), seed=0), tok))
        out = ckpt.maybe_save(1, {{}}, last=True)
        print(json.dumps({{"out": out, "left": os.listdir({str(disk / "checkpoints")!r})}}))
    """
    mount = f"mount -t tmpfs -o size=256k tmpfs {disk}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.strip()[-200:]}")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f'{mount} && exec "$0" -c "$1"', sys.executable, textwrap.dedent(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"out": {"checkpoint/failed": 1.0}, "left": []}
    logged = proc.stdout + proc.stderr  # structlog, unconfigured, prints to stdout
    assert "checkpoint.save_failed" in logged and "No space left on device" in logged and "SafetensorError" in logged
