"""The KL to the frozen reference model, estimated per token, and the one place it is spent (chosen once from [algo]):

- in the policy loss (the default): + kl_coef * sum(kl) / tokens (learner/train/losses.py: PolicyLoss);
- in the reward (`algo.kl_in_reward`, GAE only): each completion token's reward gets - kl_coef * kl before GAE
  (`KLRewardPenalty`), as open-instruct's PPO (Tulu 3) and verl's `use_kl_in_reward` do; the loss then has none.

The estimators of KL(pi || pi_ref) from one sampled token, log r = logp - ref_logp (Schulman, "Approximating KL
divergence", 2020; verl's `kl_penalty`, OpenRLHF's `compute_approx_kl`, open-instruct's kl1/kl2/kl3):
    k1 = log r                      unbiased, can be negative
    k2 = (log r)^2 / 2              biased, never negative, low variance
    k3 = 1/r - 1 + log r            unbiased, never negative
Token tensors are flat [T] over a micro-batch's completion tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.config import AlgoConfig

KLEstimate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logp [T], ref_logp [T]) -> kl [T]


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log(pi / pi_ref): unbiased for KL(pi || pi_ref) on samples from pi, but can be negative."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (log(pi / pi_ref))^2: never negative, biased (verl "mse"/"k2", OpenRLHF "k2", open-instruct kl2)."""
    return 0.5 * (logp - ref_logp).square()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 = exp(ref - logp) - (ref - logp) - 1: unbiased and never negative."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


KL_ESTIMATORS: dict[str, KLEstimate] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


@dataclass(frozen=True, slots=True)
class ClampedKL:
    """An estimate bounded to [-bound, bound] per token (algo.kl_clamp), as verl bounds its k3 ("low_var_kl") to
    [-10, 10]: one token the policy has moved far from the reference (k3 grows like 1/r) cannot outweigh the rest."""

    estimate: KLEstimate
    bound: float

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        return torch.clamp(self.estimate(logp, ref_logp), -self.bound, self.bound)


def make_kl(algo: AlgoConfig) -> KLEstimate:
    """`algo.kl_estimator`, clamped to `algo.kl_clamp` when that is > 0."""
    estimate = KL_ESTIMATORS[algo.kl_estimator]
    return ClampedKL(estimate=estimate, bound=algo.kl_clamp) if algo.kl_clamp > 0 else estimate


@dataclass(frozen=True, slots=True)
class KLRewardPenalty:
    """algo.kl_in_reward: the per-token reward -kl_coef * kl(behaviour, reference) that GAE adds to the outcome reward
    on the last token (learner/train/advantages.py: gae's `token_rewards`).

    The policy side is the behaviour logprobs, the policy that sampled the tokens: the penalty is part of that
    trajectory's reward. The sources recompute the same policy's logprobs on the learner (verl `old_log_prob`,
    open-instruct's no-grad pass); in a synchronous run the two differ only by the engine's numerics."""

    coef: float
    kl: KLEstimate

    def __call__(self, behaviour_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        """[T] -> [T]: the penalty of each completion token (<= 0 for k2 and k3)."""
        return -self.coef * self.kl(behaviour_logp, ref_logp)


def make_kl_reward(algo: AlgoConfig) -> KLRewardPenalty | None:
    """The KL penalty in the reward, or None when the KL is in the loss (or off)."""
    return KLRewardPenalty(coef=algo.kl_coef, kl=make_kl(algo)) if algo.kl_in_reward else None
