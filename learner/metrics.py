"""Metrics: one JSON object per learner step in `metrics.jsonl`, and the reward-curve plot.

Only learner rank 0 writes. Keys are flat; namespaced ones use `group/name`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.plot_path = run_dir / "reward_curve.png"
        self.file = self.path.open("a", buffering=1)
        self.rows: list[dict] = []

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.rows.append(clean)

    def close(self) -> None:
        self.file.close()

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
