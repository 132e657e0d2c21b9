"""The tool demo's environment (configs/demo_tools.toml): a calculator the tiny model calls in the tag format.

    "37+45="  model: "<calc>37+45</calc>"  env: "<result>82</result>"  model: "82"  -> reward 1 (the right sum)
    "37+45="  model: "81"                                                        -> reward 0

The episode's reward is the final answer's: 1 when the model's last turn is the right sum, else 0.
"""

from __future__ import annotations

import re

from actors.env.tools import ToolEnv

EXPRESSION = re.compile(r"\d{1,12}([+*-]\d{1,12}){0,3}")


def calc(expression: str) -> str:
    """Integer arithmetic: + - * over at most four numbers of at most 12 digits; anything else is an error."""
    text = expression.strip()
    if not EXPRESSION.fullmatch(text):
        raise ValueError(f"not an expression of integers and + - *: {text[:40]!r}")
    numbers = [int(x) for x in re.findall(r"\d+", text)]
    ops = re.findall(r"[+*-]", text)
    terms, signs = [numbers[0]], [1]  # products first, then the sum of signed terms
    for op, n in zip(ops, numbers[1:], strict=True):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(1 if op == "+" else -1)
    return str(sum(s * t for s, t in zip(signs, terms, strict=True)))


class Calculator(ToolEnv):
    format = "tags"
    tools = {"calc": calc}
    max_calls_per_turn = 1

    def score(self, text: str) -> float:
        return float(text.strip() == self.row.answer)
