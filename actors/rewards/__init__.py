"""Reward functions: what scores each completion, chosen by `rollout.reward_fn` ("package.module:function").

A reward function takes one argument, a `RewardContext` (completion, prompt, answer, metadata, finish
reason), and returns a float, or a float and named parts: `(score, {"format": 1.0, "correct": 0.0})`.
The parts are sent with the group and logged. Every completion of a group carries every part name any
of them returned; a part a completion did not return is 0 there. The old form `fn(completion, answer)
-> float` still works: the form is read from the signature once, when the actor loads the function.

The actor runs the function in a pool of worker processes (actors/rewards/pool.py), never on its event
loop. A call that raises, returns something that is not a finite number, or runs past
rollout.reward_timeout_s (its worker is killed and replaced) scores 0 and counts as an error
(RolloutGroup.reward_errors); the group is sent as usual.

Built in (`actors.rewards:NAME`):
- `exact_match`: the demo task; the completion, stripped, equals the answer.
- `math_answer`: math-verify finds the answer's value anywhere in the completion.
- `math_verify`: the completion's last \\boxed{...} has the answer's value (math-verify).
- `simplerl_math`: SimpleRL-Zoo's grader: the last \\boxed{...}, else "the answer is ...", else "final answer is
  ...", else the last number (Qwen2.5-Math's answer extraction), with the answer's value (math-verify).
- `orz`: Open-Reasoner-Zero's rule: right answer in `<answer>...\\boxed{}...</answer>` and the response stopped.
- `by_dataset`: open-instruct's verifier for the row's metadata["dataset"] (gsm8k, math, ifeval), 0..1.
- `open_instruct`: 10 x by_dataset, -10 for a response that did not stop (Tulu 3 RLVR); `tulu3_as_run` the same
  with the IFEval checks as that run had them (the Tulu 3 recipe's); `OpenInstructReward`
  builds other scales, penalties and verifier tables (`ifeval_as_run`: the Tulu 3 run's two IFEval bugs).
- `code_tests`: the fraction of the row's test cases that the completion's last ```python block passes, run in the
  sandbox (actors/sandbox); `code_tests_all`: 1 only when all pass; `CodeTests` builds other limits.
"""

from actors.rewards.base import (
    GroupScores,
    Outcome,
    Reward,
    RewardContext,
    assemble,
    load_reward,
    load_reward_fn,
    parse_metadata,
    score_one,
)
from actors.rewards.builtin import exact_match, math_answer, math_verify, orz
from actors.rewards.code import CodeTests, code_tests, code_tests_all
from actors.rewards.ifeval import ifeval, ifeval_as_run
from actors.rewards.simplerl import simplerl_answer, simplerl_math
from actors.rewards.verifiers import VERIFIERS, OpenInstructReward, by_dataset, open_instruct, tulu3_as_run

__all__ = [
    "CodeTests",
    "GroupScores",
    "OpenInstructReward",
    "Outcome",
    "Reward",
    "RewardContext",
    "VERIFIERS",
    "assemble",
    "by_dataset",
    "code_tests",
    "code_tests_all",
    "exact_match",
    "ifeval",
    "ifeval_as_run",
    "load_reward",
    "load_reward_fn",
    "math_answer",
    "math_verify",
    "open_instruct",
    "tulu3_as_run",
    "orz",
    "parse_metadata",
    "score_one",
    "simplerl_answer",
    "simplerl_math",
]
