"""Metrics: one JSON object per learner step in `metrics.jsonl`, TensorBoard scalars, the reward-curve plot.

Only learner rank 0 writes. Keys are flat; namespaced ones use `group/name`.
TensorBoard (RUN_DIR/tensorboard): every finite numeric value of a row becomes a scalar
at step = row["step"]; strings, None and NaN are left out (NaN would break its charts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.path = run_dir / "metrics.jsonl"
        self.plot_path = run_dir / "reward_curve.png"
        self.file = self.path.open("a", buffering=1)
        self.rows: list[dict] = []
        self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=10)

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.rows.append(clean)
        step = int(row["step"])
        for key, value in clean.items():
            if key != "step" and isinstance(value, int | float):  # bool is an int: flags chart as 0/1
                self.tb.add_scalar(key, float(value), global_step=step)

    def close(self) -> None:
        self.file.close()
        self.tb.close()

    def plot(self) -> Path | None:
        if not self.rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        rewards = [r["reward_mean"] for r in self.rows]
        window = max(1, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, rewards, alpha=0.4, label="reward_mean")
        ax.plot(steps, smooth, label=f"moving mean ({window} steps)")
        ax.set_xlabel("learner step")
        ax.set_ylabel("mean reward")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)
        return self.plot_path
