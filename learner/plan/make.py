"""The plan: placement, batch layout, run length and memory, each computed and checked by its own module."""

from __future__ import annotations

from dataclasses import dataclass

from learner.plan.layout import BatchLayout, Placement, lay_out
from learner.plan.length import RunLength, run_length
from learner.plan.memory import ActorMemory, LearnerMemory, memory
from protocol.config import Config


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    placement: Placement
    batch: BatchLayout
    length: RunLength
    learner_memory: LearnerMemory
    actor_memory: ActorMemory | None  # None: the architecture is unknown, or actor.device = "cpu"


def make_plan(cfg: Config, num_prompts: int | None = None) -> Plan:
    """Every number of the run, checked; ConfigError naming the field and showing the arithmetic.

    `num_prompts`: the training prompt count when the caller has loaded the set (the learner does);
    otherwise it is found as learner/plan/length.py's `prompt_count` says.
    """
    placement, batch = lay_out(cfg)
    length = run_length(cfg, batch, num_prompts)
    learner, actor = memory(cfg, placement, batch)
    return Plan(placement=placement, batch=batch, length=length, learner_memory=learner, actor_memory=actor)
