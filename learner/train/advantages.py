"""Advantage estimators, each a small unit chosen once from `[algo] advantage` by `make_advantage`.

Shapes: `rewards` is [G, n] (groups x samples_per_prompt, samples in group order);
token tensors are flat [T] over the completion tokens of the samples, concatenated
in the same order; `lengths` [S = G * n] gives each sample's completion length.

- grpo / dr_grpo: one number per sample from its group's rewards, broadcast to its tokens.
- gae: per token from a critic's values; the outcome reward sits on the sample's last token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from protocol.config import AlgoConfig


def grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps), std unbiased=False. A group of equal rewards gives 0."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def dr_grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO: r - mean(group), no division by the group's std (which over-weights easy/hard prompts)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def informative_groups(rewards: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """bool [G]: False where every reward of the group is equal (within `tol`): no group-relative signal."""
    return (rewards.amax(dim=1) - rewards.amin(dim=1)) > tol


def gae(rewards: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per sample: (advantages [T], returns [T]).

    rewards [S] (outcome reward per sample), values [T] (critic's value of each completion
    token's state), lengths [S]. The reward lands on the sample's last token, 0 elsewhere;
    the value after the last token is 0 (terminal). Backwards through each sample:
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   returns = A + V.
    Samples are laid out in a zero-padded [S, max_len] grid, so padding acts as the terminal
    state, and the recursion runs over time only (vectorised over samples). It runs in float64:
    with gamma = lam = 1 the sum telescopes, and float32 would drift by ~len * 6e-8 * |V|.
    """
    lengths = lengths.long()
    assert rewards.shape == lengths.shape and rewards.dim() == 1, (rewards.shape, lengths.shape)
    assert values.shape == (int(lengths.sum()),), f"values {tuple(values.shape)} vs {int(lengths.sum())} tokens"
    assert bool((lengths >= 1).all()), "every sample needs at least one completion token"
    S, L = lengths.numel(), int(lengths.max())
    rows = torch.repeat_interleave(torch.arange(S, device=values.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(values.numel(), device=values.device) - starts[rows]

    v = values.new_zeros(S, L + 1, dtype=torch.float64)  # column L: V after every last token = 0
    v[rows, cols] = values.detach().double()
    r = torch.zeros_like(v)
    r[torch.arange(S, device=values.device), lengths - 1] = rewards.double()
    delta = r[:, :L] + gamma * v[:, 1:] - v[:, :L]

    adv = torch.zeros_like(v)
    for t in range(L - 1, -1, -1):
        adv[:, t] = delta[:, t] + gamma * lam * adv[:, t + 1]
    token_adv = adv[rows, cols]
    returns = token_adv + v[rows, cols]
    return token_adv.to(values.dtype), returns.to(values.dtype)


@dataclass(kw_only=True, slots=True)
class Advantages:
    tokens: torch.Tensor  # [T] advantage of each completion token
    returns: torch.Tensor | None  # [T] critic targets (gae only)


@dataclass(frozen=True, slots=True)
class GroupAdvantage:
    """grpo / dr_grpo: the group-relative advantage of a sample, the same for all its tokens."""

    normalise: Callable[[torch.Tensor], torch.Tensor]
    needs_critic: ClassVar[bool] = False

    def per_sample(self, rewards: torch.Tensor) -> torch.Tensor:
        """[G, n] -> [G, n]."""
        return self.normalise(rewards)

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor | None = None) -> Advantages:
        per_sample = self.normalise(rewards).reshape(-1)
        return Advantages(tokens=torch.repeat_interleave(per_sample, lengths.long().to(per_sample.device)), returns=None)


@dataclass(frozen=True, slots=True)
class GAEAdvantage:
    """gae (PPO with a critic): per-token advantages and returns from the critic's values."""

    gamma: float
    lam: float
    needs_critic: ClassVar[bool] = True

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor | None = None) -> Advantages:
        assert values is not None, "gae needs the critic's values of the batch"
        tokens, returns = gae(rewards.reshape(-1), values, lengths, self.gamma, self.lam)
        return Advantages(tokens=tokens, returns=returns)


def make_advantage(algo: AlgoConfig) -> GroupAdvantage | GAEAdvantage:
    """The estimator named by `algo.advantage` (validated by the config)."""
    if algo.advantage == "gae":
        return GAEAdvantage(gamma=algo.gamma, lam=algo.lam)
    return GroupAdvantage(normalise={"grpo": grpo, "dr_grpo": dr_grpo}[algo.advantage])
