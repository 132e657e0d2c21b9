"""The math rewards: exact match, math-verify on boxed answers, and Open-Reasoner-Zero's rule.

Answers are compared with `math-verify` (parses LaTeX and plain expressions, compares them symbolically):
"\\frac{1}{2}" equals "0.5", "x^2+1" equals "1+x^2". It is imported on first use (half a second), in the
reward worker that runs the function.
"""

from __future__ import annotations

from actors.rewards.base import RewardContext


def exact_match(completion: str, answer: str) -> float:
    """The demo task: the completion, stripped, equals the answer (the old two-argument form)."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def math_answer(completion: str, answer: str) -> float:
    """1 when math-verify finds, anywhere in the completion, the answer's value (old form; no format required)."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def math_verify(ctx: RewardContext) -> tuple[float, dict[str, float]]:
    """1 when the completion's last \\boxed{...} has the answer's value (math-verify), else 0.

    Parts: `boxed` (a \\boxed{...} was found). The answer may itself be boxed (a whole solution): its last
    box is the value compared.
    """
    pred = last_boxed(ctx.completion)
    if pred is None:
        return 0.0, {"boxed": 0.0}
    return (1.0 if equivalent(gold_answer(ctx.answer), pred) else 0.0), {"boxed": 1.0}


def orz(ctx: RewardContext) -> tuple[float, dict[str, float]]:
    """Open-Reasoner-Zero's reward (Open-Reasoner-Zero/Open-Reasoner-Zero, playground/orz_*_ppo.py): 1 for a
    response that stopped and whose answer is right, else 0.

    - The answer is the last \\boxed{...} inside `<answer> ... </answer>` (ORZ's pattern
      `<answer>.*?(\\boxed{.*}).*?</answer>`, then its last box), compared with the row's answer (its last box
      when it has one) as equal strings ignoring case, or equal values by math-verify (ORZ's "math_verify"
      mode; its default "legacy" mode uses sympy's LaTeX parser and the Hendrycks MATH normalisation instead).
    - A response that did not stop (finish reason "length") scores 0 whatever it says.
    - ORZ samples with stop strings ["User:", "Human:", "Assistant:", "</answer>"] and
      include_stop_str_in_output=True: the closing "</answer>" that stopped the response is in its text, and
      the pattern needs it. So set rollout.stop to those four and rollout.include_stop_str_in_output = true;
      without the latter every response that stopped at "</answer>" scores 0.

    Parts: `correct` (the answer is right, stopped or not: ORZ's `iscorrect`) and `formatted` (an answer in
    that format was found).
    """
    pred = _orz_answer(ctx.completion)
    correct = pred is not None and equivalent(gold_answer(ctx.answer), pred)
    score = 1.0 if correct and ctx.finish_reason == "stop" else 0.0
    return score, {"correct": float(correct), "formatted": float(pred is not None)}


def _orz_answer(text: str) -> str | None:
    start = text.find("<answer>")
    end = text.rfind("</answer>")
    if start < 0 or end < start:
        return None
    return last_boxed(text[start + len("<answer>") : end])


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (nested braces matched), or None when there is none or it is unclosed."""
    at = text.rfind("\\boxed")
    if at < 0:
        return None
    i = at + len("\\boxed")
    while i < len(text) and text[i] == " ":
        i += 1
    if i == len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def gold_answer(answer: str) -> str:
    """A reference answer that is a whole solution is compared by its last box (ORZ's solution2answer)."""
    boxed = last_boxed(answer)
    return answer if boxed is None else boxed


def equivalent(gold: str, pred: str) -> bool:
    """Equal strings (ignoring case and outer spaces), or equal values by math-verify."""
    if gold.strip().lower() == pred.strip().lower():
        return True
    from math_verify import parse, verify

    a, b = parse(_math(gold)), parse(_math(pred))
    return bool(a and b and verify(a, b))


def _math(text: str) -> str:
    """Delimit bare math so math-verify's LaTeX extraction reads it ("\\frac12" alone is not extracted)."""
    return text if "$" in text else f"${text}$"
