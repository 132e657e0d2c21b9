"""The learning rate at each optimizer step, as a multiple of the peak (train.lr; algo.critic_lr for the critic).

    warmup (train.warmup_steps = W)   step t = 0 .. W-1 runs at (t + 1) / W: the first at peak / W, the W-th at the peak
    then (train.lr_schedule)          constant: 1
                                      linear:   1 -> m in a straight line      p = (t - W) / (T - W)
                                      cosine:   1 -> m along half a cosine     m = train.min_lr_ratio
                                      T = the run's optimizer steps (learner/plan/length.py)

The decay reaches m at t = T, just after the run's last step (Hugging Face's linear and cosine schedules, which
verl and open-instruct use, count the same way). Unlike theirs and DeepSpeed's WarmupLR, the warmup never gives a
step at lr 0: that step would be wasted, and a warmup of 0 or 1 would start with two of them under WarmupLR.

DeepSpeed steps the scheduler after each applied optimizer step (not after one it skips), so t is the policy
version's count, and it saves and restores the scheduler with its checkpoint (learner/resume.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from protocol.config import TrainConfig


def lr_multiplier(t: int, *, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """The multiple of the peak learning rate that optimizer step `t` (from 0) runs at; `total` = T above."""
    if t < warmup:
        return (t + 1) / warmup
    if schedule == "constant":
        return 1.0
    assert schedule in ("linear", "cosine"), schedule
    p = min(1.0, (t - warmup) / max(1, total - warmup))
    shape = 1.0 - p if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    return min_ratio + (1.0 - min_ratio) * shape


def lr_scheduler(cfg: TrainConfig, total: int) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """What deepspeed.initialize(lr_scheduler=...) takes: it builds the LambdaLR on the torch optimizer inside its
    own. A plain function (not a callable object) keeps the LambdaLR's state dict to its step count."""

    def multiplier(t: int) -> float:
        return lr_multiplier(t, schedule=cfg.lr_schedule, warmup=cfg.warmup_steps, total=total, min_ratio=cfg.min_lr_ratio)

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
