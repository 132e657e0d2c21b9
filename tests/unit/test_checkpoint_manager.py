"""Hugging Face checkpoints (learner/checkpoint.py), in-process: rotation keeps the newest N plus the best, best.json,
a failed write logged and cleaned up, and a checkpoint that reloads with transformers to identical logits. A process
killed mid-write and a real full disk: tests/integration/test_checkpoint.py."""

import errno
import json
import os

import pytest
import torch
from structlog.testing import capture_logs

from deploy.tiny import build_model, build_tokenizer
from learner.checkpoint import CheckpointManager, hf_writer
from protocol.config import ConfigError, load_config

METRIC = "eval/val/reward_mean"


@pytest.fixture(scope="module")
def policy():
    tok = build_tokenizer()
    return build_model(len(tok), seed=0), tok


def manager(run_dir, policy, keep=2, every=1, writer=None):
    cfg = load_config(None, [f"checkpoint.keep={keep}", f"checkpoint.every_steps={every}"]).checkpoint
    return CheckpointManager(cfg, run_dir, writer or hf_writer(*policy))


def test_rotation_keeps_newest_and_best_and_records_best(tmp_path, policy):
    ckpt = manager(tmp_path, policy, keep=2, every=1)
    scores = {1: 0.1, 2: 0.5, 3: 0.3, 4: None, 5: 0.2, 6: 0.4}  # step 4: no eval in its row
    for step, value in scores.items():
        row = {} if value is None else {METRIC: value}
        out = ckpt.maybe_save(step, row)
        assert out["checkpoint/step"] == step and out["time/checkpoint"] > 0
    assert ckpt.steps() == [2, 5, 6]  # newest two, plus the best
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best == {"step": 2, "metric": METRIC, "value": 0.5, "path": str((tmp_path / "checkpoints" / "step-2").absolute())}
    assert ckpt.maybe_save(6, {METRIC: 0.9}, last=True) == {}  # already on disk: idempotent, not re-scored
    assert ckpt.maybe_save(7, {METRIC: 0.9}) != {} and ckpt.steps() == [6, 7]  # a new best frees the old one
    assert json.loads((tmp_path / "checkpoints" / "best.json").read_text())["step"] == 7
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temp or trash folders left
    # Due only on every_steps multiples, or at the end.
    ckpt = manager(tmp_path / "b", policy, keep=3, every=5)
    assert [s for s in range(1, 13) if ckpt.due(s, last=s == 12)] == [5, 10, 12]
    assert not ckpt.due(0, last=True)  # nothing trained, nothing to keep
    # A resumed run reads best.json and keeps comparing against it.
    again = manager(tmp_path, policy, keep=2, every=1)
    assert again.best is not None and again.best["step"] == 7 and again.maybe_save(8, {METRIC: 0.8}) != {}
    assert again.best["step"] == 7 and again.steps() == [7, 8]


def test_keep_every_keeps_those_updates_forever(tmp_path):
    """checkpoint.keep_every = 4 over checkpoints every 2 updates, keep 2: 4 and 8 stay when they leave the newest two
    (the sources' recipes keep a run's whole history; this keeps part of it without filling the disk)."""
    cfg = load_config(None, ["checkpoint.keep=2", "checkpoint.every_steps=2", "checkpoint.keep_every=4"]).checkpoint
    ckpt = CheckpointManager(cfg, tmp_path, lambda path: (path / "w").write_text("w"))
    for step in range(1, 13):
        ckpt.maybe_save(step, {METRIC: 0.0} if step == 2 else {}, last=step == 12)
    assert ckpt.steps() == [2, 4, 8, 10, 12]  # 2: the best; 4, 8 (and 12): every 4th; 10, 12: the newest two
    off = CheckpointManager(load_config(None, ["checkpoint.keep=2", "checkpoint.every_steps=2"]).checkpoint, tmp_path / "b", lambda p: None)
    for step in range(2, 13, 2):
        off.maybe_save(step, {})
    assert off.steps() == [10, 12]
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep_every: 3 must be a multiple of checkpoint\.every_steps \(2\)"):
        load_config(None, ["checkpoint.every_steps=2", "checkpoint.keep_every=3"])
    with pytest.raises(ConfigError, match=r"^checkpoint\.keep_every: must be >= 0"):
        load_config(None, ["checkpoint.keep_every=-1"])


def test_checkpoint_reloads_with_identical_logits(tmp_path, policy):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = policy
    path = manager(tmp_path, policy).save(3)
    assert path == tmp_path / "checkpoints" / "step-3"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([tok("3+4=7", add_special_tokens=False)["input_ids"]])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    assert AutoTokenizer.from_pretrained(path)("3+4=7", add_special_tokens=False)["input_ids"] == ids[0].tolist()


def test_failed_write_is_logged_leaves_nothing_and_the_run_goes_on(tmp_path, policy):
    real = hf_writer(*policy)
    calls = []

    def disk_fills_up(path):
        calls.append(path)
        if len(calls) == 1:  # half a checkpoint on disk, then ENOSPC
            policy[1].save_pretrained(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path)

    ckpt = manager(tmp_path, policy, keep=2, every=1, writer=disk_fills_up)
    with capture_logs() as logs:
        out = ckpt.maybe_save(1, {METRIC: 1.0})
    assert out == {"checkpoint/failed": 1.0}
    assert ckpt.steps() == [] and os.listdir(tmp_path / "checkpoints") == []  # no half checkpoint, no temp
    failed = [e for e in logs if e["event"] == "checkpoint.save_failed"]
    assert failed and failed[0]["path"] == str(tmp_path / "checkpoints" / "step-1") and "No space left" in failed[0]["error"]
    assert ckpt.maybe_save(2, {METRIC: 0.5})["checkpoint/step"] == 2  # the next one works
    assert ckpt.steps() == [2] and ckpt.best is not None and ckpt.best["step"] == 2
