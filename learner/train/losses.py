"""The policy loss (clipped surrogate + off-policy correction + KL + entropy) and the critic's value loss.

Token tensors are flat [T] over a micro-batch's completion tokens (samples concatenated),
advantages already per token. Aggregation is token-level: every sum is divided by
`total_tokens`, the completion tokens of the whole optimizer step, so gradient-accumulated
micro-batches add up to exactly the full-batch loss, and every token weighs the same
whatever its sequence's length.

The off-policy correction is one small unit per `[algo] correction`, chosen once by
`make_policy_loss`:
- none:      r = exp(logp - behaviour); surr = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
- tis:       as none, and where A < 0 the ratio is truncated at tis_cap: surr = max(surr, tis_cap A)
- decoupled: AReaL's decoupled PPO: clip against the proximal policy (the learner before this update)
             and weight by the behaviour importance weight w = min(exp(prox - behaviour), tis_cap)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from learner.train.kl import make_kl
from protocol.config import AlgoConfig

# Bound on |logp - behaviour| before exp (verl clamps the same way). exp overflows float32 past 88; a behaviour
# logprob an actor got wrong by that much (-200 for a likely token) made every gradient NaN (0 x inf in the
# unselected branch of the min) and DeepSpeed skipped the whole step. A ratio of e^20 is far outside any clip
# range: clamping only zeroes the gradient of tokens that are clipped or truncated anyway, except under
# correction = none with A < 0, where it was astronomically large.
LOG_RATIO_BOUND = 20.0


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """min(r A, clip(r, 1 - clip_low, 1 + clip_high) A): no gain from moving r past the clip range."""
    return torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)


def _outside(ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    return (ratio < 1 - clip_low) | (ratio > 1 + clip_high)


@dataclass(kw_only=True, slots=True)
class Surrogate:
    surr: torch.Tensor  # [T] per-token objective (maximised)
    ratio: torch.Tensor  # [T] detached: the ratio that was clipped
    clipped: torch.Tensor  # bool [T]: ratio outside [1 - clip_low, 1 + clip_high]
    truncated: torch.Tensor  # bool [T]: the tis_cap bound was active
    weight: torch.Tensor | None  # [T] detached behaviour importance weight (decoupled only)


@dataclass(frozen=True, slots=True)
class NoCorrection:
    """Plain PPO clip against the behaviour logprobs."""

    clip_low: float
    clip_high: float
    needs_prox: ClassVar[bool] = False

    def __call__(
        self, logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, prox_logp: torch.Tensor | None = None
    ) -> Surrogate:
        ratio = torch.exp(torch.clamp(logp - behaviour_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        surr = clipped_surrogate(ratio, adv, self.clip_low, self.clip_high)
        return Surrogate(
            surr=surr,
            ratio=ratio.detach(),
            clipped=_outside(ratio.detach(), self.clip_low, self.clip_high),
            truncated=torch.zeros_like(adv, dtype=torch.bool),
            weight=None,
        )


@dataclass(frozen=True, slots=True)
class TruncatedIS:
    """PPO clip plus dual clip: for A < 0 the unclipped branch r A grows without bound as r grows
    (stale or mismatched samples); truncating r at `cap` there bounds each token's loss by cap |A|."""

    clip_low: float
    clip_high: float
    cap: float
    needs_prox: ClassVar[bool] = False

    def __call__(
        self, logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, prox_logp: torch.Tensor | None = None
    ) -> Surrogate:
        s = NoCorrection(clip_low=self.clip_low, clip_high=self.clip_high)(logp, behaviour_logp, adv)
        bound = self.cap * adv
        truncated = (adv < 0) & (s.surr < bound)
        return replace(s, surr=torch.where(truncated, bound, s.surr), truncated=truncated.detach())


@dataclass(frozen=True, slots=True)
class DecoupledPPO:
    """AReaL's decoupled PPO: the trust region is around the proximal policy (the learner's own
    logprobs before this update), not the stale behaviour policy; the behaviour -> proximal gap is
    corrected by an importance weight, truncated at `cap` so one very stale token cannot dominate."""

    clip_low: float
    clip_high: float
    cap: float
    needs_prox: ClassVar[bool] = True

    def __call__(
        self, logp: torch.Tensor, behaviour_logp: torch.Tensor, adv: torch.Tensor, prox_logp: torch.Tensor | None = None
    ) -> Surrogate:
        assert prox_logp is not None, "decoupled PPO needs the proximal logprobs (learner, before this update)"
        prox_logp = prox_logp.detach()
        ratio = torch.exp(logp - prox_logp)
        raw_weight = torch.exp(prox_logp - behaviour_logp)
        weight = torch.clamp(raw_weight, max=self.cap)
        surr = weight * clipped_surrogate(ratio, adv, self.clip_low, self.clip_high)
        return Surrogate(
            surr=surr,
            ratio=ratio.detach(),
            clipped=_outside(ratio.detach(), self.clip_low, self.clip_high),
            truncated=raw_weight > self.cap,
            weight=weight,
        )


Correction = NoCorrection | TruncatedIS | DecoupledPPO


@dataclass(kw_only=True, slots=True)
class PolicyLossOut:
    loss: torch.Tensor  # scalar: (-sum(surr) + kl_coef sum(kl) - entropy_coef sum(H)) / total_tokens
    clip_frac: torch.Tensor  # share of this micro-batch's tokens whose ratio was outside the clip range
    ratio_mean: torch.Tensor  # mean ratio (against behaviour; against proximal for decoupled)
    trunc_frac: torch.Tensor  # share of tokens where the tis_cap truncation was active
    iw_mean: torch.Tensor | None  # decoupled: mean behaviour importance weight (after the cap)
    iw_max: torch.Tensor | None  # decoupled: max of it
    kl_mean: torch.Tensor | None  # mean per-token KL estimate to the reference (when ref_logp is given)
    entropy_mean: torch.Tensor | None  # mean token entropy (when entropy is given)


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """The whole policy objective of one micro-batch; built once from [algo] by `make_policy_loss`."""

    correction: Correction
    kl_coef: float
    kl: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    entropy_coef: float

    @property
    def needs_prox(self) -> bool:
        """The trainer must pass prox_logp: its own logprobs of the batch before this update, detached."""
        return self.correction.needs_prox

    @property
    def needs_reference(self) -> bool:
        """The trainer must pass ref_logp from a frozen reference model."""
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        """The trainer must pass the token entropy (with its graph: the bonus has a gradient)."""
        return self.entropy_coef > 0

    def __call__(
        self,
        logp: torch.Tensor,
        behaviour_logp: torch.Tensor,
        adv: torch.Tensor,
        total_tokens: int,
        *,
        prox_logp: torch.Tensor | None = None,
        ref_logp: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> PolicyLossOut:
        assert logp.shape == behaviour_logp.shape == adv.shape, (logp.shape, behaviour_logp.shape, adv.shape)
        assert total_tokens >= logp.numel(), f"total_tokens {total_tokens} < {logp.numel()} tokens in this micro-batch"
        assert ref_logp is not None or not self.needs_reference, "kl_coef > 0 needs ref_logp"
        assert entropy is not None or not self.needs_entropy, "entropy_coef > 0 needs entropy"
        s = self.correction(logp, behaviour_logp, adv, prox_logp)
        loss = -s.surr.sum() / total_tokens
        kl_mean = entropy_mean = None
        if ref_logp is not None:
            kl = self.kl(logp, ref_logp.detach())
            if self.kl_coef > 0:
                loss = loss + self.kl_coef * kl.sum() / total_tokens
            kl_mean = kl.detach().mean()
        if entropy is not None:
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * entropy.sum() / total_tokens
            entropy_mean = entropy.detach().mean()
        w = s.weight
        return PolicyLossOut(
            loss=loss,
            clip_frac=s.clipped.float().mean(),
            ratio_mean=s.ratio.mean(),
            trunc_frac=s.truncated.float().mean(),
            iw_mean=None if w is None else w.mean(),
            iw_max=None if w is None else w.max(),
            kl_mean=kl_mean,
            entropy_mean=entropy_mean,
        )


def make_correction(algo: AlgoConfig) -> Correction:
    if algo.correction == "none":
        return NoCorrection(clip_low=algo.clip_low, clip_high=algo.clip_high)
    if algo.correction == "tis":
        return TruncatedIS(clip_low=algo.clip_low, clip_high=algo.clip_high, cap=algo.tis_cap)
    assert algo.correction == "decoupled", algo.correction  # the config validated it
    return DecoupledPPO(clip_low=algo.clip_low, clip_high=algo.clip_high, cap=algo.tis_cap)


def make_policy_loss(algo: AlgoConfig) -> PolicyLoss:
    # algo.kl_in_reward spends the KL in GAE's rewards instead (learner/train/kl.py): no KL term here, but the KL to
    # the reference is still measured when the trainer passes ref_logp.
    return PolicyLoss(
        correction=make_correction(algo),
        kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
        kl=make_kl(algo),
        entropy_coef=algo.entropy_coef,
    )


@dataclass(kw_only=True, slots=True)
class ValueLossOut:
    loss: torch.Tensor  # scalar: 0.5 sum(max(unclipped, clipped squared error)) / total_tokens
    clip_frac: torch.Tensor  # share of tokens whose new value left [V_old - value_clip, V_old + value_clip]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float, total_tokens: int) -> ValueLossOut:
    """Clipped value loss: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), token-level.

    Taking the max makes the clip pessimistic: a value that ran past the trust region toward R
    gets no gradient, one that moved away from R still does. values [T] (with grad), old_values
    [T] (the critic before this update), returns [T] (GAE targets)."""
    assert values.shape == old_values.shape == returns.shape, (values.shape, old_values.shape, returns.shape)
    old_values, returns = old_values.detach(), returns.detach()
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    with torch.no_grad():
        clip_frac = ((values - old_values).abs() > value_clip).float().mean()
    return ValueLossOut(loss=per_token.sum() / total_tokens, clip_frac=clip_frac)
