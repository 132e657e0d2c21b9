"""algo.loss_agg (learner/train/aggregation.py): each mode's value by hand, and which modes give the same loss
and gradient however the mini-batch is cut into micro-batches and data-parallel ranks."""

import itertools

import numpy as np
import pytest
import torch

from learner.train.aggregation import (
    ConstantNorm,
    Denominators,
    MicroBatchTokenMean,
    Segments,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    TokenMean,
)
from learner.train.batch import Sample
from learner.train.losses import make_policy_loss
from learner.train.shard import decode_share, encode_share, split_rollout_batch
from protocol.config import AlgoConfig

# Three samples of 1, 2 and 3 completion tokens with advantages 3, 1, 2; the ratio is 1 (logp = old), so each
# token's loss term is -A: N = 6 tokens, B = 3 samples, sum_i n_i A_i = 3 + 2 + 6 = 11, sum_i A_i = 6.
LENGTHS = [1, 2, 3]
ADV = torch.tensor([3.0, 1.0, 1.0, 2.0, 2.0, 2.0])
BUDGET = 4  # rollout.max_tokens for `constant`
MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant", "micro_batch_token_mean"]
SPLIT_FREE = MODES[:4]


def loss_fn(mode: str):
    return make_policy_loss(AlgoConfig(correction="none", loss_agg=mode), max_tokens=BUDGET)


def cut_loss(mode: str, cut: list[list[int]], logp: torch.Tensor, adv: torch.Tensor = ADV) -> torch.Tensor:
    """The mini-batch's loss as the trainer adds it up: micro-batches of whole samples (`cut`: sample indices per
    micro-batch, on whatever ranks), each with its own denominators; DeepSpeed's DP mean x dp_size = the sum."""
    starts = np.cumsum([0, *LENGTHS])
    total = torch.zeros(())
    for mb in cut:
        idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mb])
        norm = Denominators(tokens=6, samples=3, micro_tokens=sum(LENGTHS[i] for i in mb), micro_batches=len(cut))
        seg = Segments.of([LENGTHS[i] for i in mb])
        total = total + loss_fn(mode)(logp[idx], logp[idx].detach(), adv[idx], norm, segments=seg).loss
    return total


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", -11 / 6),  # sum_t l_t / N
        ("seq_mean_token_mean", -6 / 3),  # (1/B) sum_i mean_t l_t = -(3 + 1 + 2) / 3
        ("seq_mean_token_sum", -11 / 3),  # (1/B) sum_i sum_t l_t
        ("constant", -11 / (3 * BUDGET)),  # (1/B) sum_i sum_t l_t / L
    ],
)
def test_each_mode_by_hand(mode, expected):
    logp = torch.zeros(6, requires_grad=True)
    loss = cut_loss(mode, [[0, 1, 2]], logp)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_micro_batch_token_mean_by_hand_depends_on_the_cut():
    """ORZ / SimpleRL: a token mean per micro-batch, micro-batches averaged. Cut {0}, {1, 2}: (3/1 + (2 + 6)/5) / 2;
    cut {0, 1}, {2}: ((3 + 2)/3 + 6/3) / 2; one micro-batch: the token mean."""
    logp = torch.zeros(6, requires_grad=True)
    assert cut_loss("micro_batch_token_mean", [[0], [1, 2]], logp).item() == pytest.approx(-(3 + 8 / 5) / 2)
    assert cut_loss("micro_batch_token_mean", [[0, 1], [2]], logp).item() == pytest.approx(-(5 / 3 + 2) / 2)
    assert cut_loss("micro_batch_token_mean", [[0, 1, 2]], logp).item() == pytest.approx(-11 / 6)


def partitions(items: list[int]):
    """Every way to cut `items` (in order of any permutation) into consecutive non-empty micro-batches."""
    for perm in itertools.permutations(items):
        for k in range(len(items)):
            for bounds in itertools.combinations(range(1, len(items)), k):
                edges = [0, *bounds, len(items)]
                yield [list(perm[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]


@pytest.mark.parametrize("mode", SPLIT_FREE)
def test_split_free_modes_give_the_same_loss_and_gradient_for_every_cut(mode):
    """A micro-batch on another rank is one more term of the same sum (the trainer scales each rank's loss by
    dp_size, DeepSpeed averages the ranks): any cut into micro-batches and ranks trains identically."""
    torch.manual_seed(0)
    base = -torch.rand(6)
    ref_logp = base.clone().requires_grad_()
    reference = cut_loss(mode, [[0, 1, 2]], ref_logp)
    reference.backward()
    for cut in partitions([0, 1, 2]):
        logp = base.clone().requires_grad_()
        loss = cut_loss(mode, cut, logp)
        loss.backward()
        assert loss.item() == pytest.approx(reference.item(), abs=1e-6), cut
        assert torch.allclose(logp.grad, ref_logp.grad, atol=1e-7), cut


def test_micro_batch_token_mean_gradient_depends_on_the_cut():
    grads = []
    for cut in ([[0], [1, 2]], [[0, 1], [2]]):
        logp = torch.zeros(6, requires_grad=True)
        cut_loss("micro_batch_token_mean", cut, logp).backward()
        grads.append(logp.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_sequence_parallel_chunk_sees_whole_sample_lengths():
    """Under SP a rank scores a range of the packed row's tokens; seq_mean_token_mean still divides each token by
    its whole sample's length, so the chunks' losses add up to the unsplit one."""
    logp = torch.zeros(6)
    norm = Denominators(tokens=6, samples=3)
    fn = loss_fn("seq_mean_token_mean")
    whole = fn(logp, logp, ADV, norm, segments=Segments.of(LENGTHS)).loss
    parts = sum(fn(logp[r], logp[r], ADV[r], norm, segments=Segments.of(LENGTHS, r)).loss for r in (slice(0, 2), slice(2, 6)))
    assert parts.item() == pytest.approx(whole.item()) == pytest.approx(-2.0)


def test_units_and_what_they_need():
    units = {m: loss_fn(m).aggregation for m in MODES}
    assert isinstance(units["token_mean"], TokenMean) and isinstance(units["seq_mean_token_sum"], SeqMeanTokenSum)
    assert isinstance(units["seq_mean_token_mean"], SeqMeanTokenMean) and loss_fn("seq_mean_token_mean").needs_segments
    assert isinstance(units["constant"], ConstantNorm) and units["constant"].budget == BUDGET
    assert isinstance(units["micro_batch_token_mean"], MicroBatchTokenMean)
    assert not any(loss_fn(m).needs_segments for m in MODES if m != "seq_mean_token_mean")
    with pytest.raises(AssertionError, match="rollout.max_tokens"):
        make_policy_loss(AlgoConfig(loss_agg="constant"))


def test_shares_carry_the_mini_batch_sample_count_over_all_ranks():
    """seq_mean_* and constant divide by the mini-batch's samples on ALL ranks; an empty completion has no token to
    average and is not counted (verl leaves fully masked sequences out the same way)."""
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            tokens=rng.integers(0, 9, 3 + c).astype(np.int32),
            prompt_len=3,
            behaviour_logprobs=np.full(c, -1.0, np.float32),
            advantage=0.0,
            reward=0.0,
            version_min=0,
            version_max=0,
        )
        for c in [2, 0, 4, 1, 3, 5, 2, 1]
    ]
    shares = split_rollout_batch(samples, mini_batches=2, dp_size=2, seed=1, version=0, max_staleness=0, micro_samples=1)
    per_mini = [sum(len(s.tokens) > s.prompt_len for s in samples) for samples in _minis(shares)]
    assert shares[0].mini_batch_samples == shares[1].mini_batch_samples == per_mini and sum(per_mini) == 7
    back = decode_share(encode_share(shares[1]))
    assert back.mini_batch_samples == shares[1].mini_batch_samples and back.mini_batch_tokens == shares[1].mini_batch_tokens


def _minis(shares):
    """The mini-batches' samples, all ranks together."""
    out = []
    for j in range(len(shares[0].micro_sizes)):
        mini = []
        for share in shares:
            start = sum(sum(m) for m in share.micro_sizes[:j])
            mini += share.samples[start : start + sum(share.micro_sizes[j])]
        out.append(mini)
    return out
