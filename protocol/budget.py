"""How many tokens one completion may have: the rule the actor asks the engine for and the hub checks.

    completion_budget(prompt_len, rollout.max_tokens, actor.max_model_len) = min(max_tokens, max_model_len - prompt_len)

A prompt within data's default budget (actor.max_model_len - rollout.max_tokens) always gets rollout.max_tokens.
A longer one (data.max_prompt_tokens raised, as Open-Reasoner-Zero's 2048-token prompts in an 8192 context) gets
what the context leaves, and the engine reports such a completion's end as "length", as it does at max_tokens.
"""

from __future__ import annotations

from protocol.config import Config


def completion_budget(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Tokens a completion of a `prompt_len`-token prompt may have; at least 1 for any prompt the config admits."""
    return max(0, min(max_tokens, max_model_len - prompt_len))


def episode_budget(prompt_len: int, max_episode_tokens: int, max_model_len: int) -> int:
    """Tokens after the prompt of a multi-turn episode (model turns and observations): rollout.max_episode_tokens,
    at most what the context leaves (0: all it leaves)."""
    room = max(0, max_model_len - prompt_len)
    return min(max_episode_tokens, room) if max_episode_tokens else room


def sample_budget(prompt_len: int, cfg: Config) -> int:
    """The completion tokens a sample of `cfg` may have: one turn's, or an episode's with rollout.env."""
    r, context = cfg.rollout, cfg.actor.max_model_len
    if r.env:
        return episode_budget(prompt_len, r.max_episode_tokens, context)
    return completion_budget(prompt_len, r.max_tokens, context)
