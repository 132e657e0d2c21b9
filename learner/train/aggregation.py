"""How per-token loss terms add up to one mini-batch's loss (`algo.loss_agg`), one small unit per mode.

Every mode is a per-token coefficient c_t, and a micro-batch's loss is sum_t c_t l_t over its tokens (l_t: the
token's -surrogate + KL - entropy terms). The coefficients are chosen so that the micro-batches of a mini-batch, on
every data-parallel rank, add up to the mini-batch's loss; DeepSpeed averages gradients over the DP replicas, so
the trainer scales each rank's loss by dp_size (learner/train/trainer.py). With N the mini-batch's completion tokens
and B its samples (with at least one completion token), both over ALL ranks (`Share`, learner/train/shard.py),
n_i sample i's completion tokens:

    token_mean              sum_t l_t / N                       verl token-mean, DAPO; every token weighs the same
    seq_mean_token_mean     (1/B) sum_i (1/n_i) sum_t l_t       verl seq-mean-token-mean, GRPO's paper, GSPO
    seq_mean_token_sum      (1/B) sum_i sum_t l_t               verl seq-mean-token-sum
    constant                (1/B) sum_i sum_t l_t / L           Dr. GRPO: L = rollout.max_tokens, a fixed budget
    micro_batch_token_mean  (1/K) sum_m (1/N_m) sum_t l_t       ORZ, SimpleRL (verl 0.2), open-instruct's PPO

The first four depend only on the mini-batch: however rank 0 cuts it into micro-batches and ranks, the loss and
the gradient are the same. micro_batch_token_mean is by definition a mean over micro-batches (K of them over all
DP ranks, N_m tokens each): a token's weight depends on how full its micro-batch is, so a different cut (another
token budget, another rank count) trains differently. It is what ORZ (token mean per packed row, rows averaged)
and verl 0.2 (token mean per micro-batch, divided by the accumulation steps) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from protocol.config import AlgoConfig


@dataclass(frozen=True, slots=True)
class Denominators:
    """A micro-batch's place in its mini-batch: the counts the aggregation divides by (None = not given; a mode
    asserts what it needs). A count of 0 means nothing to weigh: every mode divides by at least 1."""

    tokens: int  # completion tokens of the mini-batch, all DP ranks
    samples: int | None = None  # samples of the mini-batch with at least one completion token, all DP ranks
    micro_tokens: int | None = None  # completion tokens of this micro-batch (whole: an SP group's chunks together)
    micro_batches: int | None = None  # micro-batches of the mini-batch over all DP ranks


@dataclass(frozen=True, slots=True)
class Segments:
    """Which sample each of a micro-batch's tokens belongs to: what sequence-level terms need."""

    index: torch.Tensor  # int64 [T]: each token's sample, 0..len(lengths)-1 (tokens are in sample order)
    lengths: torch.Tensor  # int64 [S]: each sample's completion tokens (whole samples, also when SP holds a chunk)

    @staticmethod
    def of(lengths: list[int], tokens: slice | None = None) -> Segments:
        """From the micro-batch's samples' completion lengths; `tokens` keeps an SP rank's range of them."""
        n = torch.tensor(lengths, dtype=torch.long)
        index = torch.repeat_interleave(torch.arange(len(lengths)), n)
        return Segments(index=index if tokens is None else index[tokens], lengths=n)

    def to(self, device: torch.device) -> Segments:
        return Segments(index=self.index.to(device), lengths=self.lengths.to(device))

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-sample mean of `values` [T] over the sample's tokens, broadcast back to its tokens [T]."""
        sums = torch.zeros(len(self.lengths), dtype=values.dtype, device=values.device).index_add_(0, self.index, values)
        return (sums / self.lengths.clamp(min=1).to(values.dtype))[self.index]


@dataclass(frozen=True, slots=True)
class TokenMean:
    needs_segments: ClassVar[bool] = False

    def __call__(self, d: Denominators, seg: Segments | None) -> torch.Tensor | float:
        return 1.0 / max(d.tokens, 1)


@dataclass(frozen=True, slots=True)
class SeqMeanTokenMean:
    needs_segments: ClassVar[bool] = True

    def __call__(self, d: Denominators, seg: Segments | None) -> torch.Tensor | float:
        assert d.samples is not None and seg is not None, d
        return 1.0 / (max(d.samples, 1) * seg.lengths[seg.index].float())


@dataclass(frozen=True, slots=True)
class SeqMeanTokenSum:
    needs_segments: ClassVar[bool] = False

    def __call__(self, d: Denominators, seg: Segments | None) -> torch.Tensor | float:
        assert d.samples is not None, d
        return 1.0 / max(d.samples, 1)


@dataclass(frozen=True, slots=True)
class ConstantNorm:
    """Dr. GRPO: each sample's token sum over the fixed budget L, so a token's weight does not depend on how long
    its own or any other completion is (understand-r1-zero / oat: masked_sum with constant_normalizer =
    generate_max_length, then the batch mean). verl's seq-mean-token-sum-norm divides the micro-batch's sum by its
    loss_scale_factor with no 1/B: the same direction, a batch-size-dependent scale."""

    budget: int
    needs_segments: ClassVar[bool] = False

    def __call__(self, d: Denominators, seg: Segments | None) -> torch.Tensor | float:
        assert d.samples is not None, d
        return 1.0 / (max(d.samples, 1) * self.budget)


@dataclass(frozen=True, slots=True)
class MicroBatchTokenMean:
    needs_segments: ClassVar[bool] = False

    def __call__(self, d: Denominators, seg: Segments | None) -> torch.Tensor | float:
        assert d.micro_tokens is not None and d.micro_batches is not None, d
        return 1.0 / (max(d.micro_tokens, 1) * max(d.micro_batches, 1))


Aggregation = TokenMean | SeqMeanTokenMean | SeqMeanTokenSum | ConstantNorm | MicroBatchTokenMean


def make_aggregation(algo: AlgoConfig, max_tokens: int | None = None) -> Aggregation:
    """`max_tokens`: rollout.max_tokens, the generation budget `constant` divides by."""
    if algo.loss_agg == "token_mean":
        return TokenMean()
    if algo.loss_agg == "seq_mean_token_mean":
        return SeqMeanTokenMean()
    if algo.loss_agg == "seq_mean_token_sum":
        return SeqMeanTokenSum()
    if algo.loss_agg == "constant":
        assert max_tokens, "loss_agg = constant divides by rollout.max_tokens: pass it"
        return ConstantNorm(budget=max_tokens)
    assert algo.loss_agg == "micro_batch_token_mean", algo.loss_agg  # the config validated it
    return MicroBatchTokenMean()
