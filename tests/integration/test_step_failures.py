"""Optimizer steps that fail (learner/train/step_check.py), with the real DeepSpeed engine on the tiny model, on a CPU.

A non-finite loss is injected into chosen optimizer steps; DeepSpeed (ZeRO-2, float32) sees the non-finite
gradient norm and skips the step. The update reports which steps failed and how many reached the weights,
which is what learner/main.py advances the version by (tests/unit/test_group_checks.py tests the ledger side).
"""

import pytest
import torch

from bench.synthetic import synthetic_groups
from learner.train.losses import value_loss

STEPS = 2  # train.mini_batches: optimizer steps per update


class PoisonedLoss:
    """A loss (the trainer's policy loss, or the critic's value_loss) made NaN in the optimizer steps listed (counted in
    micro-batch calls)."""

    def __init__(self, inner, poison_calls: set[int]):
        self.inner, self.poison, self.calls = inner, poison_calls, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.calls in self.poison:
            out.loss = out.loss * float("nan")
        self.calls += 1
        return out


def make_trainer(model_dir, *overrides):
    from transformers import AutoModelForCausalLM

    from learner.plan import make_plan
    from learner.train.distributed import init_distributed, make_topology
    from learner.train.engines import UpdateLayout
    from learner.train.trainer import Trainer
    from protocol.config import load_config

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rollout.samples_per_prompt=4",
            "train.prompts_per_step=4",
            f"train.mini_batches={STEPS}",
            "staleness.max_staleness=1",
            "train.micro_batch_samples=8",
            "train.warmup_steps=0",
            *overrides,
        ],
    )
    init_distributed()
    torch.manual_seed(0)
    layout = UpdateLayout.of(make_plan(cfg, num_prompts=100))
    assert layout.optimizer_steps == STEPS and layout.accumulation == 1  # one micro-batch per optimizer step
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    return cfg, Trainer(cfg, model, make_topology(1), layout)


def one_share(cfg, trainer, behaviour_logp=-2.5, edit=None):
    from learner.train.shard import make_shares

    groups = synthetic_groups(
        groups=4, samples=4, seed=3, version=0, prompt_len=4, completion=(1, 4), vocab=(3, 20), behaviour_logp=behaviour_logp
    )
    if edit is not None:
        edit(groups)
    return make_shares(cfg, groups, 0, cfg.staleness.max_staleness, 1, vocab_size=trainer.vocab_size)[0][0]


def weights(trainer):
    return torch.cat([p.detach().reshape(-1).clone() for _, p in trainer.engine.module.named_parameters()])


@pytest.fixture(scope="module")
def zero2(tiny_model_dir):
    return make_trainer(tiny_model_dir, "train.zero_stage=2")


def test_a_behaviour_logprob_of_minus_200_no_longer_skips_the_update(zero2):
    """One wrong logprob made exp(logp - behaviour) overflow: NaN gradients, and DeepSpeed skipped all 256 samples.
    With the log-ratio bounded (learner/train/losses.py) the update goes through, every step applied."""
    cfg, trainer = zero2
    assert trainer.vocab_size == 20

    def wrong(groups):
        groups[2].behaviour_logprobs[0] = -200.0

    skipped = trainer.engine.skipped_steps
    stats = trainer.update(one_share(cfg, trainer, edit=wrong))
    assert stats.failed_steps == [] and stats.applied_steps == STEPS and trainer.engine.skipped_steps == skipped
    assert torch.isfinite(torch.tensor([stats.loss, stats.grad_norm])).all() and torch.isfinite(weights(trainer)).all()
    assert stats.extra["train/lr"] == pytest.approx(cfg.train.lr)  # warmup 0, constant: the peak from the first step


@pytest.mark.parametrize("poison, failed", [({1}, [1]), ({0, 1}, [0, 1])], ids=["second step", "every step"])
def test_a_skipped_step_is_reported_and_not_applied(zero2, poison, failed):
    cfg, trainer = zero2
    share = one_share(cfg, trainer)
    trainer.update(share)  # a first update, so that the poisoned one is not the run's first (every applied step moves the weights)
    before, skipped = weights(trainer), trainer.engine.skipped_steps
    real = trainer.policy_loss
    trainer.policy_loss = PoisonedLoss(real, poison)
    try:
        stats = trainer.update(share)
    finally:
        trainer.policy_loss = real
    assert stats.failed_steps == failed and stats.applied_steps == STEPS - len(failed)
    assert trainer.engine.skipped_steps == skipped + len(failed)  # DeepSpeed's own count agrees
    after = weights(trainer)
    assert torch.isfinite(after).all()
    assert torch.equal(after, before) == (stats.applied_steps == 0)  # weights move only by the applied steps


def test_a_non_finite_step_that_deepspeed_applied_stops_the_learner(tiny_model_dir):
    """ZeRO stage 0 in float32: DeepSpeed does not look at the gradients, so a NaN loss reaches the weights. The
    update raises instead of handing NaN weights to the actors."""
    from learner.train.step_check import NonFiniteStep

    cfg, trainer = make_trainer(tiny_model_dir, "train.zero_stage=0")
    trainer.policy_loss = PoisonedLoss(trainer.policy_loss, {1})
    with pytest.raises(NonFiniteStep, match="policy optimizer step 1 of this update applied a non-finite"):
        trainer.update(one_share(cfg, trainer))


def critic_weights(trainer):
    return torch.cat([p.detach().reshape(-1).clone() for p in trainer.critic.module.parameters()])


def test_a_skipped_critic_step_is_reported_and_leaves_the_policy_alone(tiny_model_dir, monkeypatch):
    """The GAE critic has its own optimizer: its failed step is counted apart (train/critic_skipped_optimizer_steps), keeps the
    critic's weights, and the policy's steps, whose advantages came from the values before the update, all apply."""
    cfg, trainer = make_trainer(tiny_model_dir, "train.zero_stage=2", "algo.advantage=gae", "algo.critic_lr=1e-3")
    share = one_share(cfg, trainer)
    trainer.update(share)  # a first update, so that the poisoned one is not the run's first
    monkeypatch.setattr("learner.train.trainer.value_loss", PoisonedLoss(value_loss, {0, 1}))
    critic_before, policy_before = critic_weights(trainer), weights(trainer)
    stats = trainer.update(share)
    assert stats.critic_failed_steps == [0, 1] and stats.failed_steps == [] and stats.applied_steps == STEPS
    assert torch.equal(critic_weights(trainer), critic_before) and not torch.equal(weights(trainer), policy_before)


def test_a_non_finite_critic_step_that_deepspeed_applied_stops_the_learner(tiny_model_dir, monkeypatch):
    """ZeRO stage 0 in float32: the NaN would reach the critic, and through its values every later advantage."""
    from learner.train.step_check import NonFiniteStep

    cfg, trainer = make_trainer(tiny_model_dir, "train.zero_stage=0", "algo.advantage=gae", "algo.critic_lr=1e-3")
    monkeypatch.setattr("learner.train.trainer.value_loss", PoisonedLoss(value_loss, {1}))
    with pytest.raises(NonFiniteStep, match="critic optimizer step 1 of this update applied a non-finite"):
        trainer.update(one_share(cfg, trainer))
