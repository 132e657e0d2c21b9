"""open-instruct's verifiable reward (allenai/open-instruct, Tulu 3 RLVR): a verifier per row, chosen by the row's
`dataset` column, scaled by `verification_reward`, and a fixed value for a response that did not stop.

What open-instruct does (open_instruct/ground_truth_utils.py, model_utils.apply_verifiable_reward,
ppo_vllm_thread_ray_gtrl.py; docs/tulu3.md's Tulu-3-8B RLVR command):
- the verifier is looked up by the row's dataset name, lowercased; it returns 0..1 and the reward is that times
  `verification_reward` (10 by default, and in the Tulu 3 runs);
- with `--non_stop_penalty`, a response that did not end with the stop token gets `penalty_reward_value`
  (-10.0 in the Tulu-3-8B command; grpo_fast.py calls it `non_stop_penalty_value`, default 0) instead of its
  score. FleetRL reads "did not stop" from the finish reason ("length"): the actor passes vLLM's finish reason
  to every reward in RewardContext.finish_reason.

Verifiers here: `gsm8k` (the last number in the response equals the answer), `math` (a boxed answer, the
Minerva "The final answer is ..." line, the last $...$, or the whole response, equal in value to the answer) and
`ifeval` (the row's ground truth names one of open-instruct's 25 instruction checks: actors/rewards/ifeval.py,
with the two bugs of the Tulu 3 run fixed; `ifeval_as_run` keeps them). open-instruct's code, judge and string
verifiers are not here: a row naming one is an error that names it (scored 0 and counted), not a silent 0.
Departures: values are compared with math-verify where open-instruct uses the Hendrycks/Minerva normalisations
and sympy; the GSM8K number may be negative (open-instruct's pattern drops the sign of an integer).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from actors.rewards.base import RewardContext
from actors.rewards.builtin import equivalent, last_boxed
from actors.rewards.ifeval import ifeval, ifeval_as_run


def gsm8k(response: str, answer: str) -> float:
    """1 when the last number in the response (thousands commas removed) is the answer's text."""
    numbers = _NUMBER.findall(re.sub(r"(\d),(\d)", r"\1\2", response))
    return 1.0 if numbers and numbers[-1].lower() == answer.strip().lower() else 0.0


_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)")


def math(response: str, answer: str) -> float:
    """1 when any candidate answer of the response equals the answer's value: its last box, the Minerva
    "The final answer is X. I hope it is correct." line, else its last $...$, else the whole response."""
    candidates = [c for c in (last_boxed(response), _minerva(response)) if c]
    if not candidates:
        dollars = [m.start() for m in re.finditer(r"\$", response)]
        candidates = [response[dollars[-2] + 1 : dollars[-1]]] if len(dollars) > 1 else [response]
    return 1.0 if any(equivalent(answer, c) for c in candidates) else 0.0


def _minerva(response: str) -> str | None:
    found = re.findall(r"The final answer is (.*?)(?:\. I hope it is correct|$)", response, flags=re.MULTILINE)
    return found[-1].strip().rstrip(".") if found else None


Verifier = Callable[[str, str], float]  # (response, the row's answer) -> 0..1
VERIFIERS: dict[str, Verifier] = {"gsm8k": gsm8k, "math": math, "ifeval": ifeval}


def by_dataset(ctx: RewardContext, verifiers: Mapping[str, Verifier] = VERIFIERS) -> float:
    """The verifier named by metadata["dataset"] (lowercased), 0..1; ValueError naming an unknown or missing one."""
    name = ctx.metadata.get("dataset")
    if isinstance(name, list) and len(name) == 1:  # open-instruct rows may carry it as a one-element list
        name = name[0]
    if not isinstance(name, str):
        raise ValueError(f"metadata['dataset'] is {name!r}: the row must name its verifier ({', '.join(verifiers)})")
    verifier = verifiers.get(name.lower())
    if verifier is None:
        raise ValueError(f"no verifier for dataset {name!r} (known: {', '.join(verifiers)})")
    return verifier(ctx.completion, ctx.answer)


class OpenInstructReward:
    """verification_reward x the row's verifier, or non_stop_penalty_value when the response did not stop.

    Parts: `verified` (the verifier's 0..1, whether or not the response stopped). Another scale, penalty or
    verifier table is one line in your own module: `my_reward = OpenInstructReward(non_stop_penalty_value=0.0)`;
    the Tulu 3 run's IFEval bugs: `OpenInstructReward(verifiers=VERIFIERS | {"ifeval": ifeval_as_run})`.
    """

    def __init__(
        self,
        verification_reward: float = 10.0,
        non_stop_penalty_value: float | None = -10.0,
        verifiers: Mapping[str, Verifier] = VERIFIERS,
    ):
        self.verification_reward = verification_reward
        self.non_stop_penalty_value = non_stop_penalty_value  # None: no penalty (open-instruct without --non_stop_penalty)
        self.verifiers = verifiers  # dataset name (lowercase) -> verifier

    def __call__(self, ctx: RewardContext) -> tuple[float, dict[str, float]]:
        verified = by_dataset(ctx, self.verifiers)
        score = self.verification_reward * verified
        if self.non_stop_penalty_value is not None and ctx.finish_reason != "stop":
            score = self.non_stop_penalty_value
        return score, {"verified": verified}


# Tulu-3-8B RLVR as docs/tulu3.md runs it: verification_reward 10, --non_stop_penalty --penalty_reward_value -10.0.
open_instruct = OpenInstructReward()
# The same with the IFEval checks as the Tulu 3 run had them (its two bugs kept): the Tulu 3 recipe's reward.
tulu3_as_run = OpenInstructReward(verifiers=VERIFIERS | {"ifeval": ifeval_as_run})
