"""Which optimizer steps of an update reached the weights, and which failed.

    each micro-batch:         note_loss(step, loss)        non-finite losses counted on the device (no sync)
    after each optimizer step: stepped()                   DeepSpeed's skip flag and gradient norm of that step
    after the update's all-reduce of the loss flags: settle(flags) -> StepOutcome(applied, failed)

DeepSpeed skips a step whose gradients are not finite (its "OVERFLOW! Skipping step": under ZeRO 1-3
in float32 and bfloat16 it checks the gradient norm) and counts it in `engine.skipped_steps`; the step
still counts in `global_steps`, but the weights did not move. A step fails when DeepSpeed skipped it,
or its loss or gradient norm was not finite on any rank. Every rank settles the same outcome: the
skip flag and the norm are global in DeepSpeed, and the loss flags are all-reduced with the metrics.

A failed step that DeepSpeed applied anyway is one whose gradients it did not check (ZeRO stage 0 in
float32): the weights may now hold NaN, so settle() raises NonFiniteStep and the learner stops; resume
from the last checkpoint.

The GAE critic has its own engine and its own watch: a critic step that failed leaves the critic as it was
(counted, train/critic_skipped_optimizer_steps) and does not touch the policy's outcome; one applied with NaN would
make every later advantage NaN, so it stops the learner too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class NonFiniteStep(RuntimeError):
    """An optimizer step applied a non-finite loss or gradient to the weights."""


@dataclass(frozen=True, slots=True)
class StepOutcome:
    applied: int  # optimizer steps that changed the weights: the version advances by this many
    failed: list[int]  # steps (0-based within the update) skipped by DeepSpeed or with a non-finite loss or norm


class StepWatch:
    def __init__(self, engine, steps: int, device: torch.device, name: str = "policy"):
        self.engine, self.name = engine, name
        self.loss_flags = torch.zeros(steps, dtype=torch.float64, device=device)  # micro-batches with a non-finite loss
        self._skipped = engine.skipped_steps
        self.skips: list[bool] = []
        self.norms: list = []  # DeepSpeed's norm of each step: a float, a device tensor, or None (not computed)

    def note_loss(self, step: int, loss: torch.Tensor) -> None:
        self.loss_flags[step] += (~torch.isfinite(loss.detach())).double()

    def stepped(self) -> None:
        """Right after the optimizer step at a mini-batch's last micro-batch."""
        skipped = self.engine.skipped_steps
        self.skips.append(skipped != self._skipped)
        self._skipped = skipped
        self.norms.append(self.engine.get_global_grad_norm())

    def settle(self, loss_flags: list[float]) -> StepOutcome:
        """`loss_flags`: `self.loss_flags` summed over the ranks."""
        assert len(self.skips) == len(loss_flags), f"{len(self.skips)} steps watched, {len(loss_flags)} loss flags"
        norms = [None if n is None else float(n) for n in self.norms]
        failed = [
            s
            for s, (skip, bad, norm) in enumerate(zip(self.skips, loss_flags, norms, strict=True))
            if skip or bad > 0 or (norm is not None and not math.isfinite(norm))
        ]
        for s in failed:
            norm = norms[s]
            if not self.skips[s] and (norm is None or not math.isfinite(norm)):
                raise NonFiniteStep(
                    f"{self.name} optimizer step {s} of this update applied a non-finite loss or gradient (norm {norm}): DeepSpeed "
                    "checks gradients only under ZeRO (train.zero_stage >= 1) or bfloat16; the weights may hold NaN, "
                    "resume from the last checkpoint"
                )
        return StepOutcome(applied=len(self.skips) - sum(self.skips), failed=failed)
