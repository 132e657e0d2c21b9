"""The policy loss (three corrections, KL, entropy) and the value loss against values computed by hand.

The ratio's options (old_logprobs, ratio, seq_mask_bound) and the loss aggregation are in test_ratio.py and
test_aggregation.py."""

import math

import pytest
import torch

from learner.train.aggregation import Denominators
from learner.train.kl import kl_k1, kl_k3
from learner.train.losses import (
    DecoupledPPO,
    NoCorrection,
    PolicyLoss,
    TruncatedIS,
    make_policy_loss,
    value_loss,
)
from learner.train.scoring import ChunkedLogprobs
from protocol.config import AlgoConfig

# Five tokens shared by the correction tests; clip range [0.8, 1.28] (clip_low .2, clip_high .28).
#   t0: r 1.0, A  2 -> inside, surr 2
#   t1: r 1.5, A  1 -> clipped high: min(1.5, 1.28) = 1.28, no gradient
#   t2: r 0.5, A -1 -> clipped low: min(-.5, -.8) = -.8, no gradient
#   t3: r 4.0, A -1 -> outside, but the unclipped branch wins: min(-4, -1.28) = -4 (tis truncates it)
#   t4: r 0.7, A  1 -> outside low, unclipped branch wins: min(.7, .8) = .7
RATIOS = [1.0, 1.5, 0.5, 4.0, 0.7]
ADV = torch.tensor([2.0, 1.0, -1.0, -1.0, 1.0])


def loss_fn(correction: str, **kw) -> PolicyLoss:
    if correction == "decoupled":
        kw.setdefault("old_logprobs", "recompute")  # decoupled clips against the recomputed logprobs
    return make_policy_loss(AlgoConfig(correction=correction, clip_low=0.2, clip_high=0.28, tis_cap=2.0, **kw))


def test_no_correction_by_hand():
    logp = torch.log(torch.tensor(RATIOS)).requires_grad_()
    out = loss_fn("none")(logp, torch.zeros(5), ADV, norm=Denominators(tokens=5))
    assert out.loss.item() == pytest.approx(-(2.0 + 1.28 - 0.8 - 4.0 + 0.7) / 5, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(4 / 5)  # t1..t4 lie outside [0.8, 1.28]
    assert out.ratio_mean.item() == pytest.approx(sum(RATIOS) / 5, abs=1e-6)
    assert out.trunc_frac.item() == 0.0 and out.iw_mean is None and out.kl_mean is None
    out.loss.backward()
    # d(-r A / 5)/dlogp = -r A / 5 on the unclipped branch, 0 where the clipped branch is taken
    assert torch.allclose(logp.grad, torch.tensor([-0.4, 0.0, 0.0, 0.8, -0.14]), atol=1e-6)


def test_tis_truncates_negative_advantage_ratio():
    logp = torch.log(torch.tensor(RATIOS)).requires_grad_()
    out = loss_fn("tis")(logp, torch.zeros(5), ADV, norm=Denominators(tokens=5))
    # t3: max(-4, cap * A = -2) = -2; t2 stays -.8 (already above -2)
    assert out.loss.item() == pytest.approx(-(2.0 + 1.28 - 0.8 - 2.0 + 0.7) / 5, abs=1e-6)
    assert out.trunc_frac.item() == pytest.approx(1 / 5)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-0.4, 0.0, 0.0, 0.0, -0.14]), atol=1e-6)  # t3 is constant now


def test_decoupled_clips_against_proximal_dual_clips_and_caps_the_behaviour_weight():
    # prox = 0, so r = exp(logp); behaviour = -log(w) gives raw weights exp(prox - behaviour) = w
    raw_w = torch.tensor([1.0, 3.0, 0.5, 1.5, 1.0])  # t1's 3.0 is capped at tis_cap = 2
    logp = torch.log(torch.tensor(RATIOS)).requires_grad_()
    prox = torch.zeros(5, requires_grad=True)
    out = loss_fn("decoupled")(logp, -torch.log(raw_w), ADV, norm=Denominators(tokens=5), prox_logp=prox)
    # clipped surrogate [2, 1.28, -.8, -4, .7]; the dual clip floors t3 at tis_cap A = -2, as tis does;
    # times w = [1, 2, .5, 1.5, 1]: [2, 2.56, -.4, -3, .7]
    assert out.loss.item() == pytest.approx(-(2.0 + 2.56 - 0.4 - 3.0 + 0.7) / 5, abs=1e-6)
    assert out.iw_mean is not None and out.iw_max is not None
    assert out.iw_mean.item() == pytest.approx((1 + 2 + 0.5 + 1.5 + 1) / 5)
    assert out.iw_max.item() == pytest.approx(2.0)
    assert out.trunc_frac.item() == pytest.approx(2 / 5)  # t1's weight cap, t3's dual clip
    out.loss.backward()
    # -w r A / 5 where unclipped: t0 -1*1*2/5, t4 -1*.7*1/5; t3 is constant now; the weight carries no gradient
    assert torch.allclose(logp.grad, torch.tensor([-0.4, 0.0, 0.0, 0.0, -0.14]), atol=1e-6)
    assert prox.grad is None


def test_decoupled_bounds_both_log_ratios():
    """A learner logprob 200 nats from prox (and prox 200 from behaviour) made exp overflow: inf x 0 in the unselected
    branch, a NaN gradient, a skipped step. Both log-ratios are bounded at +-20 before exp, as under none and tis."""
    logp = torch.tensor([-1.0, -201.0, -1.0]).requires_grad_()
    prox = torch.tensor([-201.0, -1.0, -1.0])
    behaviour = torch.tensor([-1.0, -1.0, -201.0])
    out = loss_fn("decoupled")(logp, behaviour, torch.tensor([1.0, -1.0, 1.0]), norm=Denominators(tokens=3), prox_logp=prox)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all(), (out.loss, logp.grad)
    # t0: r = e^20 clipped at 1.28 (no gradient), w = e^-20; t1: r = e^-20, A < 0: min(-e^-20, -.8) = -.8;
    # t2: r = 1, w = e^20 capped at 2
    assert out.loss.item() == pytest.approx(-(1.28 * math.exp(-20) - 0.8 + 2.0) / 3, abs=1e-6)


def test_decoupled_equals_tis_when_behaviour_is_proximal():
    """The behaviour weight is 1 where behaviour = prox; what is left is tis's dual-clipped surrogate."""
    torch.manual_seed(0)
    behaviour, adv = -torch.rand(8), torch.randn(8)
    logp_a = (behaviour + 0.5 * torch.randn(8)).requires_grad_()
    logp_b = logp_a.detach().clone().requires_grad_()
    a = loss_fn("tis")(logp_a, behaviour, adv, norm=Denominators(tokens=8))
    b = loss_fn("decoupled")(logp_b, behaviour, adv, norm=Denominators(tokens=8), prox_logp=behaviour)
    (a.loss + b.loss).backward()
    assert a.loss.item() == pytest.approx(b.loss.item(), abs=1e-7)
    assert torch.allclose(logp_a.grad, logp_b.grad)


def test_make_policy_loss_picks_one_unit_each():
    assert isinstance(loss_fn("none").correction, NoCorrection)
    assert isinstance(loss_fn("tis").correction, TruncatedIS)
    dec = loss_fn("decoupled")
    assert isinstance(dec.correction, DecoupledPPO) and dec.needs_prox and not loss_fn("tis").needs_prox
    assert loss_fn("tis", kl_estimator="k1").kl is kl_k1 and loss_fn("tis").kl is kl_k3
    assert loss_fn("tis", kl_coef=0.1).needs_reference and not loss_fn("tis").needs_reference
    assert loss_fn("tis", entropy_coef=0.01).needs_entropy and not loss_fn("tis").needs_entropy


def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.4]))
    # k1 = log(p / p_ref) = [log 2, log .5]
    assert torch.allclose(kl_k1(logp, ref), torch.tensor([math.log(2), math.log(0.5)]), atol=1e-6)
    # k3 = q - log q - 1 with q = p_ref / p = [.5, 2]: [.5 + log 2 - 1, 2 - log 2 - 1]
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 2 - math.log(2) - 1]), atol=1e-6)
    # in the loss (A = 0, so only the KL term): .1 * (0.193147 + 0.306853) / 2 = .025
    out = loss_fn("none", kl_coef=0.1)(logp, logp, torch.zeros(2), norm=Denominators(tokens=2), ref_logp=ref)
    assert out.loss.item() == pytest.approx(0.025, abs=1e-6)
    assert out.kl_mean is not None and out.kl_mean.item() == pytest.approx(0.25, abs=1e-6)


def chunked_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The trainer's entropy (learner/train/scoring.py) of given logits: hidden = the logits, lm_head = identity."""
    eye = torch.eye(logits.shape[1], dtype=logits.dtype)
    return ChunkedLogprobs.apply(logits, eye, torch.zeros(len(logits), dtype=torch.long), temperature, 2, True)[:, 1]


def test_entropy_of_known_distributions():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: log 4
            [math.log(0.5), math.log(0.25), math.log(0.25), -1e4],  # .5 log 2 + 2 * .25 log 4 = 1.5 log 2
            [0.0, -1e4, -1e4, -1e4],  # one-hot: 0, not nan
        ]
    )
    h = chunked_entropy(logits)
    assert torch.allclose(h, torch.tensor([math.log(4), 1.5 * math.log(2), 0.0]), atol=1e-6)
    # temperature divides the logits first: doubled logits at T = 2 give the same distribution
    assert torch.allclose(chunked_entropy(2 * logits[:2], temperature=2.0), h[:2], atol=1e-6)
    # the bonus is subtracted: -.01 * (log 4 + 1.5 log 2 + 0) / 4 tokens (A = 0)
    out = loss_fn("none", entropy_coef=0.01)(torch.zeros(3), torch.zeros(3), torch.zeros(3), norm=Denominators(tokens=4), entropy=h)
    assert out.loss.item() == pytest.approx(-0.01 * (math.log(4) + 1.5 * math.log(2)) / 4, abs=1e-7)
    assert out.entropy_mean is not None and out.entropy_mean.item() == pytest.approx((math.log(4) + 1.5 * math.log(2)) / 3)


def test_entropy_gradient_raises_entropy():
    logits = torch.tensor([[2.0, 0.0, -1.0, -1e4]], requires_grad=True)
    (-chunked_entropy(logits).sum()).backward()
    # descending -H moves the top logit down and the lowest finite one up; a vanishing one gets 0, not nan
    assert logits.grad[0, 0] > 0 > logits.grad[0, 2]
    assert logits.grad[0, 3].item() == 0.0


def test_gradient_of_full_loss_on_one_token_by_hand():
    # r = 1.1 (inside [.8, 1.2]), A = .5, k3 to ref p = .5 with coef .1, total_tokens 2 (another micro-batch holds the other)
    logp = torch.tensor([math.log(1.1)], requires_grad=True)
    ref = torch.tensor([math.log(0.5)])
    loss = make_policy_loss(AlgoConfig(correction="tis", kl_coef=0.1, kl_estimator="k3"))
    out = loss(logp, torch.zeros(1), torch.tensor([0.5]), norm=Denominators(tokens=2), ref_logp=ref)
    q = 0.5 / 1.1  # p_ref / p
    assert out.loss.item() == pytest.approx((-1.1 * 0.5 + 0.1 * (q - math.log(q) - 1)) / 2, abs=1e-6)
    out.loss.backward()
    # d/dlogp: surrogate -r A; k3: 1 - q
    assert logp.grad.item() == pytest.approx((-1.1 * 0.5 + 0.1 * (1 - q)) / 2, abs=1e-6)


def test_token_level_aggregation_splits_exactly_across_micro_batches():
    torch.manual_seed(0)
    logp, behaviour, adv, ref, ent = -torch.rand(10), -torch.rand(10), torch.randn(10), -torch.rand(10), torch.rand(10)
    for correction in ("none", "tis", "decoupled"):
        fn = loss_fn(correction, kl_coef=0.05, entropy_coef=0.01)
        prox = logp + 0.1

        def part(s, fn=fn, prox=prox):
            return fn(logp[s], behaviour[s], adv[s], norm=Denominators(tokens=10), prox_logp=prox[s], ref_logp=ref[s], entropy=ent[s]).loss

        whole = part(slice(0, 10))
        parts = part(slice(0, 3)) + part(slice(3, 10))
        assert whole.item() == pytest.approx(parts.item(), abs=1e-6), correction


def test_value_loss_clipped_vs_unclipped_by_hand():
    # value_clip .2 around V_old = 0
    values = torch.tensor([0.1, 0.5, 0.5, -0.3], requires_grad=True)
    old, returns = torch.zeros(4), torch.tensor([1.0, 1.0, -1.0, 0.0])
    out = value_loss(values, old, returns, value_clip=0.2, total_tokens=4)
    # t0 inside: .5 * .81; t1 past the clip toward R: max(.25, (.2 - 1)^2 = .64) -> .5 * .64, no gradient
    # t2 away from R: max(2.25, 1.44) -> .5 * 2.25; t3 away from R = 0: max(.09, .04) -> .5 * .09
    assert out.loss.item() == pytest.approx(0.5 * (0.81 + 0.64 + 2.25 + 0.09) / 4, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(3 / 4)
    out.loss.backward()
    # (V - R) / 4 where the unclipped term wins, 0 where the clipped one does
    assert torch.allclose(values.grad, torch.tensor([-0.9 / 4, 0.0, 1.5 / 4, -0.3 / 4]), atol=1e-6)
    # with a wide clip nothing clips: plain .5 (V - R)^2
    wide = value_loss(values, old, returns, value_clip=10.0, total_tokens=4)
    assert wide.loss.item() == pytest.approx(0.5 * (0.81 + 0.25 + 2.25 + 0.09) / 4, abs=1e-6)
    assert wide.clip_frac.item() == 0.0
