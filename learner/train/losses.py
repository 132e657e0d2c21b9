"""The policy loss (ratio + clipped surrogate + off-policy correction + KL + entropy, aggregated) and the critic's
value loss. `make_policy_loss` composes one small unit per choice in [algo], once:

    old_logprobs, ratio, seq_mask_bound   learner/train/ratio.py: what r is taken against, how it is pooled, which
                                          samples are too far off-policy to train on
    correction                            here: what the clipped surrogate does with r
    loss_agg                              learner/train/aggregation.py: how per-token terms add up to the loss
    kl_estimator, kl_in_reward            learner/train/kl.py

Token tensors are flat [T] over a micro-batch's completion tokens (samples concatenated), advantages already per
token. With r the ratio (against `old`, behaviour or recomputed) and A the advantage:
- none:      surr = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
- tis:       dual clip (Ye et al. 2019, arXiv 1912.09729): where A < 0, surr = max(surr, tis_cap A), i.e. r
             truncated at tis_cap there (verl's clip_ratio_c, OpenRLHF's --dual_clip)
- decoupled: AReaL's decoupled PPO: r against the proximal policy (old_logprobs = recompute), dual-clipped as tis,
             times the behaviour importance weight w = min(exp(prox - behaviour), tis_cap) (what verl, OpenRLHF and
             open-instruct call TIS)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from learner.train.aggregation import Aggregation, Denominators, Segments, TokenMean, make_aggregation
from learner.train.kl import make_kl
from learner.train.ratio import (
    Anchor,
    Behaviour,
    NoMask,
    Ratio,
    Recompute,
    SeqMask,
    SequenceMask,
    SequenceRatio,
    TokenRatio,
    bounded,
)
from protocol.config import AlgoConfig


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """min(r A, clip(r, 1 - clip_low, 1 + clip_high) A): no gain from moving r past the clip range."""
    return torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv)


def dual_clip(surr: torch.Tensor, adv: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For A < 0 the unclipped branch r A grows without bound as r grows (stale or mismatched samples); flooring
    the objective at cap A there bounds each token's loss by cap |A|. Returns (surr, where the floor is active)."""
    bound = cap * adv
    floored = (adv < 0) & (surr < bound)
    return torch.where(floored, bound, surr), floored.detach()


def _outside(ratio: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    return (ratio < 1 - clip_low) | (ratio > 1 + clip_high)


@dataclass(kw_only=True, slots=True)
class Surrogate:
    surr: torch.Tensor  # [T] per-token objective (maximised)
    ratio: torch.Tensor  # [T] detached: the ratio that was clipped
    clipped: torch.Tensor  # bool [T]: ratio outside [1 - clip_low, 1 + clip_high]
    truncated: torch.Tensor  # bool [T]: a tis_cap bound was active (the dual clip, or decoupled's weight cap)
    weight: torch.Tensor | None  # [T] detached behaviour importance weight (decoupled only)


@dataclass(frozen=True, slots=True)
class NoCorrection:
    """Plain PPO clip."""

    clip_low: float
    clip_high: float
    needs_prox: ClassVar[bool] = False

    def __call__(
        self, log_ratio: torch.Tensor, adv: torch.Tensor, prox_logp: torch.Tensor | None, behaviour_logp: torch.Tensor
    ) -> Surrogate:
        ratio = torch.exp(log_ratio)
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
    """PPO clip plus dual clip at `cap`: the ratio is truncated at cap where A < 0."""

    clip_low: float
    clip_high: float
    cap: float
    needs_prox: ClassVar[bool] = False

    def __call__(
        self, log_ratio: torch.Tensor, adv: torch.Tensor, prox_logp: torch.Tensor | None, behaviour_logp: torch.Tensor
    ) -> Surrogate:
        s = NoCorrection(clip_low=self.clip_low, clip_high=self.clip_high)(log_ratio, adv, prox_logp, behaviour_logp)
        surr, truncated = dual_clip(s.surr, adv, self.cap)
        return replace(s, surr=surr, truncated=truncated)


@dataclass(frozen=True, slots=True)
class DecoupledPPO:
    """AReaL's decoupled PPO: the trust region is around the proximal policy (the learner's own logprobs before
    this update, old_logprobs = recompute), not the stale behaviour policy, with the same dual clip as tis; the
    behaviour -> proximal gap is corrected by an importance weight, truncated at `cap` so one very stale token
    cannot dominate. Both log-ratios are bounded before exp (learner/train/ratio.py: LOG_RATIO_BOUND)."""

    clip_low: float
    clip_high: float
    cap: float
    needs_prox: ClassVar[bool] = True

    def __call__(
        self, log_ratio: torch.Tensor, adv: torch.Tensor, prox_logp: torch.Tensor | None, behaviour_logp: torch.Tensor
    ) -> Surrogate:
        assert prox_logp is not None, "decoupled PPO needs the proximal logprobs (learner, before this update)"
        ratio = torch.exp(log_ratio)
        raw_weight = torch.exp(bounded(prox_logp.detach() - behaviour_logp))
        weight = torch.clamp(raw_weight, max=self.cap)
        surr, floored = dual_clip(clipped_surrogate(ratio, adv, self.clip_low, self.clip_high), adv, self.cap)
        return Surrogate(
            surr=weight * surr,
            ratio=ratio.detach(),
            clipped=_outside(ratio.detach(), self.clip_low, self.clip_high),
            truncated=(raw_weight > self.cap) | floored,
            weight=weight,
        )


Correction = NoCorrection | TruncatedIS | DecoupledPPO


@dataclass(kw_only=True, slots=True)
class PolicyLossOut:
    loss: torch.Tensor  # scalar: sum_t c_t (-surr_t + kl_coef kl_t - entropy_coef H_t), c_t from the aggregation
    clip_frac: torch.Tensor  # share of this micro-batch's tokens whose ratio was outside the clip range
    ratio_mean: torch.Tensor  # mean ratio (against the behaviour or the recomputed logprobs, as old_logprobs says)
    trunc_frac: torch.Tensor  # share of tokens where a tis_cap bound was active
    iw_mean: torch.Tensor | None  # decoupled: mean behaviour importance weight (after the cap)
    iw_max: torch.Tensor | None  # decoupled: max of it
    kl_mean: torch.Tensor | None  # mean per-token KL estimate to the reference (when ref_logp is given)
    entropy_mean: torch.Tensor | None  # mean token entropy (when entropy is given)
    masked_frac: torch.Tensor | None = None  # seq_mask_bound: share of tokens whose sample got no policy gradient


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """The whole policy objective of one micro-batch; built once from [algo] by `make_policy_loss`."""

    correction: Correction
    kl_coef: float
    kl: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    entropy_coef: float
    anchor: Anchor = Behaviour()
    ratio: Ratio = TokenRatio()
    mask: SeqMask = NoMask()
    aggregation: Aggregation = TokenMean()

    @property
    def needs_prox(self) -> bool:
        """The trainer must pass prox_logp: its own logprobs of the batch before this update, detached."""
        return self.anchor.needs_prox or self.correction.needs_prox or self.mask.needs_prox

    @property
    def needs_segments(self) -> bool:
        """The trainer must pass segments: which sample each token belongs to."""
        return self.ratio.needs_segments or self.mask.needs_segments or self.aggregation.needs_segments

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
        norm: Denominators,
        *,
        prox_logp: torch.Tensor | None = None,
        segments: Segments | None = None,
        ref_logp: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> PolicyLossOut:
        assert logp.shape == behaviour_logp.shape == adv.shape, (logp.shape, behaviour_logp.shape, adv.shape)
        assert norm.tokens >= logp.numel(), f"{norm.tokens} mini-batch tokens < {logp.numel()} tokens in this micro-batch"
        assert ref_logp is not None or not self.needs_reference, "kl_coef > 0 needs ref_logp"
        assert entropy is not None or not self.needs_entropy, "entropy_coef > 0 needs entropy"
        assert segments is not None or not self.needs_segments, "a sequence-level term needs segments"
        log_ratio = self.ratio(logp, self.anchor(behaviour_logp, prox_logp), segments)
        s = self.correction(log_ratio, adv, prox_logp, behaviour_logp)
        keep = self.mask(prox_logp, behaviour_logp, segments)
        per_token = -(s.surr if keep is None else torch.where(keep, s.surr, 0.0))
        kl_mean = entropy_mean = None
        if ref_logp is not None:
            kl = self.kl(logp, ref_logp.detach())
            if self.kl_coef > 0:
                per_token = per_token + self.kl_coef * kl
            kl_mean = kl.detach().mean()
        if entropy is not None:
            if self.entropy_coef > 0:
                per_token = per_token - self.entropy_coef * entropy
            entropy_mean = entropy.detach().mean()
        coef = self.aggregation(norm, segments)
        loss = per_token.sum() * coef if isinstance(coef, float) else (per_token * coef).sum()
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
            masked_frac=None if keep is None else (~keep).float().mean(),
        )


def make_correction(algo: AlgoConfig) -> Correction:
    if algo.correction == "none":
        return NoCorrection(clip_low=algo.clip_low, clip_high=algo.clip_high)
    if algo.correction == "tis":
        return TruncatedIS(clip_low=algo.clip_low, clip_high=algo.clip_high, cap=algo.tis_cap)
    assert algo.correction == "decoupled", algo.correction  # the config validated it
    return DecoupledPPO(clip_low=algo.clip_low, clip_high=algo.clip_high, cap=algo.tis_cap)


def make_policy_loss(algo: AlgoConfig, max_tokens: int | None = None) -> PolicyLoss:
    """`max_tokens`: rollout.max_tokens, which loss_agg = constant divides by."""
    # algo.kl_in_reward spends the KL in GAE's rewards instead (learner/train/kl.py): no KL term here, but the KL to
    # the reference is still measured when the trainer passes ref_logp.
    return PolicyLoss(
        correction=make_correction(algo),
        kl_coef=0.0 if algo.kl_in_reward else algo.kl_coef,
        kl=make_kl(algo),
        entropy_coef=algo.entropy_coef,
        anchor=Recompute() if algo.old_logprobs == "recompute" else Behaviour(),
        ratio=SequenceRatio() if algo.ratio == "sequence" else TokenRatio(),
        mask=SequenceMask(bound=algo.seq_mask_bound) if algo.seq_mask_bound > 0 else NoMask(),
        aggregation=make_aggregation(algo, max_tokens),
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
