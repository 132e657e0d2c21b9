"""What a rollout group must satisfy before the hub admits it: only what the model and the grant allow.

    (group, the prompt the hub granted, GroupLimits) --check_group--> None | Refusal(reason, detail)

The decoder already refused malformed groups (shapes, dtypes, NaN or inf: RolloutGroup.check); these are
the values a well-formed group from a broken or hostile actor can still carry, each of which crashed or
silently corrupted a learner before it was checked. Reasons (the hub counts each as hub/rejected_<reason>):

    prompt   its prompt tokens are not the ones the hub granted: the hub never trains a prompt it did not hand out
    length   a completion of 0 tokens, or of more than rollout.max_tokens or than the context leaves after the prompt
             (protocol/budget.py; an episode: rollout.max_episode_tokens): the engine produces 1..budget (even an
             immediate end-of-sequence is one token)
    mask     observation tokens (loss mask 0) in a run without rollout.env: only an environment adds them
    token    a completion token id outside [0, vocabulary): the embedding has no such row (an IndexError on a
             CPU, a device-side assert on a GPU, which poisons the CUDA context for good)
    logprob  a behaviour logprob of a model token above 0, or below rollout.min_logprob (see there: a sampled token
             that unlikely is, for every practical purpose, never sampled); observation tokens' slots must hold 0
    env      an episode its environment ended by failing (finish reason "env_error", rollout.env_errors = requeue):
             not the actor's fault; the prompt goes back to the queue at once
    finish   a finish reason other than "stop" or "length" (vLLM's "abort" and "error" end a completion that was
             never finished: it is not a sample of the policy)
    reward   a reward beyond +-rollout.reward_bound: float32 rewards near 3e38 overflowed the advantages (named
             reward parts only feed metrics, averaged in float64: any finite value is taken)
    parts    reward part names that are not 1..16 distinct names, sorted, of 1..64 printable characters (the
             actor's own form): each name becomes a metric, reward/part/<name>, so a rogue could mint them at will

The hub adds its own reasons from its state: `grant` (the prompt is not this actor's), `size` (not
rollout.samples_per_prompt completions), `ahead` (weights this learner never had).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from protocol import messages as m
from protocol.budget import completion_budget, episode_budget
from protocol.config import Config


@dataclass(frozen=True, slots=True)
class GroupLimits:
    vocab_size: int | None  # rows of the model's embedding; None: not checked (a hub that trains nothing: tests, benches)
    max_tokens: int  # rollout.max_tokens
    max_model_len: int  # actor.max_model_len: prompt + completion
    episodes: bool  # rollout.env is set: completions are episodes, observation tokens allowed
    max_episode_tokens: int  # rollout.max_episode_tokens
    min_logprob: float  # rollout.min_logprob
    reward_bound: float  # rollout.reward_bound

    @classmethod
    def of(cls, cfg: Config, vocab_size: int | None) -> GroupLimits:
        return cls(
            vocab_size=vocab_size,
            max_tokens=cfg.rollout.max_tokens,
            max_model_len=cfg.actor.max_model_len,
            episodes=bool(cfg.rollout.env),
            max_episode_tokens=cfg.rollout.max_episode_tokens,
            min_logprob=cfg.rollout.min_logprob,
            reward_bound=cfg.rollout.reward_bound,
        )


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str  # one word: the counter hub/rejected_<reason>
    detail: str  # for the actor's Error and the log: names the check and the offending value


def check_group(group: m.RolloutGroup, granted: np.ndarray, limits: GroupLimits) -> Refusal | None:
    """None when `group` may be admitted; otherwise the first check it fails. `granted`: the prompt's tokens."""
    if not np.array_equal(group.prompt_tokens, granted):
        return Refusal(
            "prompt", f"prompt_tokens ({len(group.prompt_tokens)} tokens) differ from the granted prompt ({len(granted)} tokens)"
        )
    lengths = group.lengths
    if limits.episodes:
        budget = episode_budget(len(granted), limits.max_episode_tokens, limits.max_model_len)
        why = f"rollout.max_episode_tokens {limits.max_episode_tokens}, actor.max_model_len {limits.max_model_len} - prompt {len(granted)}"
    else:
        budget = completion_budget(len(granted), limits.max_tokens, limits.max_model_len)
        why = f"rollout.max_tokens {limits.max_tokens}, actor.max_model_len {limits.max_model_len} - prompt {len(granted)}"
    if lengths.min() < 1 or lengths.max() > budget:
        return Refusal("length", f"completion lengths {int(lengths.min())}..{int(lengths.max())} outside 1..{budget} ({why})")
    model = group.model_tokens()
    if not limits.episodes and not model.all():
        return Refusal("mask", f"{int((~model).sum())} observation tokens (loss mask 0) in a run without rollout.env")
    tokens = group.completion_tokens
    if limits.vocab_size is not None and (tokens.min() < 0 or tokens.max() >= limits.vocab_size):
        return Refusal(
            "token",
            f"completion token ids {int(tokens.min())}..{int(tokens.max())} outside the model's vocabulary 0..{limits.vocab_size - 1}",
        )
    logprobs = group.behaviour_logprobs[model]
    if (group.behaviour_logprobs[~model] != 0).any():
        return Refusal("logprob", "behaviour logprobs of observation tokens (loss mask 0) are not 0")
    if logprobs.max() > 0 or logprobs.min() < limits.min_logprob:
        return Refusal(
            "logprob",
            f"behaviour logprobs {float(logprobs.min()):.4g}..{float(logprobs.max()):.4g} outside "
            f"[{limits.min_logprob:g}, 0] (rollout.min_logprob)",
        )
    if m.ENV_ERROR in group.finish_reasons:
        return Refusal(
            "env", f"{group.finish_reasons.count(m.ENV_ERROR)} episodes ended by their environment failing (rollout.env_errors = requeue)"
        )
    odd = sorted(set(group.finish_reasons).difference(m.FINISH_REASONS))
    if odd:
        return Refusal("finish", f"finish reasons {odd[:3]} are not {' or '.join(m.FINISH_REASONS)}")
    rewards = group.rewards
    if np.abs(rewards).max() > limits.reward_bound:
        worst = float(rewards[np.abs(rewards).argmax()])
        return Refusal("reward", f"reward {worst:.4g} beyond +-{limits.reward_bound:g} (rollout.reward_bound)")
    names = group.reward_part_names
    if names and (problem := part_names_problem(names)) is not None:
        return Refusal("parts", problem)
    return None


def part_names_problem(names: list[str]) -> str | None:
    """What is wrong with a group's reward part names, or None: at most MAX_REWARD_PARTS, each of 1 to
    MAX_PART_NAME_CHARS printable characters, distinct and sorted (as actors/rewards/base.py assembles them)."""
    if len(names) > m.MAX_REWARD_PARTS:
        return f"{len(names)} reward part names, at most {m.MAX_REWARD_PARTS}"
    for name in names:
        if not m.part_name_ok(name):
            return f"reward part name {name[: m.MAX_PART_NAME_CHARS]!r} is not 1..{m.MAX_PART_NAME_CHARS} printable characters"
    if any(a >= b for a, b in itertools.pairwise(names)):
        return "reward part names are not distinct and sorted"
    return None
