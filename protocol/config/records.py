"""What the learner writes as the run goes, beside metrics.jsonl: checkpoints, sample completions, W&B rows."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from protocol.config.errors import check_choices, need

WandbMode = Literal["online", "offline"]
WANDB_MODES: tuple[WandbMode, ...] = typing.get_args(WandbMode)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 0  # write a Hugging Face checkpoint every N updates (rollout batches; 0 = only at the end)
    keep: int = 3  # newest checkpoints kept on disk (the best one is always kept)
    keep_every: int = 0  # also keep every N-th update's checkpoint forever (a multiple of every_steps; 0 = off)
    best_metric: str = "eval/val/reward_mean"  # metric that picks the best checkpoint (higher is better)

    def __post_init__(self) -> None:
        # a multiple of eval.every_steps when best_metric is an eval score: protocol/config/root.py
        need(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
        need(self.keep >= 1, "checkpoint.keep", "must be >= 1")
        need(self.keep_every >= 0, "checkpoint.keep_every", "must be >= 0 (0 = off)")
        need(
            self.keep_every == 0 or (self.every_steps > 0 and self.keep_every % self.every_steps == 0),
            "checkpoint.keep_every",
            f"{self.keep_every} must be a multiple of checkpoint.every_steps ({self.every_steps}): only those updates have checkpoints",
        )


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """What the learner records beside metrics.jsonl: sample completions, and Weights & Biases (learner/record/metrics.py)."""

    # write sample prompts, completions and rewards to RUN_DIR/samples.jsonl every N updates (rollout batches; 0 = never)
    samples_every_steps: int = 10
    samples_groups: int = 2  # groups written each time: their prompt and every completion, decoded
    wandb: bool = False  # also send each metrics row to Weights & Biases (needs `pip install 'fleetrl[wandb]'`)
    wandb_project: str = "fleetrl"  # W&B project
    wandb_run_name: str = ""  # W&B run name ("" = the run directory's name)
    wandb_mode: WandbMode = "online"  # online | offline: write RUN_DIR/wandb only, no network (`wandb sync` uploads it later)

    def __post_init__(self) -> None:
        check_choices(self, "log")
        need(self.samples_every_steps >= 0, "log.samples_every_steps", "must be >= 0 (0 = never)")
        need(self.samples_groups >= 1, "log.samples_groups", "must be >= 1")
        need(not self.wandb or bool(self.wandb_project), "log.wandb_project", "required when log.wandb = true")
