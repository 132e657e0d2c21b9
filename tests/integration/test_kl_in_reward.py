"""algo.kl_in_reward through the real trainer (DeepSpeed, the tiny model, a CPU): the reference model is built, and
`_prepare` puts -kl_coef * (behaviour - reference) on every completion token before GAE, with the outcome reward on
the last token; the policy loss has no KL term then (tests/unit/test_kl.py)."""

import math

import torch

from tests.integration.test_step_failures import make_trainer, one_share


def test_kl_in_reward_penalises_every_token_before_gae(tiny_model_dir):
    coef = 0.1
    cfg, trainer = make_trainer(
        tiny_model_dir,
        "train.zero_stage=2",
        "algo.advantage=gae",
        "algo.critic_lr=1e-3",
        f"algo.kl_coef={coef}",
        "algo.kl_estimator=k1",
        "algo.kl_in_reward=true",
    )
    assert trainer.reference is not None and trainer.policy_loss.kl_coef == 0
    assert (cfg.algo.gamma, cfg.algo.lam) == (1.0, 1.0)  # so A_t = R + (the penalties from t to the end) - V_t
    share = one_share(cfg, trainer)  # behaviour logprob -2.5 on every token
    mb = trainer.build(share.samples[:8], share.version)
    extra = trainer._prepare(mb)
    penalty = -coef * (mb.behaviour_logp - extra["ref"])  # k1 of the behaviour policy against the reference
    assert penalty.abs().min() > 1e-3, "the reference must disagree with the made-up behaviour logprobs"
    expect, start = [], 0
    for reward, length in zip(mb.rewards.tolist(), mb.lengths.tolist(), strict=True):
        to_go = torch.flip(torch.cumsum(torch.flip(penalty[start : start + length], [0]), 0), [0])
        expect.append(reward + to_go - extra["old_values"][start : start + length])
        start += length
    assert torch.allclose(extra["advantages"], torch.cat(expect), atol=1e-5)
    assert torch.allclose(extra["returns"], extra["advantages"] + extra["old_values"], atol=1e-5)
    stats = trainer.update(share)
    assert stats.failed_steps == [] and math.isfinite(stats.extra["loss/kl"])  # the KL is still measured
