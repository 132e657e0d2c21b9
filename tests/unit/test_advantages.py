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
    reinforce_baseline,
    rloo,
)
from protocol.config import AlgoConfig, ConfigError


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


def test_grpo_unbiased_std_by_hand():
    # algo.grpo_std = unbiased (verl, SimpleRL: torch.std): group 2's std is 0.5, not sqrt(3)/4
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    unit = make_advantage(AlgoConfig(advantage="grpo", grpo_std="unbiased"))
    lengths = torch.ones(2, 4, dtype=torch.long)
    adv = unit.per_sample(rewards, lengths)
    assert torch.allclose(adv[0], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))
    # the default keeps the population std
    biased = make_advantage(AlgoConfig(advantage="grpo")).per_sample(rewards, lengths)
    assert torch.allclose(biased[0], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (math.sqrt(3) / 4), atol=1e-4)
    with pytest.raises(ConfigError, match=r"^algo\.grpo_std: "):
        AlgoConfig(advantage="dr_grpo", grpo_std="unbiased")


def test_rloo_by_hand():
    # baseline = mean of the other samples: [1, 0, 0, 0] -> 1 - 0, 0 - 1/3, ...; [2, 4] -> 2 - 4, 4 - 2
    out = rloo(torch.tensor([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0]]))
    assert torch.allclose(out, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(rloo(torch.tensor([[2.0, 4.0]])), torch.tensor([[-2.0, 2.0]]))
    unit = make_advantage(AlgoConfig(advantage="rloo"))
    assert isinstance(unit, GroupAdvantage) and not unit.needs_critic
    assert torch.allclose(unit.per_sample(torch.tensor([[2.0, 4.0]]), torch.tensor([[3, 5]])), torch.tensor([[-2.0, 2.0]]))


def test_reinforce_baseline_whitens_over_the_batch_tokens():
    # group means subtracted: [[1, 0], [1, 1]] -> [[.5, -.5], [0, 0]]; then whitened over the tokens of the batch.
    # lengths [[3, 1], [2, 2]]: 8 tokens holding .5 x3, -.5 x1, 0 x4 -> mean (1.5 - .5) / 8 = .125,
    # variance (3 (.375)^2 + (-.625)^2 + 4 (.125)^2) / 8 = (.421875 + .390625 + .0625) / 8 = .109375
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lengths = torch.tensor([[3, 1], [2, 2]])
    std = math.sqrt(0.109375)
    expect = torch.tensor([[0.375, -0.625], [-0.125, -0.125]]) / std
    assert torch.allclose(reinforce_baseline(rewards, lengths), expect, atol=1e-6)
    unit = make_advantage(AlgoConfig(advantage="reinforce_baseline"))
    assert torch.allclose(unit.per_sample(rewards, lengths), expect, atol=1e-6)
    # the token view: each sample's advantage broadcast over its tokens, whose mean is 0 and variance 1
    tokens = unit(rewards, lengths.reshape(-1)).tokens
    assert tokens.shape == (8,) and abs(tokens.mean().item()) < 1e-6
    assert tokens.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    # a batch of equal rewards stays 0 (its variance is floored at 1e-8)
    assert torch.equal(reinforce_baseline(torch.ones(2, 2), lengths), torch.zeros(2, 2))


def test_gae_adds_per_token_rewards():
    # algo.kl_in_reward: r_t = -coef * kl_t on every token, plus the outcome on the last; gamma = lam = 1, V = 0:
    # A_t = the sum of the rewards from t on. Sample 0: r = [-.1, .05 + 1] -> A = [.95, 1.05]; sample 1: r = [.2] -> .2
    penalty = torch.tensor([-0.1, 0.05, 0.2])
    adv, ret = gae(torch.tensor([1.0, 0.0]), torch.zeros(3), torch.tensor([2, 1]), 1.0, 1.0, token_rewards=penalty)
    assert torch.allclose(adv, torch.tensor([0.95, 1.05, 0.2]), atol=1e-6) and torch.allclose(ret, adv)
    plain, _ = gae(torch.tensor([1.0, 0.0]), torch.zeros(3), torch.tensor([2, 1]), 1.0, 1.0)
    assert torch.allclose(plain, torch.tensor([1.0, 1.0, 0.0]))
    ppo = make_advantage(AlgoConfig(advantage="gae", gamma=0.9, lam=0.8))
    # gamma .9, lam .8 on sample 0 with V = [.5, .4]: delta = [-.1 + .9 * .4 - .5, 1.05 - .4] = [-.24, .65];
    # A1 = .65, A0 = -.24 + .72 * .65 = .228
    out = ppo(torch.tensor([[1.0, 0.0]]), torch.tensor([2, 1]), torch.tensor([0.5, 0.4, 0.0]), penalty)
    assert torch.allclose(out.tokens[:2], torch.tensor([0.228, 0.65]), atol=1e-6)


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
    assert torch.allclose(dr.per_sample(torch.tensor([[3.0, 1.0]]), torch.tensor([[1, 1]])), torch.tensor([[1.0, -1.0]]))
    ppo = make_advantage(AlgoConfig(advantage="gae", gamma=0.9, lam=0.8))
    assert isinstance(ppo, GAEAdvantage) and ppo.needs_critic
    out = ppo(torch.tensor([[1.0, 0.0]]), torch.tensor([3, 2]), torch.tensor([0.5, 0.4, 0.6, 0.3, -0.2]))
    assert out.returns is not None
    assert torch.allclose(out.tokens, torch.tensor([0.16816, 0.428, 0.4, -0.336, 0.2]), atol=1e-6)


def test_make_shares_whitens_reinforce_baseline_over_the_batch_tokens():
    # rank 0 (learner/train/shard.py) passes each sample's completion length: the advantages that reach the ranks
    # have zero mean and unit variance over the batch's completion tokens, not over its samples.
    from bench.synthetic import synthetic_groups
    from learner.train.shard import make_shares
    from protocol.config import load_config

    overrides = ["algo.advantage=reinforce_baseline", "rollout.samples_per_prompt=4", "train.prompts_per_step=4"]
    overrides.append("train.micro_batch_samples=16")
    cfg = load_config(None, overrides)
    groups = synthetic_groups(groups=4, samples=4, seed=3, version=0, prompt_len=4, completion=(1, 6), vocab=(3, 20), behaviour_logp=-2.5)
    shares, advantages = make_shares(cfg, groups, 0, cfg.staleness.max_staleness, 1)
    samples = shares[0].samples
    tokens = torch.cat([torch.full((len(s.tokens) - s.prompt_len,), s.advantage, dtype=torch.float64) for s in samples])
    assert len({len(s.tokens) for s in samples}) > 1 and advantages.shape == (4, 4)
    assert abs(tokens.mean().item()) < 1e-6 and tokens.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    per_sample = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    assert abs(per_sample.mean().item()) > 1e-3, "a sample-weighted whitening would have made this 0"
