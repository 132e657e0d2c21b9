"""The KL estimators, their clamp, and where the KL is spent (the loss, or GAE's rewards), against values by hand."""

import math

import pytest
import torch

from learner.train.kl import ClampedKL, KLRewardPenalty, kl_k1, kl_k2, kl_k3, make_kl, make_kl_reward
from learner.train.losses import make_policy_loss
from protocol.config import AlgoConfig, ConfigError

LOGP = torch.log(torch.tensor([0.5, 0.2]))
REF = torch.log(torch.tensor([0.25, 0.4]))  # log ratio = [log 2, -log 2]


def test_k2_by_hand():
    # k2 = (log r)^2 / 2 = [(log 2)^2 / 2] x 2: the same for r and 1 / r, never negative
    half_sq = math.log(2) ** 2 / 2
    assert torch.allclose(kl_k2(LOGP, REF), torch.tensor([half_sq, half_sq]), atol=1e-7)
    assert make_policy_loss(AlgoConfig(kl_estimator="k2")).kl is kl_k2


def test_clamp_bounds_each_token():
    # log ratio 0 and -30: k3 = e^30 - 30 - 1 unclamped, 10 clamped (verl's low_var_kl bound); k1 = -30 -> -10
    logp = torch.tensor([-1.0, -31.0])
    ref = torch.tensor([-1.0, -1.0])
    assert kl_k3(logp, ref)[1].item() > 1e12
    k3 = make_kl(AlgoConfig(kl_estimator="k3", kl_clamp=10.0))
    assert isinstance(k3, ClampedKL)
    assert torch.equal(k3(logp, ref), torch.tensor([0.0, 10.0]))
    assert torch.equal(make_kl(AlgoConfig(kl_estimator="k1", kl_clamp=10.0))(logp, ref), torch.tensor([0.0, -10.0]))
    assert make_kl(AlgoConfig(kl_estimator="k1")) is kl_k1  # 0 = no clamp
    # the loss's KL term is kl_coef x its `kl` per token (tests/unit/test_losses.py): the clamped estimate
    loss = make_policy_loss(AlgoConfig(kl_coef=0.1, kl_clamp=10.0))
    assert torch.equal(loss.kl(logp, ref), torch.tensor([0.0, 10.0]))
    with pytest.raises(ConfigError, match=r"^algo\.kl_clamp: "):
        AlgoConfig(kl_clamp=-1.0)


def test_kl_in_reward_takes_the_kl_out_of_the_loss():
    in_reward = AlgoConfig(advantage="gae", kl_coef=0.1, kl_estimator="k1", kl_in_reward=True)
    # the loss's KL term is kl_coef x kl per token (tests/unit/test_losses.py): with the KL in the reward it is 0,
    # while the estimate stays, to report loss/kl; the trainer still builds the reference for the reward
    loss = make_policy_loss(in_reward)
    assert loss.kl_coef == 0 and not loss.needs_reference and loss.kl is kl_k1
    assert make_policy_loss(AlgoConfig(advantage="gae", kl_coef=0.1)).kl_coef == 0.1
    # the reward side: -kl_coef * k1 per token
    penalty = make_kl_reward(in_reward)
    assert isinstance(penalty, KLRewardPenalty)
    assert torch.allclose(penalty(LOGP, REF), torch.tensor([-0.1 * math.log(2), 0.1 * math.log(2)]), atol=1e-7)
    assert make_kl_reward(AlgoConfig(advantage="gae", kl_coef=0.1)) is None


def test_kl_in_reward_config_checks():
    with pytest.raises(ConfigError, match=r"^algo\.kl_in_reward: needs algo\.advantage = gae"):
        AlgoConfig(advantage="grpo", kl_coef=0.1, kl_in_reward=True)
    with pytest.raises(ConfigError, match=r"^algo\.kl_in_reward: needs algo\.kl_coef > 0"):
        AlgoConfig(advantage="gae", kl_in_reward=True)
    assert AlgoConfig(advantage="gae", kl_coef=0.05, kl_in_reward=True).kl_in_reward
