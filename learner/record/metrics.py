"""Metrics: one JSON object per learner step in `metrics.jsonl`, TensorBoard scalars, optionally Weights & Biases,
and the reward-curve plot (curve.py). Every row goes through MetricsWriter.write, to every sink at once.

Only learner rank 0 writes. Keys are flat; namespaced ones use `group/name`.
TensorBoard (RUN_DIR/tensorboard) and W&B (learner/record/wandb_log.py): every finite numeric value of a row becomes
a scalar at step = row["step"]; strings, None and NaN are left out (NaN would break their charts).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

from learner.record.curve import Curve
from learner.record.wandb_log import WandbLogger


class MetricsWriter:
    def __init__(self, run_dir: Path, wandb: WandbLogger | None = None):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.path = run_dir / "metrics.jsonl"
        self.plot_path = run_dir / "reward_curve.png"
        # A resumed run's file holds its rows up to the checkpoint (learner/resume.py cut it): the curve covers them.
        self.curve, self.keys = Curve(), set[str]()
        for _, _, row in read_rows(self.path):
            self.curve.add(row)
            self.keys.update(row)
        self.file = self.path.open("a", buffering=1)
        if self.file.tell() > 0 and not _ends_with_newline(self.path):  # a torn last line: the next row starts its own
            self.file.write("\n")
        self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=10)
        self.wandb = wandb  # learner/record/wandb_log.py, when log.wandb = true

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.curve.add(clean)
        self.keys.update(clean)
        step = int(row["step"])
        for key, value in clean.items():
            if key != "step" and isinstance(value, int | float):  # bool is an int: flags chart as 0/1
                self.tb.add_scalar(key, float(value), global_step=step)
        if self.wandb is not None:
            self.wandb.log(clean)

    def close(self) -> None:
        self.file.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.close()

    def plot(self) -> Path | None:
        """RUN_DIR/reward_curve.png from the whole run's rows (learner/record/curve.py)."""
        return self.curve.plot(self.plot_path)


def read_rows(path: Path) -> Iterator[tuple[int, bytes, dict]]:
    """(byte offset, line, row) of each row of a metrics.jsonl, a line at a time: the file may hold a long run.
    Torn lines (a SIGKILL mid-write) and lines that are not JSON objects are skipped; no file, no rows."""
    if not path.exists():
        return
    with path.open("rb") as f:
        offset = 0
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
                row = None
            if isinstance(row, dict):
                yield offset, line, row
            offset += len(line)


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
