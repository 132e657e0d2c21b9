"""The PPO ratio: what it is taken against (`algo.old_logprobs`), how its log is pooled (`algo.ratio`), and which
samples are too far off-policy to train on (`algo.seq_mask_bound`). One small unit each, chosen once at setup by
learner/train/losses.py: make_policy_loss.

    old_logprobs = behaviour   r = pi / pi_behaviour: the engine's logprobs of the sampled tokens, as the actor sent them
    old_logprobs = recompute   r = pi / pi_prox: the learner's own logprobs of the batch before this update
    ratio = token              log r_t = logp_t - old_t
    ratio = sequence           GSPO: log r_t = sg[mean over the sample's tokens of (logp - old)] + logp_t - sg[logp_t]
    seq_mask_bound = b > 0     a sample with |mean over its tokens of (prox - behaviour)| > b gets no policy gradient

Why recompute: vLLM's logprobs are not the learner's even for the same weights (other kernels, bf16, its sampler),
so against them the ratio is off 1 on-policy and the clip binds on that noise. ORZ, verl, SimpleRL and
open-instruct all clip against the learner's recomputed logprobs: the first optimizer step of an update then has
ratio exactly 1 (a plain policy gradient), and later steps clip by how far this update has moved the policy.
`prox` (the learner before the update) costs one no-grad forward before the first step when the update takes
S > 1 optimizer steps (learner/train/trainer.py: _prepare); at S = 1 the step's own logprobs, detached, are it.

Token tensors are flat [T] over a micro-batch's completion tokens, in sample order (learner/train/batch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from learner.train.aggregation import Segments

# Bound on a log-ratio before exp (verl clamps the same way). exp overflows float32 past 88; a behaviour logprob an
# actor got wrong by that much (-200 for a likely token) made every gradient NaN (0 x inf in the unselected branch of
# the min) and DeepSpeed skipped the whole step. A ratio of e^20 is far outside any clip range: clamping only zeroes
# the gradient of tokens that are clipped or truncated anyway, except under correction = none with A < 0, where it
# was astronomically large. Every log-ratio that reaches exp is bounded: the PPO ratio (token or sequence) and the
# decoupled behaviour weight.
LOG_RATIO_BOUND = 20.0


def bounded(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@dataclass(frozen=True, slots=True)
class Behaviour:
    """The ratio's denominator is the behaviour policy: the engine's logprobs (FleetRL's default)."""

    needs_prox: ClassVar[bool] = False

    def __call__(self, behaviour: torch.Tensor, prox: torch.Tensor | None) -> torch.Tensor:
        return behaviour


@dataclass(frozen=True, slots=True)
class Recompute:
    """The ratio's denominator is the learner's own logprobs before this update (ORZ, verl, SimpleRL, open-instruct)."""

    needs_prox: ClassVar[bool] = True

    def __call__(self, behaviour: torch.Tensor, prox: torch.Tensor | None) -> torch.Tensor:
        assert prox is not None, "old_logprobs = recompute needs the learner's logprobs before this update"
        return prox.detach()


Anchor = Behaviour | Recompute


@dataclass(frozen=True, slots=True)
class TokenRatio:
    """PPO's per-token log-ratio."""

    needs_segments: ClassVar[bool] = False

    def __call__(self, logp: torch.Tensor, old: torch.Tensor, seg: Segments | None) -> torch.Tensor:
        return bounded(logp - old)


@dataclass(frozen=True, slots=True)
class SequenceRatio:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the ratio of a sample is its geometric mean over its tokens,
    s_i = exp(mean_t (logp - old)), clipped as one. Each token carries s_i's value and the gradient of its own logprob
    (verl's compute_policy_loss_gspo: log s_i,t = sg[log s_i] + logp_t - sg[logp_t]), so the gradient of s_i A_i is
    spread over the sample's tokens. A token's ratio no longer depends on its own noisy log-ratio alone, which is
    what makes GSPO steady for long samples and MoE routing noise. GSPO as published also averages per sample:
    loss_agg = seq_mean_token_mean (verl forces it; FleetRL leaves the two choices apart)."""

    needs_segments: ClassVar[bool] = True

    def __call__(self, logp: torch.Tensor, old: torch.Tensor, seg: Segments | None) -> torch.Tensor:
        assert seg is not None, "ratio = sequence needs each token's sample"
        seq = seg.mean((logp - old).detach())
        return bounded(seq + logp - logp.detach())


Ratio = TokenRatio | SequenceRatio


@dataclass(frozen=True, slots=True)
class NoMask:
    needs_prox: ClassVar[bool] = False
    needs_segments: ClassVar[bool] = False

    def __call__(self, prox: torch.Tensor | None, behaviour: torch.Tensor, seg: Segments | None) -> torch.Tensor | None:
        return None


@dataclass(frozen=True, slots=True)
class SequenceMask:
    """Off-policy sequence masking: a sample whose learner and behaviour logprobs disagree by more than `bound` on
    average over its tokens, |mean_t (prox - behaviour)| > bound, gets no policy gradient (its KL and entropy terms
    stay, and the aggregation still counts it). Its geometric-mean ratio exp(mean) is outside [e^-bound, e^bound]:
    OpenRLHF's and NeMo-RL's seq-mask-tis filter with [low, high] = [e^-bound, e^bound], and verl's rollout_rs =
    seq_mean_k1 with rollout_rs_threshold "e^-bound_e^bound"; all three compare the learner's logprobs before the
    update (prox) with the engine's. Such a sample was generated by a policy the learner no longer is (a stale or
    broken engine, a weight-sync fault); its per-token weights would be noise either way."""

    bound: float
    needs_prox: ClassVar[bool] = True
    needs_segments: ClassVar[bool] = True

    def __call__(self, prox: torch.Tensor | None, behaviour: torch.Tensor, seg: Segments | None) -> torch.Tensor | None:
        assert prox is not None and seg is not None, "seq_mask_bound needs prox logprobs and each token's sample"
        return seg.mean((prox.detach() - behaviour).double()).abs() <= self.bound


SeqMask = NoMask | SequenceMask
