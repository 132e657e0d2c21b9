"""Advantage estimators, each a small unit chosen once from `[algo] advantage` by `make_advantage`.

Shapes: `rewards` is [G, n] (groups x samples_per_prompt, samples in group order);
token tensors are flat [T] over the completion tokens of the samples, concatenated
in the same order; `lengths` [S = G * n] gives each sample's completion length.

- grpo / dr_grpo / rloo / reinforce_baseline: one number per sample from its group's rewards (reinforce_baseline
  also from the whole batch's), broadcast to its tokens. Computed on learner rank 0 before the batch is cut
  (learner/train/shard.py: make_shares), so a group and the batch may span ranks.
- gae: per token from a critic's values; the outcome reward sits on the sample's last token, plus a per-token
  reward where there is one (the KL penalty of algo.kl_in_reward, learner/train/kl.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from protocol.config import AlgoConfig


def grpo(rewards: torch.Tensor, eps: float = 1e-6, unbiased: bool = False) -> torch.Tensor:
    """GRPO: (r - mean(group)) / (std(group) + eps). A group of equal rewards gives 0.

    `unbiased` (algo.grpo_std) picks the std: False divides the squared deviations by n (the population std),
    True by n - 1 (torch.std's default, used by verl's compute_grpo_outcome_advantage and SimpleRL), which makes
    the advantages sqrt((n - 1) / n) as large."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=unbiased)
    return (rewards - mean) / (std + eps)


def dr_grpo(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO: r - mean(group), no division by the group's std (which over-weights easy/hard prompts)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i - mean of the group's other n - 1 rewards, = n / (n - 1) (r_i - mean(group)).

    As OpenRLHF's `rloo` (baseline = (sum - r) / (n - 1)) and verl's compute_rloo_outcome_advantage; the config
    requires n >= 2 (rollout.samples_per_prompt)."""
    n = rewards.shape[1]
    assert n >= 2, "RLOO needs at least 2 samples per group"
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)


def reinforce_baseline(rewards: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """REINFORCE++-baseline (Hu et al. 2025): r - mean(group), then whitened over every completion token of the
    whole rollout batch: (a - mean) / sqrt(max(var, eps)), mean and population variance over tokens, so each sample
    weighs its completion length (`lengths` [G, n]).

    As OpenRLHF's `reinforce_baseline` (group mean subtracted, the advantages normalised over all action tokens
    with var.clamp(min=1e-8).rsqrt()); verl's compute_reinforce_plus_plus_baseline_outcome_advantage does the same
    with masked_whiten (variance with n - 1, rsqrt(var + 1e-8)). After the batch whitening a group of equal
    rewards is no longer 0: it gets -mean / std."""
    assert rewards.shape == lengths.shape, (rewards.shape, lengths.shape)
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).double()
    weights = lengths.double()
    mean = (centred * weights).sum() / weights.sum()
    var = ((centred - mean).square() * weights).sum() / weights.sum()
    return ((centred - mean) * var.clamp(min=eps).rsqrt()).to(rewards.dtype)


def informative_groups(rewards: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """bool [G]: False where every reward of the group is equal (within `tol`): no group-relative signal."""
    return (rewards.amax(dim=1) - rewards.amin(dim=1)) > tol


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    gamma: float,
    lam: float,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per sample: (advantages [T], returns [T]).

    rewards [S] (outcome reward per sample), values [T] (critic's value of each completion
    token's state), lengths [S]. The reward lands on the sample's last token, 0 elsewhere, plus
    `token_rewards` [T] on every token when given (the KL penalty of algo.kl_in_reward); the value
    after the last token is 0 (terminal). Backwards through each sample:
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
    if token_rewards is not None:
        assert token_rewards.shape == values.shape, (token_rewards.shape, values.shape)
        r[rows, cols] += token_rewards.detach().double()
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


GroupNormalise = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rewards [G, n], lengths [G, n]) -> [G, n]


@dataclass(frozen=True, slots=True)
class GroupAdvantage:
    """grpo / dr_grpo / rloo / reinforce_baseline: the group-relative advantage of a sample, the same for all its tokens."""

    normalise: GroupNormalise
    needs_critic: ClassVar[bool] = False

    def per_sample(self, rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """rewards [G, n], completion lengths [G, n] -> [G, n], for the whole rollout batch at once."""
        return self.normalise(rewards, lengths)

    def __call__(
        self,
        rewards: torch.Tensor,
        lengths: torch.Tensor,
        values: torch.Tensor | None = None,
        token_rewards: torch.Tensor | None = None,
    ) -> Advantages:
        assert token_rewards is None, "per-token rewards need gae (the config refuses algo.kl_in_reward with group advantages)"
        lengths = lengths.long().to(rewards.device)
        per_sample = self.normalise(rewards, lengths.reshape(rewards.shape)).reshape(-1)
        return Advantages(tokens=torch.repeat_interleave(per_sample, lengths), returns=None)


@dataclass(frozen=True, slots=True)
class GAEAdvantage:
    """gae (PPO with a critic): per-token advantages and returns from the critic's values."""

    gamma: float
    lam: float
    needs_critic: ClassVar[bool] = True

    def __call__(
        self,
        rewards: torch.Tensor,
        lengths: torch.Tensor,
        values: torch.Tensor | None = None,
        token_rewards: torch.Tensor | None = None,
    ) -> Advantages:
        """`token_rewards` [T]: a reward on every completion token besides the outcome (algo.kl_in_reward's penalty)."""
        assert values is not None, "gae needs the critic's values of the batch"
        tokens, returns = gae(rewards.reshape(-1), values, lengths, self.gamma, self.lam, token_rewards)
        return Advantages(tokens=tokens, returns=returns)


def make_advantage(algo: AlgoConfig) -> GroupAdvantage | GAEAdvantage:
    """The estimator named by `algo.advantage` (validated by the config)."""
    if algo.advantage == "gae":
        return GAEAdvantage(gamma=algo.gamma, lam=algo.lam)
    unbiased = algo.grpo_std == "unbiased"
    group: dict[str, GroupNormalise] = {
        "grpo": lambda rewards, _: grpo(rewards, unbiased=unbiased),
        "dr_grpo": lambda rewards, _: dr_grpo(rewards),
        "rloo": lambda rewards, _: rloo(rewards),
        "reinforce_baseline": reinforce_baseline,
    }
    return GroupAdvantage(normalise=group[algo.advantage])
