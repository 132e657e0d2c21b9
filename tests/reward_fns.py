"""Reward functions for the reward tests (tests/unit/test_reward_functions.py, and tests/integration/test_rewards.py's pool, whose
worker processes import them)."""

import os
import time


def context_len(ctx):
    """The new form: a score and named parts (a part only some completions return)."""
    parts = {"length": float(len(ctx.completion))}
    if ctx.finish_reason == "stop":
        parts["stopped"] = 1.0
    return float(ctx.metadata.get("bonus", 0)) + len(ctx.completion), parts


def legacy(completion, answer):
    return 1.0 if completion == answer else 0.0


def behaves(ctx):
    """What the completion says: hang (an infinite loop), raise, die (the process exits), sleep, or score 1."""
    if ctx.completion == "hang":
        while True:
            pass
    if ctx.completion == "raise":
        raise RuntimeError("no such key\nsecond line")
    if ctx.completion == "die":
        os._exit(3)
    if ctx.completion.startswith("sleep "):
        time.sleep(float(ctx.completion.split()[1]))
    if ctx.completion == "nan":
        return float("nan")
    if ctx.completion == "text":
        return "1.0"
    if ctx.completion == "many parts":  # one more part than the wire carries
        return 1.0, {f"p{i:02d}": 0.0 for i in range(17)}
    if ctx.completion == "bad part name":
        return 1.0, {"a\nb": 0.0}
    return 1.0


def three_args(a, b, c):
    return 0.0
