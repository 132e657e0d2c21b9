"""The code reward (actors/rewards/code.py) running completions in the sandbox: a correct solution scores 1, a wrong
one 0, one that hangs 0 within its time limit, one without a code block 0; the pass fraction in between. Parsing
alone, in-process: tests/unit/test_sandbox_parts.py."""

from __future__ import annotations

import json
import time

from actors.rewards import RewardContext, code_tests, code_tests_all, load_reward
from actors.rewards.code import CodeTests
from actors.sandbox import SandboxLimits

STDIO = json.dumps({"inputs": ["1 2\n", "3 4\n", "10 -3\n"], "outputs": ["3\n", "7\n", "7\n"]})
ADD = "Read two numbers, print their sum.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
PARTIAL = "```python\nprint(7)\n```"  # right on two of the three
HANGS = "```python\nwhile True:\n    pass\n```"


def ctx(completion: str, answer: str = STDIO, metadata: dict | None = None) -> RewardContext:
    return RewardContext(completion=completion, prompt="", answer=answer, metadata=metadata or {}, finish_reason="stop")


def test_correct_solution_scores_one():
    assert code_tests(ctx(ADD)) == (1.0, {"has_code": 1.0, "pass_rate": 1.0, "timed_out": 0.0})


def test_wrong_solution_scores_zero():
    assert code_tests(ctx(WRONG))[0] == 0.0


def test_partial_credit_is_the_pass_fraction_and_all_or_nothing_gives_none():
    assert code_tests(ctx(PARTIAL))[0] == 2 / 3
    assert code_tests_all(ctx(PARTIAL))[0] == 0.0
    assert code_tests_all(ctx(ADD))[0] == 1.0


def test_hanging_solution_scores_zero_within_its_time_limit():
    reward = CodeTests(limits=SandboxLimits(wall_s=1.0, cpu_s=5))
    start = time.monotonic()
    ten = json.dumps({"inputs": ["1 2\n"] * 10, "outputs": ["3\n"] * 10})
    score, parts = reward(ctx(HANGS, ten))
    assert (score, parts["timed_out"]) == (0.0, 1.0)
    assert time.monotonic() - start < 6.0  # the first timeout ends the scoring: not one wall_s per test (10 s)


def test_no_code_block_scores_zero_without_running_anything():
    assert code_tests(ctx("the answer is a + b")) == (0.0, {"has_code": 0.0, "pass_rate": 0.0, "timed_out": 0.0})


def test_assert_tests_from_metadata_through_the_loaded_reward():
    reward = load_reward("actors.rewards:code_tests")
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return 3\n```"  # passes the first only
    assert reward(ctx(good, answer="", metadata={"tests": tests}))[0] == 1.0
    assert reward(ctx(bad, answer="", metadata={"tests": json.dumps(tests)}))[0] == 0.5
