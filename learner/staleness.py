"""Bounded staleness: the admission rule that keeps waste near zero, and the hard check.

Version u is the learner's optimizer-step count. A sample generated at version v
may train the update u -> u+1 only if u - v <= k (k = max_staleness).

Admission: a prompt granted now is generated at the current version u or later,
so it is usable by updates u .. u+k. The dispatcher fills those slots and no
more: `prompts_per_step` prompts per admissible update, minus what is already
granted or buffered. While update u is running, its batch is taken, so slot u is
gone. With k = 0 this is the synchronous on-policy loop: no grant while training.
"""

from __future__ import annotations


def next_update(version: int, training: bool) -> int:
    """Index of the earliest update that can still take new samples (update j produces j+1)."""
    return version + 1 if training else version


def admission_capacity(version: int, training: bool, max_staleness: int, prompts_per_step: int, outstanding: int) -> int:
    """How many more prompts may be granted now. `outstanding` = granted + received but not yet trained."""
    slots = version + max_staleness - next_update(version, training) + 1
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


def admissible(learner_version: int, sample_version: int, max_staleness: int) -> bool:
    """The hard invariant, checked for every sample before it is trained on."""
    return staleness(learner_version, sample_version) <= max_staleness
