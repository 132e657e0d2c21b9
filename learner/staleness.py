"""Bounded staleness: the admission rule that keeps waste near zero, and the hard check.

Version u is the learner's optimizer-step count. A sample generated at version v
may train the optimizer step u -> u+1 only if u - v <= k (k = max_staleness).

An update trains one rollout batch in S = mini_batches x ppo_epochs optimizer steps,
u -> u+S, so a sample in a batch taken at version u is last used by step u+S-1 and
is admissible only if (u + S - 1) - v <= k. With S = 1 this is u - v <= k.

Admission: a prompt granted now is generated at the current version u or later,
so it is usable by the updates starting at u, u+S, ... while (start + S - 1) - u <= k.
The dispatcher fills those updates' slots and no more: `prompts_per_step` prompts
per admissible update, minus what is already granted or buffered. While an update
is running its batch is taken, so its slot is gone. With k = S - 1 (k = 0 for S = 1)
this is the synchronous on-policy loop: no grant while training.
"""

from __future__ import annotations


def next_update(version: int, training: bool, steps: int = 1) -> int:
    """Version at which the earliest update that can still take new samples starts."""
    return version + steps if training else version


def admission_capacity(version: int, training: bool, max_staleness: int, prompts_per_step: int, outstanding: int, steps: int = 1) -> int:
    """How many more prompts may be granted now. `outstanding` = granted + received but not yet trained."""
    last_start = version + max_staleness - steps + 1  # latest update start that a sample of `version` can join
    first = next_update(version, training, steps)
    slots = (last_start - first) // steps + 1 if last_start >= first else 0
    return max(0, slots * prompts_per_step - outstanding)


def min_grant_version(version: int) -> int:
    """The oldest weights an actor may generate with for a grant made now: the learner's current version.

    Admission may fill slots up to update u + k, and only a sample of version >= u
    is admissible for all of them. Letting an actor that still serves u - 1 start a
    grant (allowed for update u alone) measurably wasted 10-50 groups per step in
    the demo, because arrival order decides which update takes a group.
    """
    return version


def staleness(learner_version: int, sample_version: int) -> int:
    return learner_version - sample_version


def admissible(learner_version: int, sample_version: int, max_staleness: int, steps: int = 1) -> bool:
    """The hard invariant for an update starting at `learner_version` that takes `steps` optimizer steps."""
    return staleness(learner_version + steps - 1, sample_version) <= max_staleness
