"""Hugging Face checkpoints of the policy in RUN_DIR/checkpoints: step-N folders, the newest `keep` plus the best,
plus every `keep_every`-th update's for good (a run's history: Open-Reasoner-Zero and verl's recipes delete none).

    save:    write into .tmp-step-N-part, fsync every file, rename to step-N (atomic), fsync the folder
    rotate:  rename each folder to go to .trash-step-N-PID (atomic), then delete it
    best:    best.json = {step, metric, value, path}, replaced atomically when a checkpoint scores higher

So a folder named step-N is always complete: a crash or a full disk mid-write leaves
only a .tmp-* folder (removed at the next start), and a crash mid-delete only a .trash-*.
A failed save is logged with its path and counted (checkpoint/failed); the run goes on,
because losing one checkpoint must not cost the training behind it. A full disk shows
up as OSError, or as SafetensorError from safetensors' writer (it wraps the OS error).

A checkpoint's score is checkpoint.best_metric from the metrics row of its own step;
only scored checkpoints compete for best (eval steps are checked against checkpoint
steps in the config).

The staging folder's name depends only on the step, so that every learner rank can write
its share of the training state into it (learner/resume.py): rank 0 renames it once all
ranks are done.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from protocol.config import CheckpointConfig
from protocol.logs import get_logger
from protocol.progress import phase

Writer = Callable[[Path], None]  # writes one complete checkpoint into an empty folder

WRITE_ERRORS = (OSError, SafetensorError)


def hf_writer(model, tokenizer, state_dict: Callable[[], dict[str, torch.Tensor] | None] | None = None) -> Writer:
    """model.save_pretrained + tokenizer.save_pretrained: loadable by transformers and vLLM.

    `state_dict()` supplies the full weights when `model` does not hold them (ZeRO-3 keeps only
    a shard per rank; the learner passes its last weight snapshot). None, or a call returning
    None: the model's own.
    """

    def write(path: Path) -> None:
        weights = state_dict() if state_dict is not None else None
        if weights is None:
            model.save_pretrained(path, safe_serialization=True)
        else:
            model.save_pretrained(path, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(path)

    return write


def staging_dir(run_dir: Path, step: int) -> Path:
    """Where step-N is written before the rename; the same on every rank."""
    return Path(run_dir) / "checkpoints" / f".tmp-step-{step}-part"


def _fsync_tree(path: Path) -> None:
    """Flush every file, then the folders: after the rename, a power cut cannot leave truncated files."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, write: Writer):
        self.cfg, self.write = cfg, write
        self.dir = Path(run_dir) / "checkpoints"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.best_path = self.dir / "best.json"
        self.log = get_logger()
        self.failed = 0
        for leftover in [*self.dir.glob(".tmp-*"), *self.dir.glob(".trash-*")]:  # from a crash
            shutil.rmtree(leftover, ignore_errors=True)
        self.best: dict | None = json.loads(self.best_path.read_text()) if self.best_path.exists() else None

    def due(self, version: int, last: bool) -> bool:
        every = self.cfg.every_steps
        return version > 0 and (last or (every > 0 and version % every == 0))

    def wants(self, version: int, last: bool) -> bool:
        """maybe_save(version, ..., last) will write: decided before the update, so every rank can be told."""
        return self.due(version, last) and not (self.dir / f"step-{version}").exists()

    def steps(self) -> list[int]:
        """Complete checkpoints on disk, oldest first."""
        return sorted(int(p.name.removeprefix("step-")) for p in self.dir.glob("step-*") if p.name[5:].isdigit())

    def maybe_save(self, version: int, row: dict, last: bool = False) -> dict[str, float]:
        """Save `version` if due (idempotent), score it from `row`, rotate; metrics for the row."""
        if not self.wants(version, last):
            return {}
        t0 = time.perf_counter()
        path = self.save(version)
        if path is None:
            return {"checkpoint/failed": float(self.failed)}
        value = row.get(self.cfg.best_metric)
        if isinstance(value, int | float) and math.isfinite(value):
            self._score(version, float(value), path)
        self._rotate()
        return {"checkpoint/step": float(version), "time/checkpoint": time.perf_counter() - t0}

    def save(self, version: int) -> Path | None:
        """Write step-N atomically; None (logged, counted) if the write failed."""
        final = self.dir / f"step-{version}"
        tmp = staging_dir(self.dir.parent, version)
        try:
            with phase(self.log, "checkpoint.save", path=str(final), step=version):  # begin / still / done lines
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                self.write(tmp)
                _fsync_tree(tmp)
                tmp.rename(final)
                _fsync_dir(self.dir)
        except WRITE_ERRORS as e:
            self.failed += 1
            shutil.rmtree(tmp, ignore_errors=True)
            self.log.error("checkpoint.save_failed", path=str(final), error=f"{type(e).__name__}: {e}", failed=self.failed)
            return None
        return final

    def _score(self, version: int, value: float, path: Path) -> None:
        if self.best is not None and value <= self.best["value"]:
            return  # ties keep the older one: no evidence the newer is better
        best = {"step": version, "metric": self.cfg.best_metric, "value": value, "path": str(path.absolute())}
        tmp = self.dir / f".tmp-best-{os.getpid()}.json"
        try:
            tmp.write_text(json.dumps(best) + "\n")
            os.replace(tmp, self.best_path)
        except OSError as e:
            self.log.error("checkpoint.best_failed", path=str(self.best_path), error=str(e))
            return
        self.best = best
        self.log.info("checkpoint.new_best", **best)

    def kept(self, steps: list[int]) -> set[int]:
        """Of the checkpoints `steps` (oldest first), those rotation keeps: the newest `keep`, the best, and every
        `keep_every`-th update's."""
        keep = set(steps[-self.cfg.keep :])
        if self.best is not None:
            keep.add(self.best["step"])
        if (every := self.cfg.keep_every) > 0:
            keep.update(s for s in steps if s % every == 0)
        return keep

    def _rotate(self) -> None:
        steps = self.steps()
        keep = self.kept(steps)
        for step in steps:
            if step in keep:
                continue
            trash = self.dir / f".trash-step-{step}-{os.getpid()}"
            try:
                (self.dir / f"step-{step}").rename(trash)
                shutil.rmtree(trash)
            except OSError as e:
                self.log.error("checkpoint.delete_failed", path=str(self.dir / f"step-{step}"), error=str(e))
