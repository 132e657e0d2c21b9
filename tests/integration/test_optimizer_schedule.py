"""The optimizer the learner's DeepSpeed engines run (learner/train/engines.py), on the tiny model, on a CPU:
train.adam_betas and train.adam_eps reach the torch AdamW inside ZeRO, and each optimizer step runs at the learning
rate learner/train/lr_schedule.py gives it, for the policy and the GAE critic alike. The resumed schedule:
tests/integration/test_resume.py."""

import pytest
import torch

from learner.train.lr_schedule import lr_multiplier

STEPS = 6  # the run's optimizer steps: train.total_steps x 1 mini-batch


def test_engines_take_the_configured_adamw_and_follow_the_schedule(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from learner.train.distributed import init_distributed, make_topology
    from learner.train.engines import UpdateLayout, build_engines
    from protocol.config import load_config

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "train.zero_stage=2",
            "train.adam_betas=[0.8, 0.95]",
            "train.adam_eps=1e-6",
            "train.lr=1e-3",
            "train.warmup_steps=2",
            "train.lr_schedule=linear",
            "train.min_lr_ratio=0.1",
            f"train.total_steps={STEPS}",
            "algo.advantage=gae",
            "algo.critic_lr=1e-4",
        ],
    )
    init_distributed()
    torch.manual_seed(0)
    layout = UpdateLayout(mini_batches=1, ppo_epochs=1, micro_samples=2, accumulation=1, run_steps=STEPS)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    engines = build_engines(cfg, model, make_topology(1), layout, "sdpa", critic=True, reference=False)
    policy, critic = engines.policy, engines.critic
    for engine in (policy, critic):
        inner = engine.optimizer.optimizer  # the torch AdamW inside ZeRO: what takes the step
        assert isinstance(inner, torch.optim.AdamW)
        assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in inner.param_groups)
    ids = torch.randint(0, 10, (2, 8))
    seen: dict[str, list[float]] = {"policy": [], "critic": []}
    for _ in range(STEPS):
        seen["policy"].append(policy.get_lr()[0])
        policy.backward(policy(input_ids=ids).logits.float().pow(2).mean())
        policy.step()
        seen["critic"].append(critic.get_lr()[0])
        critic.backward(critic(input_ids=ids).pow(2).mean())
        critic.step()
    expected = [lr_multiplier(t, schedule="linear", warmup=2, total=STEPS, min_ratio=0.1) for t in range(STEPS)]
    assert expected == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.325])
    assert seen["policy"] == pytest.approx([1e-3 * m for m in expected])  # the first step at lr / 2, not 0
    assert seen["critic"] == pytest.approx([1e-4 * m for m in expected])
    assert policy.global_steps == critic.global_steps == STEPS and policy.skipped_steps == 0
