"""algo.old_logprobs = recompute through the real trainer (DeepSpeed ZeRO-2 on the tiny model, one CPU process):
the ratio is clipped against the learner's own logprobs, so the first mini-batch of an on-policy update has ratio
exactly 1 and nothing clips there, whatever the engine's logprobs say."""

import dataclasses

import pytest
import torch

from bench.synthetic import synthetic_groups
from learner.train.losses import make_policy_loss


class Recorder:
    """The trainer's policy loss, with each call's ratio mean and clip fraction kept (one call per micro-batch)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.calls.append((out.ratio_mean.item(), out.clip_frac.item()))
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
            "staleness.max_staleness=1",
            "train.micro_batch_samples=4",
            "train.warmup_steps=0",
            "train.lr=1e-2",
            "train.zero_stage=2",
            "algo.correction=none",
            *overrides,
        ],
    )
    init_distributed()
    torch.manual_seed(0)
    layout = UpdateLayout.of(make_plan(cfg, num_prompts=100))
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    return cfg, Trainer(cfg, model, make_topology(1), layout)


def share_for(cfg, trainer, behaviour_logp):
    from learner.train.shard import make_shares

    groups = synthetic_groups(
        groups=4, samples=4, seed=5, version=0, prompt_len=4, completion=(1, 4), vocab=(3, 20), behaviour_logp=behaviour_logp
    )
    return make_shares(cfg, groups, 0, cfg.staleness.max_staleness, 1, vocab_size=trainer.vocab_size)[0][0]


@pytest.mark.parametrize("mini_batches", [1, 2], ids=["S=1", "S=2"])
def test_recompute_ratio_is_one_on_the_first_mini_batch(tiny_model_dir, mini_batches, monkeypatch):
    """Behaviour logprobs of about -0.1 for tokens the tiny model gives about -3: against them every ratio is near
    e^-3 and clips. Recomputed, the first mini-batch's ratio is 1 on every token. S = 1 takes its prox from the step
    itself (no extra forward); S = 2 makes one no-grad pass per micro-batch before the first step."""
    cfg, trainer = make_trainer(tiny_model_dir, f"train.mini_batches={mini_batches}", "algo.old_logprobs=recompute")
    share = share_for(cfg, trainer, behaviour_logp=-0.1)
    micro_per_mini = len(share.micro_sizes[0])
    trainer.update(share)  # past a first optimizer step that may run at lr 0 (warm-up): from here every step moves
    scores = []
    real_score = trainer._score
    monkeypatch.setattr(trainer, "_score", lambda mb, entropy: scores.append(1) or real_score(mb, entropy))
    trainer.policy_loss = rec = Recorder(trainer.policy_loss)
    stats = trainer.update(share)
    steps = mini_batches * micro_per_mini
    assert len(rec.calls) == steps and len(scores) == steps + (steps if mini_batches > 1 else 0)
    first = rec.calls[:micro_per_mini]
    assert all(ratio == pytest.approx(1.0, abs=1e-6) and clip == 0.0 for ratio, clip in first), first
    assert stats.failed_steps == [] and stats.applied_steps == mini_batches
    if mini_batches > 1:  # the first step moved the weights (lr 1e-2): the second mini-batch's ratio is not 1
        assert any(ratio != pytest.approx(1.0, abs=1e-4) for ratio, _ in rec.calls[micro_per_mini:]), rec.calls

    # The same update against the behaviour logprobs (today's default): nearly every token clips.
    trainer.policy_loss = behaviour = Recorder(make_policy_loss(dataclasses.replace(cfg.algo, old_logprobs="behaviour")))
    trainer.update(share)
    assert all(clip > 0.9 and ratio < 0.2 for ratio, clip in behaviour.calls[:micro_per_mini]), behaviour.calls
