"""The learning rate at each optimizer step (learner/train/lr_schedule.py), and the AdamW settings DeepSpeed is given
(learner/train/engines.py). The real engine following both: tests/integration/test_optimizer_schedule.py."""

import math
import re

import pytest
import torch

from learner.train.lr_schedule import lr_multiplier, lr_scheduler
from protocol.config import ConfigError, load_config


def m(t, schedule="constant", warmup=0, total=100, min_ratio=0.0):
    return lr_multiplier(t, schedule=schedule, warmup=warmup, total=total, min_ratio=min_ratio)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_the_first_optimizer_step_runs_above_zero(schedule):
    """DeepSpeed's WarmupLR ran the first two steps at lr 0 (and with warmup_steps 0 or 1, the third at half)."""
    assert m(0, schedule, warmup=10) == pytest.approx(1 / 10)  # peak / warmup_steps
    assert m(0, schedule, warmup=1) == 1.0
    assert m(0, schedule, warmup=0) == 1.0  # no warmup: the peak from the first step
    assert [m(t, schedule, warmup=4) for t in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_values_at_chosen_steps():
    # constant: the peak after warmup, to the end and beyond
    assert [m(t, "constant", warmup=2) for t in (2, 50, 99, 500)] == [1.0] * 4
    # linear over T = 100 from step W = 10: p = (t - 10) / 90, floor 0.1
    lin = {t: m(t, "linear", warmup=10, min_ratio=0.1) for t in (10, 55, 99, 100, 200)}
    assert lin == pytest.approx({10: 1.0, 55: 0.55, 99: 0.1 + 0.9 / 90, 100: 0.1, 200: 0.1})
    # open-instruct's linear (warmup 0, floor 0): Hugging Face's get_linear_schedule_with_warmup, (T - t) / T
    assert [m(t, "linear", total=4) for t in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    # cosine: half a cosine from 1 to the floor
    cos = {t: m(t, "cosine", warmup=10, min_ratio=0.2) for t in (10, 55, 100)}
    assert cos == pytest.approx({10: 1.0, 55: 0.2 + 0.8 * 0.5, 100: 0.2})
    assert m(32, "cosine", total=128) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    # a warmup as long as the run: no room to decay, no division by zero
    assert m(5, "linear", warmup=5, total=5) == 1.0


def test_the_scheduler_deepspeed_gets_is_a_lambda_lr_of_that_function():
    cfg = load_config(None, ["train.warmup_steps=3", "train.lr_schedule=cosine", "train.min_lr_ratio=0.5"]).train
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = lr_scheduler(cfg, total=10)(opt)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.0 * m(t, "cosine", warmup=3, total=10, min_ratio=0.5) for t in range(12)])
    assert sched.state_dict()["lr_lambdas"] == [None]  # its checkpoint holds the step count, not the function


def test_deepspeed_gets_the_configured_adamw_and_no_scheduler_of_its_own():
    from learner.train.engines import UpdateLayout, deepspeed_config

    layout = UpdateLayout(mini_batches=1, ppo_epochs=1, micro_samples=1, accumulation=1, run_steps=10)
    cfg = load_config(None, ["train.adam_betas=[0.9, 0.95]", "train.adam_eps=1e-6", "train.weight_decay=0.01"])
    params = deepspeed_config(cfg, layout, 3e-4, cuda=False)["optimizer"]["params"]
    assert (params["lr"], params["betas"], params["eps"], params["weight_decay"]) == (3e-4, [0.9, 0.95], 1e-6, 0.01)
    default = deepspeed_config(load_config(None), layout, 3e-4, cuda=False)
    assert (default["optimizer"]["params"]["betas"], default["optimizer"]["params"]["eps"]) == ([0.9, 0.999], 1e-8)
    assert "scheduler" not in default  # learner/train/lr_schedule.py's, handed to deepspeed.initialize


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.adam_betas=[0.9]", "train.adam_betas"),
        ("train.adam_betas=[0.9, 1.0]", "train.adam_betas"),
        ("train.adam_eps=0", "train.adam_eps"),
        ("train.lr_schedule=step", "train.lr_schedule"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio"),
    ],
)
def test_bad_optimizer_settings_name_their_field(override, field):
    with pytest.raises(ConfigError, match="^" + re.escape(field) + ":"):
        load_config(None, [override])


def test_a_decay_needs_steps_after_the_warmup():
    from learner.plan import make_plan

    with pytest.raises(ConfigError, match=r"^train\.warmup_steps: 100 >= the run's 100 optimizer steps"):
        make_plan(load_config(None, ["train.lr_schedule=linear", "train.warmup_steps=100"]))
    make_plan(load_config(None, ["train.lr_schedule=constant", "train.warmup_steps=100"]))  # nothing to decay
