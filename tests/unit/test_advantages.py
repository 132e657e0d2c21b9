"""Advantage estimators against values computed by hand."""

import math

import pytest
import torch

from learner.train.advantages import (
    GAEAdvantage,
    GroupAdvantage,
    dr_grpo,
    gae,
    grpo,
    informative_groups,
    make_advantage,
)
from protocol.config import AlgoConfig


def test_grpo_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    adv = grpo(rewards)
    # group 0: mean .5, std .5 -> +-1 (eps 1e-6 shrinks it by 2e-6)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    # group 1: equal rewards carry no signal
    assert torch.equal(adv[1], torch.zeros(4))
    # group 2: mean .25, population std sqrt(3)/4 (the unbiased std would be 0.5)
    std = math.sqrt(3) / 4
    assert torch.allclose(adv[2], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std, atol=1e-4)


def test_dr_grpo_does_not_divide_by_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert torch.allclose(dr_grpo(rewards), torch.tensor([[0.75, -0.25, -0.25, -0.25], [0.0, 0.0, 0.0, 0.0]]))


def test_gae_by_hand_two_samples():
    # sample 0: 3 tokens, R = 1, V = [.5, .4, .6]; sample 1: 2 tokens, R = 0, V = [.3, -.2]; gamma .9, lam .8
    values = torch.tensor([0.5, 0.4, 0.6, 0.3, -0.2])
    adv, ret = gae(torch.tensor([1.0, 0.0]), values, torch.tensor([3, 2]), gamma=0.9, lam=0.8)
    # sample 0: delta = [0 + .9*.4 - .5, 0 + .9*.6 - .4, 1 + .9*0 - .6] = [-.14, .14, .4]
    #   A2 = .4, A1 = .14 + .72*.4 = .428, A0 = -.14 + .72*.428 = .16816
    # sample 1: delta = [0 + .9*(-.2) - .3, 0 + 0 + .2] = [-.48, .2]; A1 = .2, A0 = -.48 + .72*.2 = -.336
    #   (sample 0's last token does not see sample 1's first value: it is terminal)
    expect = torch.tensor([0.16816, 0.428, 0.4, -0.336, 0.2])
    assert torch.allclose(adv, expect, atol=1e-6)
    assert torch.allclose(ret, expect + values, atol=1e-6)
    assert ret[2].item() == pytest.approx(1.0) and ret[4].item() == pytest.approx(0.0, abs=1e-7)
    assert adv.dtype == ret.dtype == torch.float32


def test_gae_with_gamma_lam_one_is_reward_minus_value():
    # Open-Reasoner-Zero's setting: every token's advantage is R - V_t, its return R.
    torch.manual_seed(0)
    lengths = torch.tensor([4, 1, 6])
    rewards = torch.tensor([1.0, 0.0, 0.5])
    values = torch.randn(11)
    adv, ret = gae(rewards, values, lengths, gamma=1.0, lam=1.0)
    per_token_r = torch.tensor([1.0] * 4 + [0.0] + [0.5] * 6)
    assert torch.allclose(adv, per_token_r - values, atol=1e-6)
    assert torch.allclose(ret, per_token_r, atol=1e-6)


def test_gae_long_sequence_stays_exact():
    # 5000 telescoping terms: float64 inside keeps R - V exact to float32 rounding.
    torch.manual_seed(1)
    values = torch.randn(5000) * 10
    adv, _ = gae(torch.tensor([1.0]), values, torch.tensor([5000]), gamma=1.0, lam=1.0)
    assert (adv - (1.0 - values)).abs().max().item() < 1e-5


def test_gae_lam_zero_is_one_step_td_and_lam_one_is_monte_carlo():
    values = torch.tensor([0.2, 0.4, 0.8])
    td, _ = gae(torch.tensor([1.0]), values, torch.tensor([3]), gamma=0.5, lam=0.0)
    # delta_t = r_t + .5 V_{t+1} - V_t
    assert torch.allclose(td, torch.tensor([0.5 * 0.4 - 0.2, 0.5 * 0.8 - 0.4, 1.0 - 0.8]), atol=1e-7)
    mc, _ = gae(torch.tensor([1.0]), values, torch.tensor([3]), gamma=0.5, lam=1.0)
    # A_t = gamma^(steps to the end) R - V_t
    assert torch.allclose(mc, torch.tensor([0.25 - 0.2, 0.5 - 0.4, 1.0 - 0.8]), atol=1e-7)


def test_informative_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5 + 1e-9], [0.0, 0.0, 0.0], [0.2, 0.3, 0.2]])
    assert informative_groups(rewards).tolist() == [False, True, False, False, True]


def test_make_advantage_picks_one_unit():
    grpo_unit = make_advantage(AlgoConfig(advantage="grpo"))
    assert isinstance(grpo_unit, GroupAdvantage) and not grpo_unit.needs_critic
    # the token view broadcasts each sample's advantage over its completion tokens
    rewards = torch.tensor([[1.0, 0.0]])
    out = grpo_unit(rewards, torch.tensor([2, 3]))
    assert torch.allclose(out.tokens, torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0]), atol=1e-5) and out.returns is None
    dr = make_advantage(AlgoConfig(advantage="dr_grpo"))
    assert torch.allclose(dr.per_sample(torch.tensor([[3.0, 1.0]])), torch.tensor([[1.0, -1.0]]))
    ppo = make_advantage(AlgoConfig(advantage="gae", gamma=0.9, lam=0.8))
    assert isinstance(ppo, GAEAdvantage) and ppo.needs_critic
    out = ppo(torch.tensor([[1.0, 0.0]]), torch.tensor([3, 2]), torch.tensor([0.5, 0.4, 0.6, 0.3, -0.2]))
    assert out.returns is not None
    assert torch.allclose(out.tokens, torch.tensor([0.16816, 0.428, 0.4, -0.336, 0.2]), atol=1e-6)
