"""The PPO ratio's options (learner/train/ratio.py): what it is clipped against (algo.old_logprobs), token vs
sequence ratio (GSPO), off-policy sequence masking, and the config's checks of them, against values by hand."""

import math

import pytest
import torch

from learner.train.aggregation import Denominators, Segments
from learner.train.losses import make_policy_loss
from learner.train.ratio import Behaviour, NoMask, Recompute, SequenceMask, SequenceRatio, TokenRatio
from protocol.config import AlgoConfig, ConfigError, load_config


def loss_fn(**kw):
    kw.setdefault("correction", "none")
    return make_policy_loss(AlgoConfig(clip_low=0.2, clip_high=0.28, **kw))


def test_recompute_clips_against_the_learners_logprobs_not_the_engines():
    """On-policy, the first step's learner logprobs are prox: the ratio is exactly 1 and nothing clips, however far
    the engine's logprobs are (here 1 nat off on every token, which clips all of them against behaviour)."""
    logp = torch.tensor([-1.0, -2.0, -0.5]).requires_grad_()
    behaviour = logp.detach() - 1.0
    adv = torch.tensor([1.0, -1.0, 2.0])
    norm = Denominators(tokens=3)
    out = loss_fn(old_logprobs="recompute")(logp, behaviour, adv, norm, prox_logp=logp.detach())
    assert out.ratio_mean.item() == 1.0 and out.clip_frac.item() == 0.0
    assert out.loss.item() == pytest.approx(-(1.0 - 1.0 + 2.0) / 3)
    out.loss.backward()
    assert torch.equal(logp.grad, -adv / 3)  # a plain policy gradient: d(-r A / 3)/dlogp at r = 1
    against_behaviour = loss_fn()(logp.detach(), behaviour, adv, norm)
    assert against_behaviour.ratio_mean.item() == pytest.approx(math.e) and against_behaviour.clip_frac.item() == 1.0


def test_sequence_ratio_is_the_samples_geometric_mean_with_each_tokens_own_gradient():
    # two samples: tokens 0-1 with log-ratios [.2, .4] (mean .3), tokens 2-4 with [-.1, .1, 0] (mean 0)
    old = torch.tensor([-1.0, -2.0, -1.0, -3.0, -2.0])
    logp = (old + torch.tensor([0.2, 0.4, -0.1, 0.1, 0.0])).requires_grad_()
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, 1.0])
    seg = Segments.of([2, 3])
    out = loss_fn(ratio="sequence")(logp, old, adv, Denominators(tokens=5), segments=seg)
    s0 = math.exp(0.3)  # above 1.28, but A < 0: min(-s0, -1.28) = -s0, the unclipped branch
    assert out.ratio_mean.item() == pytest.approx((2 * s0 + 3) / 5)
    assert out.clip_frac.item() == pytest.approx(2 / 5)
    assert out.loss.item() == pytest.approx(-(-2 * s0 + 3) / 5, abs=1e-6)
    out.loss.backward()
    # d(-s_i A / 5)/dlogp_t = -s_i A / 5 for every token of sample i: the same within a sample (a token ratio would
    # give -e^.2 A / 5 and -e^.4 A / 5 to tokens 0 and 1)
    assert torch.allclose(logp.grad, torch.tensor([s0 / 5, s0 / 5, -0.2, -0.2, -0.2]), atol=1e-6)
    token = loss_fn()(logp.detach(), old, adv, Denominators(tokens=5))
    assert token.clip_frac.item() == pytest.approx(1 / 5)  # only token 1 (e^.4) lies outside [.8, 1.28]


def test_sequence_ratio_log_is_bounded():
    logp = torch.tensor([-1.0, -1.0]).requires_grad_()
    out = loss_fn(ratio="sequence", correction="tis")(
        logp, torch.tensor([-301.0, -1.0]), torch.tensor([-1.0, -1.0]), Denominators(tokens=2), segments=Segments.of([2])
    )
    out.loss.backward()  # mean log-ratio 150 -> bounded at 20; the dual clip floors the objective at 2 A
    assert out.loss.item() == pytest.approx(2.0) and torch.isfinite(logp.grad).all()


def test_sequence_mask_drops_off_policy_samples_policy_gradient_only():
    """seq_mask_bound .5: sample 0's mean |prox - behaviour| is .3 (kept), sample 1's .8 (its surrogate is dropped;
    its KL term stays, and the token count does not change)."""
    prox = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    behaviour = prox - torch.tensor([0.1, 0.5, 0.8, 0.8, 0.8])
    logp = prox.clone().requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    ref = prox - 1.0  # k1 = 1 per token
    fn = loss_fn(old_logprobs="recompute", seq_mask_bound=0.5, kl_coef=0.1, kl_estimator="k1")
    out = fn(logp, behaviour, adv, Denominators(tokens=5), prox_logp=prox, segments=Segments.of([2, 3]), ref_logp=ref)
    assert out.masked_frac is not None and out.masked_frac.item() == pytest.approx(3 / 5)
    assert out.loss.item() == pytest.approx((-2 * 1.0 + 0.1 * 5) / 5, abs=1e-6)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-0.2 + 0.02, -0.2 + 0.02, 0.02, 0.02, 0.02]), atol=1e-6)
    # the bound is inclusive: |mean| = .8 stays in at .8
    keep = SequenceMask(bound=0.8)(prox, behaviour, Segments.of([2, 3]))
    assert keep is not None and bool(keep.all())


def test_sequence_mask_compares_the_learner_before_the_update_with_the_engine():
    """The mask reads prox (the learner before the update), never the moving logp: later steps drop the same samples."""
    prox, behaviour = torch.zeros(2), torch.tensor([-1.0, -1.0])
    fn = loss_fn(seq_mask_bound=0.5)  # behaviour anchor: the mask still needs prox
    assert fn.needs_prox and fn.needs_segments
    moved = torch.tensor([-1.0, -1.0])  # logp has moved onto behaviour; prox has not
    out = fn(moved, behaviour, torch.ones(2), Denominators(tokens=2), prox_logp=prox, segments=Segments.of([2]))
    assert out.masked_frac is not None and out.masked_frac.item() == 1.0 and out.loss.item() == 0.0


def test_make_policy_loss_picks_the_ratio_units_once():
    default = loss_fn()
    assert isinstance(default.anchor, Behaviour) and isinstance(default.ratio, TokenRatio) and isinstance(default.mask, NoMask)
    assert not default.needs_prox and not default.needs_segments
    rec = loss_fn(old_logprobs="recompute")
    assert isinstance(rec.anchor, Recompute) and rec.needs_prox and not rec.needs_segments
    gspo = loss_fn(ratio="sequence")
    assert isinstance(gspo.ratio, SequenceRatio) and gspo.needs_segments and not gspo.needs_prox
    masked = loss_fn(seq_mask_bound=0.3)
    assert isinstance(masked.mask, SequenceMask) and masked.mask.bound == 0.3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.tis_cap=1.0"], r"^algo\.tis_cap: must be > 1"),
        (["algo.correction=decoupled"], r"^algo\.correction: decoupled clips against .* algo\.old_logprobs = recompute$"),
        (["algo.seq_mask_bound=-0.1"], r"^algo\.seq_mask_bound: must be >= 0"),
        (["algo.old_logprobs=vllm"], r"^algo\.old_logprobs: 'vllm' must be behaviour or recompute$"),
        (["algo.ratio=seq"], r"^algo\.ratio: 'seq' must be token or sequence$"),
        (["algo.ratio=sequence", "train.sequence_parallel_size=2"], r"^algo\.ratio: a per-sample mean .* = 2 yet"),
        (["algo.seq_mask_bound=0.5", "train.sequence_parallel_size=2"], r"^algo\.seq_mask_bound: a per-sample mean"),
    ],
)
def test_config_refuses(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_config_defaults_train_as_before():
    algo = AlgoConfig()
    assert (algo.old_logprobs, algo.ratio, algo.seq_mask_bound, algo.loss_agg) == ("behaviour", "token", 0.0, "token_mean")
    ok = load_config(None, ["algo.correction=decoupled", "algo.old_logprobs=recompute", "algo.tis_cap=1.01"]).algo
    assert ok.correction == "decoupled"
