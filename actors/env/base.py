"""What an environment is: one instance per episode, built from the prompt's row, answering each model turn.

    EpisodeRow --Env(row)--> env --await env.step(turn text)--> Step(observation, reward, done)   (repeat)

A user's environment is a class named in the config as `rollout.env = "package.module:Class"`:

    class Guess:
        def __init__(self, row: EpisodeRow):
            self.secret = int(row.answer)

        async def step(self, text: str) -> Step:          # a plain `def` works too: it runs in a thread
            guess = int(text.strip() or -1)
            if guess == self.secret:
                return Step(reward=1.0, done=True)
            return Step(observation="higher" if guess < self.secret else "lower")

The observation is text (tokenized once and appended as it is) or chat messages ({"role": ..., "content": ...},
rendered through the tokenizer's chat template as the continuation of the conversation so far). The episode's
reward is the sum of the rewards its steps returned; an episode whose steps returned none is scored by
rollout.reward_fn on the episode's whole text. Anything raised, a step longer than rollout.env_timeout_s, or a
return that is not a Step ends the episode (rollout.env_errors says what then happens to its group): an
environment cannot harm the actor. The episode loop is actors/episode.py.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, str]  # {"role": "tool" | "user" | ..., "content": ...}


@dataclass(frozen=True, slots=True)
class EpisodeRow:
    prompt: str  # the prompt as the model saw it (templates applied)
    answer: str  # the row's reference answer
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other columns


@dataclass(frozen=True, slots=True)
class Step:
    observation: str | list[Message] = ""  # what the model sees next ("" = nothing: only with done)
    reward: float | None = None  # this step's reward, if it has one
    done: bool = False  # the episode ends here
    tool_calls: int = 0  # tool calls this step answered (env/tool_calls_mean)


class Environment(Protocol):
    def __init__(self, row: EpisodeRow) -> None: ...

    async def step(self, text: str) -> Step: ...


class EnvError(Exception):
    """An environment broke its contract (wrong return type, bad observation): ends the episode, named in the log."""


def load_env(spec: str) -> type:
    """'package.module:Class' -> the class; ValueError naming rollout.env when it cannot be used."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rollout.env: {spec!r} is not package.module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.env: cannot import {module_name!r} ({e})") from e
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        raise ValueError(f"rollout.env: {spec!r} is not a class with a step(text) method")
    return cls
