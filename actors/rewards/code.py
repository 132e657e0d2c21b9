"""Code rewards: run the completion's last ```python block against the row's test cases in the sandbox.

Test cases come from the row's metadata "tests" column, else from its answer (JSON text), in one of the
shapes code-RL datasets use:
- {"inputs": [stdin, ...], "outputs": [stdout, ...]}: APPS/TACO style, as verl's prime_code reads them;
- [{"input": stdin, "output": stdout}, ...]: the same pairs as a list (DeepCoder, LiveCodeBench's stdin tests);
- ["assert f(1) == 2", ...]: statements run after the code (MBPP, open-instruct's code verifier).
A stdin/stdout test passes when the program exits 0 and its output equals the expected one up to whitespace
(the same tokens). An assert test passes when the program followed by the statement exits 0. Function-call
tests (APPS "fn_name") are not read: such a row is an error that names it (scored 0, counted).

Scores: `code_tests` is the fraction of tests passed, as open-instruct's code verifier scores (its pass rate)
and verl's prime_code with continuous=True: a dense signal for a model that passes some tests.
`code_tests_all` is 1 only when every test passes, verl's prime_code default and DeepCoder's choice, which
argue that partial credit rewards solutions that special-case the easy tests. `CodeTests` builds other limits.

Cost: one sandboxed process per test, run one after another. The first test that times out ends the scoring
(a program that hangs once usually hangs on every input) and so does `budget_s`; the tests not run count as
failed. Keep rollout.reward_timeout_s above budget_s + limits.wall_s, or the reward worker is killed first.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from actors.rewards.base import RewardContext
from actors.sandbox import SandboxError, SandboxLimits, run_sync

_BLOCK = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last closed ```python (or ```py) block, or None."""
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else None


@dataclass(frozen=True, slots=True)
class Case:
    stdin: str = ""
    expected: str | None = None  # stdout to match; None for an assert test (exit status 0 is the pass)
    statement: str = ""  # appended to the program for an assert test


def parse_tests(metadata: dict[str, Any], answer: str) -> list[Case]:
    """The row's tests (metadata["tests"], else the answer as JSON); ValueError naming what is wrong."""
    raw: Any = metadata.get("tests", answer)
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"code tests: not JSON ({e})") from None
    if isinstance(raw, dict) and "fn_name" in raw:
        raise ValueError("code tests: function-call tests (fn_name) are not supported; give stdin/stdout pairs or asserts")
    if isinstance(raw, dict) and isinstance(raw.get("inputs"), list) and isinstance(raw.get("outputs"), list):
        if len(raw["inputs"]) != len(raw["outputs"]):
            raise ValueError(f"code tests: {len(raw['inputs'])} inputs but {len(raw['outputs'])} outputs")
        tests = [Case(stdin=_text(i), expected=_text(o)) for i, o in zip(raw["inputs"], raw["outputs"], strict=True)]
    elif isinstance(raw, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in raw):
        tests = [Case(stdin=_text(t["input"]), expected=_text(t["output"])) for t in raw]
    elif isinstance(raw, list) and all(isinstance(t, str) for t in raw):
        tests = [Case(statement=t) for t in raw]
    else:
        raise ValueError('code tests: expected {"inputs": [...], "outputs": [...]}, [{"input", "output"}, ...] or ["assert ...", ...]')
    if not tests:
        raise ValueError("code tests: the row has none")
    return tests


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "\n".join(map(str, value)) if isinstance(value, list) else str(value)


@dataclass(frozen=True, slots=True)
class CodeTests:
    """A code reward: the pass fraction (or all-or-nothing) of the row's tests. Called with a RewardContext."""

    all_or_nothing: bool = False  # 1 only when every test passes (and stop at the first failure)
    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(wall_s=4.0, cpu_s=4, memory_bytes=1 << 30))
    budget_s: float = 8.0  # no test starts after this many seconds of scoring; the rest count as failed

    def __call__(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        tests = parse_tests(ctx.metadata, ctx.answer)
        code = extract_code(ctx.completion)
        if code is None:
            return 0.0, {"has_code": 0.0, "pass_rate": 0.0, "timed_out": 0.0}
        start, passed, timed_out = time.monotonic(), 0, False
        for test in tests:
            if time.monotonic() - start > self.budget_s:
                break
            ok, timed_out = self._passes(code, test)
            passed += ok
            if timed_out or (self.all_or_nothing and not ok):
                break
        rate = passed / len(tests)
        score = float(passed == len(tests)) if self.all_or_nothing else rate
        return score, {"has_code": 1.0, "pass_rate": rate, "timed_out": float(timed_out)}

    def _passes(self, code: str, test: Case) -> tuple[bool, bool]:
        """(passed, timed out); raises SandboxError when the sandbox itself failed (an error, not a 0)."""
        program = code if test.expected is not None else f"{code}\n\n{test.statement}\n"
        result = run_sync(program, test.stdin, self.limits)
        if result.reason == "sandbox":
            raise SandboxError(result.error)
        ok = result.ok and (test.expected is None or result.stdout.decode(errors="replace").split() == test.expected.split())
        return ok, result.reason in ("timeout", "cpu")


code_tests = CodeTests()
code_tests_all = CodeTests(all_or_nothing=True)
