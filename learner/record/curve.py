"""The reward curve (RUN_DIR/reward_curve.png), drawn at the end from the whole run's rows: what it keeps and how.

It keeps only the series it draws (train reward, completion length mean and max, each eval set's reward), as
arrays of floats. A metrics row holds some seventy keys: kept whole as dicts for the plot, the rows of a long run
were most of the learner's memory growth, and a resumed learner read all of them back.
"""

from __future__ import annotations

import math
from array import array
from pathlib import Path

TRAIN = "reward_mean"
LENGTHS = ("response/length_mean", "response/length_max")


def drawn(key: str) -> bool:
    return key == TRAIN or key in LENGTHS or (key.startswith("eval/") and key.endswith("/reward_mean"))


class Curve:
    def __init__(self) -> None:
        self._series: dict[str, tuple[array, array]] = {}  # key -> (steps, values) of the rows where it is a number

    def add(self, row: dict) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        for key, value in row.items():
            if drawn(key) and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                steps, values = self._series.setdefault(key, (array("q"), array("d")))
                steps.append(step)
                values.append(float(value))

    def series(self, key: str) -> tuple[list[int], list[float]]:
        steps, values = self._series.get(key, (array("q"), array("d")))
        return list(steps), list(values)

    def eval_keys(self) -> list[str]:
        return sorted(k for k in self._series if k.startswith("eval/"))

    def nbytes(self) -> int:
        """Memory held by the series' buffers."""
        return sum(a.buffer_info()[1] * a.itemsize for pair in self._series.values() for a in pair)

    def plot(self, path: Path) -> Path | None:
        """Train reward (and its moving mean) with each eval set's reward above; completion length (mean and max,
        tokens) below. None when no row had a train reward."""
        steps, rewards = self.series(TRAIN)
        if not steps:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        window = max(1, len(rewards) // 10)
        fig, (ax, ax_len) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
        ax.plot(steps, rewards, alpha=0.4, label="train reward_mean")
        ax.plot(steps, moving_mean(rewards, window), label=f"train, moving mean ({window} steps)")
        seen = list(rewards)
        for key in self.eval_keys():
            xs, ys = self.series(key)
            ax.plot(xs, ys, marker="o", label=key.removesuffix("/reward_mean").replace("eval/", "eval ") + " reward_mean")
            seen += ys
        if all(0 <= y <= 1 for y in seen):
            ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        for key, style in zip(LENGTHS, ("-", "--"), strict=True):
            xs, ys = self.series(key)
            if xs:
                ax_len.plot(xs, ys, style, label=key.removeprefix("response/"))
        ax_len.set_xlabel("learner step")
        ax_len.set_ylabel("completion tokens")
        ax_len.grid(alpha=0.3)
        if ax_len.lines:
            ax_len.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def moving_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the window - 1 before it (fewer at the start); linear time."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
