"""Reward functions: `fn(completion: str, answer: str) -> float` in [0, 1], loaded by import path.

Built in:
- `actors.rewards:exact_match`: the demo task; the completion, stripped, equals the answer.
- `actors.rewards:math_answer`: math answers checked with `math-verify` (parses LaTeX/expressions,
  compares symbolically), e.g. "... so the answer is \\boxed{1/2}" against "0.5".
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

RewardFn = Callable[[str, str], float]


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0


def math_answer(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def load_reward_fn(path: str) -> RewardFn:
    """'package.module:function' -> the function; ValueError naming what is wrong."""
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
