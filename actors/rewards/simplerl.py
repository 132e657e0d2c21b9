"""SimpleRL-Zoo's math reward (hkust-nlp/simpleRL-reason, verl/utils/reward_score/hf_math_verify.py, the grader its
`simplelr` data sources use): the answer Qwen2.5-Math's evaluation parser extracts (evaluation/parser.py,
`extract_answer(text, "math")`), compared with the reference answer by math-verify, both wrapped in \\boxed{}.

Unlike `math_verify` (the last \\boxed{} or nothing), a response without a box still has an answer: "The answer is
5", "final answer is 5", or its last number. A box still wins when there is one.

Departures: Qwen's `strip_string` normalisation after extraction is reduced to its first steps (outer spaces and
trailing dots); math-verify's own normalisation covers most of the rest (\\text{} units, \\dfrac, dollars,
degrees, percent, "x ="), but not Qwen's plain-word units ("5 apples" is read as 5 by math-verify anyway) nor its
number words ("five"). A comparison that raises or runs past rollout.reward_timeout_s scores 0, as in SimpleRL
(10 s there), and is counted as a reward error here.
"""

from __future__ import annotations

import re

from actors.rewards.base import RewardContext
from actors.rewards.builtin import last_boxed

# SimpleRL cuts the decoded text at the first of these (verl decodes with special tokens; FleetRL's completion
# usually has none left, but a model may also write them as text).
_END_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>")
_NUMBER = re.compile(r"-?\d*\.?\d+")


def simplerl_math(ctx: RewardContext) -> tuple[float, dict[str, float]]:
    """1 when the answer SimpleRL-Zoo's grader extracts has the reference answer's value (math-verify), else 0
    (its default "mix" scoring; truncated responses are scored like any other).

    Parts: `boxed` (the response has a closed \\boxed{...}: SimpleRL's is_boxed_matched, logged only).
    """
    text = _until_end_marker(ctx.completion)
    correct = _boxed_equal(ctx.answer, simplerl_answer(text))
    return (1.0 if correct else 0.0), {"boxed": float(last_boxed(text) is not None)}


def simplerl_answer(text: str) -> str:
    """The answer Qwen2.5-Math's extract_answer finds for the "math" data name; the first rule that applies wins:

    1. Minerva's "... final answer is $X$. I hope it is correct." -> X;
    2. the last "boxed": its brace-matched {...} (nested braces kept; to the end when unclosed), or, with no brace
       after it, the text up to the next "$";
    3. after the last "he answer is" ("The answer is", "the answer is");
    4. after the last "final answer is";
    5. after the first "答案是", up to a blank line;
    6. the last number, thousands commas removed ("" when there is none).

    Then newlines (and the spaces after them) are removed, one leading ":" and a trailing "/" dropped, and the
    result stripped of outer spaces and trailing dots.
    """
    text = text.replace("\u043a\u0438", "")  # Qwen's parser drops this step tag (Math-Shepherd's "ки") first
    if "final answer is $" in text and "$. I hope" in text:
        answer = text.partition("final answer is $")[2].partition("$. I hope")[0].strip()
    elif "boxed" in text:
        answer = _box_contents(text.rpartition("boxed")[2])
    elif "he answer is" in text:
        answer = text.rpartition("he answer is")[2].strip()
    elif "final answer is" in text:
        answer = text.rpartition("final answer is")[2].strip()
    elif "答案是" in text:
        answer = text.partition("答案是")[2].strip().partition("\n\n")[0].strip()
    else:
        numbers = _NUMBER.findall(text.replace(",", ""))
        answer = numbers[-1] if numbers else ""
    answer = re.sub(r"\n\s*", "", answer).removeprefix(":").removesuffix(".").removesuffix("/")
    return answer.strip().rstrip(".")


def _box_contents(after: str) -> str:
    """What follows the last "boxed": {...} matched, or up to the next "$" when no brace opens it."""
    if not after.startswith("{"):
        return after.partition("$")[0].strip()
    depth = 0
    for i, c in enumerate(after):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return after[1:i]
    return after[1:]  # never closed: Qwen's parser keeps everything after the brace


def _until_end_marker(text: str) -> str:
    cut = min((i for i in (text.find(m) for m in _END_MARKERS) if i >= 0), default=len(text))
    return text[:cut]


def _boxed_equal(gold: str, pred: str) -> bool:
    """SimpleRL's comparison: each side wrapped in \\boxed{} unless it has one, parsed and verified by math-verify."""
    from math_verify import parse, verify

    def boxed(s: str) -> str:
        return s if "\\boxed" in s else f"\\boxed{{{s}}}"

    return bool(verify(parse(boxed(gold)), parse(boxed(pred))))
