"""What a reward function receives and returns, how one is loaded, and how a group's outcomes become wire arrays.

No processes and no event loop here (actors/rewards/pool.py runs the functions): everything below is
plain data in, plain data out, and is unit-tested without a worker.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocol import messages as m
from protocol.logs import first_line


@dataclass(frozen=True, slots=True)
class RewardContext:
    """Everything a reward function may look at for one completion."""

    completion: str  # the generated text; the stop string that ended it only with rollout.include_stop_str_in_output
    prompt: str  # the prompt as the model saw it (chat template applied); "" when the hub sent none
    answer: str  # the row's reference answer (data.answer_key)
    metadata: dict[str, Any]  # the row's other columns (e.g. "dataset"); {} when none
    finish_reason: str  # "stop": EOS, a stop token or a stop string | "length": ran into rollout.max_tokens


@dataclass(frozen=True, slots=True)
class Outcome:
    """One completion's score. An error scores 0 with no parts."""

    score: float
    parts: dict[str, float]
    error: str | None = None  # the first line of what went wrong (exception, timeout, dead worker)


Result = float | tuple[float, Mapping[str, float]]
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class Reward:
    """A loaded reward function, called with a RewardContext whichever form it was written in.

    Two forms, told apart once, here, by the function's signature (its required positional parameters):
    - one, `fn(ctx: RewardContext)`: returns a float, or (float, {part name: float}) whose parts are logged;
    - two, `fn(completion: str, answer: str) -> float`: the old form, still accepted.
    """

    def __init__(self, name: str, fn: Callable[..., Any]):
        self.name, self.fn = name, fn
        self.takes_context = _arity(name, fn) == 1

    def __call__(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        """(score, parts), or raises: TypeError/ValueError for a result that is not a finite float (and parts)."""
        out = self.fn(ctx) if self.takes_context else self.fn(ctx.completion, ctx.answer)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            # Parts only feed metrics: one the wire cannot carry is dropped later (assemble), never the score with it.
            score, parts = _number(out[0], "the score"), {str(k): _real(v, f"part {k!r}") for k, v in out[1].items()}
        elif isinstance(out, numbers.Real):
            score, parts = _number(out, "the score"), {}
        else:
            raise TypeError(f"returned {type(out).__name__}; expected a float or (float, {{name: float}})")
        return score, parts


def _number(x: Any, what: str) -> float:
    value = _real(x, what)
    # The hub rejects a whole group with a non-finite reward (float32 on the wire): make it this sample's error.
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{what} is {value}, not a finite float32")
    return value


def _real(x: Any, what: str) -> float:
    if not isinstance(x, numbers.Real):
        raise TypeError(f"{what} is {type(x).__name__}, not a number")
    return float(x)


def _arity(name: str, fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"rollout.reward_fn: cannot read the signature of {name!r} ({e})") from e
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in sig.parameters.values() if p.default is p.empty and p.kind in positional]
    keyword_only = [p.name for p in sig.parameters.values() if p.default is p.empty and p.kind is inspect.Parameter.KEYWORD_ONLY]
    if len(required) not in (1, 2) or keyword_only:
        raise ValueError(f"rollout.reward_fn: {name}{sig} must take one argument (a RewardContext) or two (completion, answer)")
    return len(required)


def load_reward_fn(path: str) -> Callable[..., Any]:
    """'package.module:function' -> the function itself; ValueError naming what is wrong."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rollout.reward_fn: {path!r} is not package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.reward_fn: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"rollout.reward_fn: {module_name!r} has no function {attr!r}")
    return fn


def load_reward(path: str) -> Reward:
    """Import `path` and read its form; ValueError naming rollout.reward_fn when it cannot be used."""
    return Reward(path, load_reward_fn(path))


def score_one(reward: Reward, ctx: RewardContext) -> Outcome:
    """Call the reward; an exception becomes an error outcome (score 0), never a crash."""
    try:
        score, parts = reward(ctx)
    except Exception as e:  # the user's code: any exception is this sample's error, reported with its first line
        return Outcome(0.0, {}, first_line(e))
    return Outcome(score, parts)


def parse_metadata(text: str) -> dict[str, Any]:
    """The grant's metadata (JSON object text; "" or "{}" is empty); ValueError when it is not a JSON object."""
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"metadata is a JSON {type(value).__name__}, not an object")
    return value


@dataclass(frozen=True, slots=True)
class GroupScores:
    """A group's outcomes as the wire carries them (RolloutGroup.rewards, reward_parts, reward_part_names, reward_errors)."""

    rewards: np.ndarray  # float32 [n]
    parts: np.ndarray  # float32 [n * k], row-major [n, k]
    part_names: list[str]  # k names, sorted: every part any completion of the group returned
    errors: int  # completions whose reward failed (scored 0)
    first_error: str | None  # the first failure's first line, for the log
    dropped_parts: list[str] = field(default_factory=list)  # part names the wire cannot carry (assemble), for the log


def assemble(outcomes: list[Outcome]) -> GroupScores:
    """Every completion gets every part name seen in its group; a part a completion did not return (or an error)
    is 0 there. Parts are metrics only, so what the wire cannot carry is dropped and named in `dropped_parts`, the
    scores kept: a name that is not 1..MAX_PART_NAME_CHARS printable characters, a non-finite float32 value, and
    past the first MAX_REWARD_PARTS names in sorted order."""
    seen = sorted({name for o in outcomes for name in o.parts})
    carried = [n for n in seen if m.part_name_ok(n) and all(_float32(o.parts[n]) for o in outcomes if n in o.parts)]
    names = carried[: m.MAX_REWARD_PARTS]
    dropped = sorted(set(seen).difference(names))
    parts = np.asarray([[o.parts.get(name, 0.0) for name in names] for o in outcomes], dtype=np.float32).reshape(-1)
    errors = [o.error for o in outcomes if o.error is not None]
    return GroupScores(
        rewards=np.asarray([o.score for o in outcomes], dtype=np.float32),
        parts=parts,
        part_names=names,
        errors=len(errors),
        first_error=errors[0] if errors else None,
        dropped_parts=dropped,
    )


def _float32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= _FLOAT32_MAX
