"""Rollouts.train_group (actors/rollout.py) when vLLM ends completions unfinished (finish reason "error", "abort"
or "repetition"): the group is generated again, and after GENERATE_ATTEMPTS it is sent as it is, for the hub to
refuse (reason "finish", no strike) and requeue at once. The engine here replays chosen finish reasons: vLLM's
request-level errors cannot be provoked on demand in a real engine."""

import asyncio

import numpy as np

from actors.engine import Completion
from actors.rewards import Outcome
from actors.rollout import GENERATE_ATTEMPTS, Rollouts
from protocol import messages as m
from protocol.config import load_config


class ReplayEngine:
    def __init__(self, reasons_per_call: list[list[str]]):
        self.calls = reasons_per_call

    async def generate_group(self, prompt_tokens, n, sampling=None):
        reasons = self.calls.pop(0)
        assert len(reasons) == n
        return [
            Completion(token_ids=np.array([3], np.int32), logprobs=np.array([-0.5], np.float32), finish_reason=r, text="x") for r in reasons
        ]


class Log:
    def __init__(self):
        self.events = []

    def warning(self, event, **fields):
        self.events.append(event)

    error = warning


class NoRewards:
    """Scores every completion 1 (the reward pool's own tests are tests/integration/test_rewards.py)."""

    async def score(self, contexts):
        return [Outcome(1.0, {}) for _ in contexts]


def run_grant(engine: ReplayEngine) -> tuple[m.RolloutGroup, list[str]]:
    cfg = load_config(None, ["rollout.samples_per_prompt=2"])
    log = Log()
    rollouts = Rollouts(cfg, engine, NoRewards(), log)
    grant = m.WorkGrant(prompt_id=3, epoch=0, prompt_tokens=np.ones(2, np.int32), answer="a", policy_version=0, lease_s=9.0)
    group = asyncio.run(rollouts.train_group(grant, "a0", lambda: 0))
    group.check()
    return group, log.events


def test_unfinished_completions_are_generated_again():
    engine = ReplayEngine([["stop", "error"], ["abort", "length"], ["stop", "length"]])
    group, events = run_grant(engine)
    assert group.finish_reasons == ["stop", "length"] and not engine.calls
    assert events == ["actor.unfinished_completions"] * 2


def test_a_group_that_never_finishes_is_sent_for_the_hub_to_requeue():
    engine = ReplayEngine([["error", "stop"]] * GENERATE_ATTEMPTS)
    group, events = run_grant(engine)
    assert group.finish_reasons == ["error", "stop"] and not engine.calls
    assert events == ["actor.unfinished_completions"] * GENERATE_ATTEMPTS + ["actor.group_unfinished"]
