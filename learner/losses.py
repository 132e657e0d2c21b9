"""Advantage estimators and the clipped policy loss, each a small unit chosen once from the config.

Shapes: `rewards` is [groups, samples_per_prompt]; token tensors are [tokens] for the
whole micro-batch, flat (samples concatenated), with `token_adv` already broadcast
from each sample to its tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps), std unbiased=False. A group of equal rewards gives 0."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO: r - mean(group), no division by the group's std (which over-weights easy/hard prompts)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


ADVANTAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages}


@dataclass(kw_only=True, slots=True)
class PolicyLossOut:
    loss: torch.Tensor  # scalar: sum of token losses / `total_tokens` (token-level aggregation)
    clip_frac: torch.Tensor  # fraction of tokens whose ratio was clipped
    ratio_mean: torch.Tensor


def ppo_clip_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    token_adv: torch.Tensor,
    clip_eps: float,
    tis_cap: float,
    total_tokens: int,
) -> PolicyLossOut:
    """Clipped surrogate with the ratio taken against the behaviour logprobs.

        r      = exp(logp - behaviour_logp)                  (behaviour: the distribution sampled)
        surr   = min(r * A, clip(r, 1 - eps, 1 + eps) * A)
        tis    : for A < 0 the unclipped branch grows without bound as r grows (stale or
                 mismatched samples); the ratio there is truncated at `tis_cap`, so
                 surr = max(surr, tis_cap * A). tis_cap = 0 disables the truncation.
        loss   = -sum(surr) / total_tokens                   (token-level: every token weighs the same,
                                                              whatever its sequence's length)
    `total_tokens` counts the tokens of the whole optimizer step, so micro-batches add up exactly.
    """
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * token_adv
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * token_adv
    surr = torch.minimum(unclipped, clipped)
    if tis_cap > 0:
        surr = torch.where(token_adv < 0, torch.maximum(surr, tis_cap * token_adv), surr)
    with torch.no_grad():
        clip_frac = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).float().mean()
    return PolicyLossOut(loss=-surr.sum() / total_tokens, clip_frac=clip_frac, ratio_mean=ratio.detach().mean())
