"""Metrics: one JSON object per learner step in `metrics.jsonl`, TensorBoard scalars, optionally Weights & Biases,
and the reward-curve plot. Every row goes through MetricsWriter.write, to every sink at once.

Only learner rank 0 writes. Keys are flat; namespaced ones use `group/name`.
TensorBoard (RUN_DIR/tensorboard) and W&B (learner/record/wandb_log.py): every finite numeric value of a row becomes
a scalar at step = row["step"]; strings, None and NaN are left out (NaN would break their charts).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from learner.record.wandb_log import WandbLogger


class MetricsWriter:
    def __init__(self, run_dir: Path, wandb: WandbLogger | None = None):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.path = run_dir / "metrics.jsonl"
        self.plot_path = run_dir / "reward_curve.png"
        self.file = self.path.open("a", buffering=1)
        self.rows: list[dict] = []
        self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), flush_secs=10)
        self.wandb = wandb  # learner/record/wandb_log.py, when log.wandb = true

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.rows.append(clean)
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
        """reward_curve.png: train reward (and its moving mean) with each eval set's reward above; completion length
        (mean and max, tokens) below."""
        if not self.rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        rewards = [r["reward_mean"] for r in self.rows]
        window = max(1, len(rewards) // 10)
        smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        fig, (ax, ax_len) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
        ax.plot(steps, rewards, alpha=0.4, label="train reward_mean")
        ax.plot(steps, smooth, label=f"train, moving mean ({window} steps)")
        evals = sorted({k for r in self.rows for k in r if k.startswith("eval/") and k.endswith("/reward_mean")})
        for key in evals:
            xs, ys = _series(self.rows, key)
            ax.plot(xs, ys, marker="o", label=key.removesuffix("/reward_mean").replace("eval/", "eval ") + " reward_mean")
        seen = rewards + [y for key in evals for y in _series(self.rows, key)[1]]
        if all(0 <= y <= 1 for y in seen):
            ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        for key, style in (("response/length_mean", "-"), ("response/length_max", "--")):
            xs, ys = _series(self.rows, key)
            if xs:
                ax_len.plot(xs, ys, style, label=key.removeprefix("response/"))
        ax_len.set_xlabel("learner step")
        ax_len.set_ylabel("completion tokens")
        ax_len.grid(alpha=0.3)
        if ax_len.lines:
            ax_len.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=100)
        plt.close(fig)
        return self.plot_path


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows where `key` holds a number (eval rows are every eval.every_steps only)."""
    pairs = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [x for x, _ in pairs], [float(y) for _, y in pairs]
