"""The reward worker pool (actors/rewards/pool.py, one process per worker): a timeout, an exception or a dead worker
scores 0 and is counted; a hung worker is replaced; and the actor's use of it. The context, the forms, a group's
parts and the built-ins, in-process: tests/unit/test_reward_functions.py."""

import asyncio
import time

import numpy as np
import pytest

from actors.rewards import Outcome
from actors.rewards.pool import RewardPool
from tests.unit.test_reward_functions import ctx

# ---- the pool -------------------------------------------------------------------------------------------


def run(coro):
    return asyncio.run(coro)


def test_pool_scores_both_forms_off_the_loop():
    async def main():
        out = {}
        for spec in ("tests.reward_fns:context_len", "tests.reward_fns:legacy"):
            pool = RewardPool(spec, workers=2, timeout_s=10.0)
            await pool.start()
            try:
                out[spec] = await pool.score([ctx("ab", answer="ab"), ctx("xyz", answer="ab", finish_reason="length")])
            finally:
                await pool.close()
        return out

    out = run(main())
    assert out["tests.reward_fns:context_len"] == [Outcome(2.0, {"length": 2.0, "stopped": 1.0}), Outcome(3.0, {"length": 3.0})]
    assert out["tests.reward_fns:legacy"] == [Outcome(1.0, {}), Outcome(0.0, {})]


def test_pool_survives_timeouts_exceptions_and_dead_workers():
    """A hung call (an infinite loop) costs only its time limit: its worker is killed and replaced, the loop keeps
    running meanwhile, and later groups are scored by the replacement."""
    replaced = []

    async def main():
        pool = RewardPool("tests.reward_fns:behaves", workers=2, timeout_s=1.0, on_replace=replaced.append)
        await pool.start()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        try:
            t0 = time.monotonic()
            first = await pool.score([ctx("hang"), ctx("raise"), ctx("ok"), ctx("die"), ctx("ok")])
            took = time.monotonic() - t0
            # Both workers were replaced (hang, die): the pool is whole again and scores normally.
            second = await pool.score([ctx("ok"), ctx("sleep 0.2"), ctx("ok")])
            for _ in range(200):  # both replacements back in the pool (one may still be loading)
                if pool.idle.qsize() == 2:
                    break
                await asyncio.sleep(0.05)
            return first, took, second, ticks, pool.replaced, pool.idle.qsize()
        finally:
            tick.cancel()
            await pool.close()

    first, took, second, ticks, n_replaced, idle = run(main())
    assert [o.score for o in first] == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert first[0].error == "timed out after 1 s (worker replaced)"
    assert first[1].error == "RuntimeError: no such key"
    assert first[3].error.startswith("reward worker died") and "exit code 3" in first[3].error
    assert 1.0 <= took < 8.0
    assert ticks >= 10, "the event loop must keep running while a reward hangs"
    assert second == [Outcome(1.0, {})] * 3
    assert n_replaced == 2 and len(replaced) == 2 and idle == 2


def test_cancelled_scoring_replaces_the_busy_worker():
    """A grant cancelled mid-score (learner lost) leaves its worker mid-call: its late answer must not reach the next
    caller, so that worker is replaced, not reused."""

    async def main():
        pool = RewardPool("tests.reward_fns:behaves", workers=1, timeout_s=10.0)
        await pool.start()
        try:
            task = asyncio.ensure_future(pool.score([ctx("sleep 0.5")]))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await pool.score([ctx("ok")]), pool.replaced
        finally:
            await pool.close()

    assert run(main()) == ([Outcome(1.0, {})], 1)


def test_pool_start_fails_with_the_field_name():
    async def main():
        pool = RewardPool("tests.reward_fns:three_args", workers=2, timeout_s=1.0)
        await pool.start()

    with pytest.raises(ValueError, match="rollout.reward_fn: .*must take one argument"):
        run(main())


# ---- the actor's use ------------------------------------------------------------------------------------


class RecordingLog:
    def __init__(self):
        self.records = []

    def warning(self, event, **fields):
        self.records.append((event, fields))


def test_actor_fills_the_groups_reward_fields():
    """Rollouts.score: the grant's prompt, answer and metadata reach the reward with each completion's text and finish
    reason; parts, errors and the first error's line (with the reward's name) come back; the RolloutGroup checks."""
    from actors.engine import Completion
    from actors.rollout import Rollouts
    from protocol import messages as m
    from protocol.config import load_config

    completions = [
        Completion(token_ids=np.arange(n, dtype=np.int32), logprobs=-np.ones(n, np.float32), finish_reason=r, text=t)
        for n, r, t in ((2, "stop", "ab"), (3, "length", "xyz"))
    ]
    grant = m.WorkGrant(
        prompt_id=3,
        epoch=0,
        prompt_tokens=np.ones(2, np.int32),
        answer="a",
        policy_version=0,
        lease_s=9.0,
        prompt="Q: ",
        metadata='{"bonus": 10}',
    )

    async def main(grant, spec):
        cfg = load_config(None, [f"rollout.reward_fn={spec}"])
        rollouts = Rollouts(cfg, engine=None, rewards=RewardPool(spec, 1, 5.0), log=RecordingLog())
        await rollouts.rewards.start()
        try:
            return await rollouts.score(grant, completions, "train"), rollouts.log.records
        finally:
            await rollouts.rewards.close()

    scores, log = run(main(grant, "tests.reward_fns:context_len"))
    assert scores.rewards.tolist() == [12.0, 13.0] and scores.part_names == ["length", "stopped"]
    assert scores.parts.tolist() == [2.0, 1.0, 3.0, 0.0] and scores.errors == 0 and log == []
    group = m.RolloutGroup(
        actor_id="a",
        prompt_id=3,
        epoch=0,
        prompt_tokens=grant.prompt_tokens,
        lengths=np.array([2, 3], np.int32),
        completion_tokens=np.concatenate([c.token_ids for c in completions]),
        behaviour_logprobs=-np.ones(5, np.float32),
        rewards=scores.rewards,
        finish_reasons=["stop", "length"],
        version_min=0,
        version_max=0,
        gen_s=0.1,
        reward_s=0.1,
        reward_parts=scores.parts,
        reward_part_names=scores.part_names,
        reward_errors=scores.errors,
    )
    group.check()

    bad = m.WorkGrant(
        prompt_id=4, epoch=0, prompt_tokens=np.ones(2, np.int32), answer="a", policy_version=0, lease_s=9.0, metadata="not json"
    )
    scores, log = run(main(bad, "tests.reward_fns:behaves"))
    assert [event for event, _ in log] == ["actor.bad_metadata"]  # the reward still runs, with {} as metadata
    completions[0].text = "raise"
    scores, log = run(main(grant, "tests.reward_fns:behaves"))
    assert scores.rewards.tolist() == [0.0, 1.0] and scores.errors == 1
    assert log == [
        (
            "actor.reward_errors",
            {
                "reward": "tests.reward_fns:behaves",
                "errors": 1,
                "of": 2,
                "prompt_id": 3,
                "split": "train",
                "first": "RuntimeError: no such key",
                "suppressed": 0,
            },
        )
    ]
    completions[0].text = "many parts"  # 17 parts, one more than a group carries: the last is dropped, the score kept
    scores, log = run(main(grant, "tests.reward_fns:behaves"))
    assert scores.rewards.tolist() == [1.0, 1.0] and scores.errors == 0 and len(scores.part_names) == 16
    [(event, fields)] = log
    assert event == "actor.reward_parts_dropped" and fields["names"] == ["p16"]
