"""Actor._run_grant when vLLM ends completions unfinished (finish reason "error", "abort" or "repetition"): the
group is generated again, and after GENERATE_ATTEMPTS it is not sent (the hub refuses such groups, reason "finish",
and would count a strike). The engine here replays chosen finish reasons: vLLM's request-level errors cannot be
provoked on demand in a real engine."""

import asyncio
from types import SimpleNamespace

import numpy as np

from actors.engine import Completion
from actors.main import GENERATE_ATTEMPTS, Actor
from actors.rewards import GroupScores
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


def run_grant(engine: ReplayEngine) -> tuple[list[m.Message], list[str]]:
    cfg = load_config(None, ["rollout.samples_per_prompt=2"])
    sent: list[m.Message] = []

    async def score(grant, completions, split):
        n = len(completions)
        return GroupScores(np.ones(n, np.float32), np.zeros(0, np.float32), [], 0, None)

    async def send(msg):
        msg.check()
        sent.append(msg)

    async def main():
        actor = SimpleNamespace(
            actor_id="a0",
            cfg=cfg,
            log=Log(),
            engine=engine,
            sampling=None,
            served_version=0,
            version_changed=asyncio.Condition(),
            _score=score,
            _send=send,
        )
        grant = m.WorkGrant(prompt_id=3, epoch=0, prompt_tokens=np.ones(2, np.int32), answer="a", policy_version=0, lease_s=9.0)
        await Actor._run_grant(actor, grant)
        return actor.log.events

    return sent, asyncio.run(main())


def test_unfinished_completions_are_generated_again():
    engine = ReplayEngine([["stop", "error"], ["abort", "length"], ["stop", "length"]])
    sent, events = run_grant(engine)
    (group,) = sent
    assert group.finish_reasons == ["stop", "length"] and not engine.calls
    assert events == ["actor.unfinished_completions"] * 2


def test_a_group_that_never_finishes_is_not_sent():
    engine = ReplayEngine([["error", "stop"]] * GENERATE_ATTEMPTS)
    sent, events = run_grant(engine)
    assert sent == [] and not engine.calls
    assert events == ["actor.unfinished_completions"] * GENERATE_ATTEMPTS + ["actor.group_dropped"]
