"""One update's metrics row (metrics.jsonl, W&B), from what the update returned: no I/O.

`step` in a row is the update's number (rollout batches trained so far); `policy_version` counts optimizer steps
(S = mini_batches x ppo_epochs per update). rank 0 adds the weight sync's, the hub's and the eval round's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from learner.record.rollout_stats import rollout_metrics
from learner.train.trainer import UpdateStats
from learner.update import Update

SKIPPED, CRITIC_SKIPPED = "train/skipped_optimizer_steps", "train/critic_skipped_optimizer_steps"


@dataclass(kw_only=True, slots=True)
class Totals:
    """Run totals that go in every row (and come back from the checkpoint's last row on --resume)."""

    skipped_optimizer_steps: int = 0  # optimizer steps that failed (learner/train/step_check.py)
    refused_batches: int = 0  # rollout batches refused before training (learner/train/batch.py)
    critic_skipped_optimizer_steps: int = 0  # the GAE critic's failed optimizer steps (its weights stayed as they were)

    @classmethod
    def of(cls, row: dict) -> Totals:
        """From a checkpoint's last row (a checkpoint written before the keys named optimizer steps has the old keys)."""
        return cls(
            skipped_optimizer_steps=int(row.get(SKIPPED, row.get("train/skipped_steps", 0))),
            refused_batches=int(row.get("train/refused_batches", 0)),
            critic_skipped_optimizer_steps=int(row.get(CRITIC_SKIPPED, row.get("train/critic_skipped_steps", 0))),
        )

    def add(self, stats: UpdateStats) -> None:
        self.skipped_optimizer_steps += len(stats.failed_steps)
        self.critic_skipped_optimizer_steps += len(stats.critic_failed_steps)


def update_row(step: int, update: Update, totals: Totals, *, step_s: float, wall_s: float, part_names: set[str], critic: bool) -> dict:
    """The row of update `step`. `part_names`: the reward part names reported so far (learner/record/rollout_stats.py adds
    this batch's, within its bound); `critic`: whether the run trains one (its skipped steps are then reported)."""
    stats, groups = update.stats, update.groups
    stale = [update.start - g.version_min for g in groups]
    rollout = rollout_metrics(groups, [item.group for item in update.filtered], part_names)
    return {
        "step": step,
        "policy_version": update.version,
        "reward_mean": float(np.mean([g.rewards.mean() for g in groups])),
        "samples": stats.samples,
        "staleness_max": max(stale),
        "staleness_mean": float(np.mean(stale)),
        "logprob_mismatch": stats.logprob_mismatch,
        "on_policy_tokens": stats.on_policy_tokens,
        "packing_efficiency": stats.packing_efficiency,
        "padded_efficiency": stats.padded_efficiency,
        **stats.extra,
        "tokens_per_s": stats.tokens / step_s,
        "samples_per_s": stats.samples / step_s,
        "wall_s": wall_s,
        "loss": stats.loss,
        "clip_frac": stats.clip_frac,
        "grad_norm": stats.grad_norm,
        "adv_abs_mean": float(update.advantages.abs().mean()),
        "max_staleness": update.max_staleness,
        "groups_filtered": len(update.filtered),
        SKIPPED: totals.skipped_optimizer_steps,
        **({CRITIC_SKIPPED: totals.critic_skipped_optimizer_steps} if critic else {}),
        "train/refused_batches": totals.refused_batches,
        "batch/actors": len({g.actor_id for g in groups}),
        **rollout,
        "batch/on_policy_actors": len({g.actor_id for g, s in zip(groups, stale, strict=True) if s == 0}),
        "time/wait": update.wait_s,
        "time/train": update.train_s,
        "time/step": step_s,
    }
