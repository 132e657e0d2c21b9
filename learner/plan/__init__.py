"""The run plan (`fleetrl plan`, and every learner rank at start): placement, batch layout, run length and memory
per GPU, checked before anything starts, each error a ConfigError naming the field and showing the arithmetic.

    layout.py       Placement (learner ranks, SP, DP, models, actor engines) and BatchLayout (one update's
                    batch cut into mini-batches, optimizer steps, data-parallel ranks and micro-batches)
    length.py       RunLength: updates, optimizer steps, samples, epochs over the prompt set
    memory.py       LearnerMemory, ActorMemory: model states, activations (activations.py), snapshot, landing buffer
    make.py         Plan, make_plan: the four composed
    report.py       render: the plan as a text table

Words: an *update* trains one rollout batch (train.prompts_per_step prompts x rollout.samples_per_prompt
samples) in S = train.mini_batches x train.ppo_epochs *optimizer steps*; the policy version counts optimizer
steps, train.total_steps counts updates.
"""

from learner.plan.make import Plan, make_plan
from learner.plan.report import render

__all__ = ["Plan", "make_plan", "render"]
