"""Advantages and the clipped loss against values computed by hand."""

import math

import pytest
import torch

from learner.losses import dr_grpo_advantages, grpo_advantages, ppo_clip_loss


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    adv = grpo_advantages(rewards, eps=0.0 + 1e-6)
    # group 0: mean .5, std .5 -> +-1
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    # group 1: equal rewards carry no signal
    assert torch.equal(adv[1], torch.zeros(4))
    # group 2: mean .25, std sqrt(3)/4
    std = math.sqrt(3) / 4
    assert torch.allclose(adv[2], torch.tensor([0.75, -0.25, -0.25, -0.25]) / std, atol=1e-4)


def test_dr_grpo_does_not_divide_by_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(dr_grpo_advantages(rewards), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_ppo_clip_by_hand():
    # four tokens: ratio = exp(logp - behaviour) = [1.0, 1.5, 0.5, 4.0]
    behaviour = torch.zeros(4)
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 4.0])).requires_grad_()
    adv = torch.tensor([2.0, 1.0, -1.0, -1.0])
    out = ppo_clip_loss(logp, behaviour, adv, clip_eps=0.2, tis_cap=0.0, total_tokens=4)
    # surr = min(r A, clip(r) A): [2.0, min(1.5, 1.2)=1.2, min(-0.5, -0.8)=-0.8, min(-4, -1.2)=-4]
    assert out.loss.item() == pytest.approx(-(2.0 + 1.2 - 0.8 - 4.0) / 4, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(0.75)
    out.loss.backward()
    # d(-surr/4)/dlogp = -A r / 4 where the unclipped branch is taken, 0 where clipped
    assert torch.allclose(logp.grad, torch.tensor([-0.5, 0.0, 0.0, 1.0]), atol=1e-6)


def test_tis_truncates_negative_advantage_ratio():
    behaviour = torch.zeros(2)
    logp = torch.log(torch.tensor([4.0, 4.0])).requires_grad_()
    adv = torch.tensor([-1.0, 1.0])
    out = ppo_clip_loss(logp, behaviour, adv, clip_eps=0.2, tis_cap=2.0, total_tokens=2)
    # token 0: min(-4, -1.2) = -4, truncated to max(-4, 2 * -1) = -2; token 1: min(4, 1.2) = 1.2
    assert out.loss.item() == pytest.approx(-(-2.0 + 1.2) / 2, abs=1e-6)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.zeros(2))  # both branches are constants now


def test_token_level_aggregation_splits_exactly_across_micro_batches():
    torch.manual_seed(0)
    logp, behaviour, adv = -torch.rand(10), -torch.rand(10), torch.randn(10)
    whole = ppo_clip_loss(logp, behaviour, adv, 0.2, 2.0, total_tokens=10).loss
    parts = sum(ppo_clip_loss(logp[s], behaviour[s], adv[s], 0.2, 2.0, total_tokens=10).loss for s in (slice(0, 3), slice(3, 10)))
    assert whole.item() == pytest.approx(parts.item(), abs=1e-6)
