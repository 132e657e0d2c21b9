"""What an actor makes of a grant: the engine's completions, scored by the reward workers, as the message the hub takes.

    WorkGrant --generate (again while vLLM ends completions unfinished)--> completions --score--> RolloutGroup | None
    WorkGrant, rollout.env --n episodes at once (actors/episode.py)--> episodes --their rewards, or score--> RolloutGroup
    EvalGrant --generate with the round's sampling--> completions --score--> EvalResult

No socket, no version bookkeeping: the actor (actors/main.py) waits until its engine serves the grant's version,
passes `served` (the version it serves now, read again when generation ends: weights may change mid-group) and
sends what comes back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from actors.engine import Completion, Engine, Sampling
from actors.env.base import EpisodeRow, load_env
from actors.episode import Episode, EpisodeRunner
from actors.rewards import GroupScores, Outcome, RewardContext, assemble, parse_metadata
from actors.rewards.pool import RewardPool
from protocol import messages as m
from protocol.config import Config
from protocol.logs import Throttle

# vLLM may end a completion unfinished ("error": a request-level failure it calls retryable; "abort"; "repetition"
# where that detector is on): not a sample of the policy, and the hub refuses it. The group is generated again.
GENERATE_ATTEMPTS = 3


class Rollouts:
    def __init__(self, cfg: Config, engine: Engine, rewards: RewardPool, log: Any):
        self.cfg, self.engine, self.rewards, self.log = cfg, engine, rewards, log
        self.sampling = Sampling.rollout(cfg)
        self._reward_error_log = Throttle(1.0)
        self._dropped_parts_log = Throttle(60.0)
        self._env_error_log = Throttle(1.0)
        # rollout.env: completions are episodes (a ValueError naming rollout.env when the class cannot be loaded)
        self.episodes = EpisodeRunner(cfg, engine, load_env(cfg.rollout.env), self.sampling) if cfg.rollout.env else None

    async def train_group(self, grant: m.WorkGrant, actor_id: str, served: Callable[[], int]) -> m.RolloutGroup:
        """The grant's group. One the engine ended unfinished GENERATE_ATTEMPTS times is still sent: the hub refuses
        it (reason `finish`, no fault of this actor) and puts the prompt back in its queue at once, where a group
        kept back here would hold it until its lease ran out."""
        if self.episodes is not None:
            return await self.episode_group(grant, actor_id, served)
        t0 = time.perf_counter()
        for attempt in range(1, GENERATE_ATTEMPTS + 1):
            version_min = served()
            completions = await self.engine.generate_group(grant.prompt_tokens, self.cfg.rollout.samples_per_prompt, sampling=self.sampling)
            unfinished = sorted({c.finish_reason for c in completions}.difference(m.FINISH_REASONS))
            if not unfinished:
                break
            self.log.warning("actor.unfinished_completions", prompt_id=grant.prompt_id, reasons=unfinished, attempt=attempt)
        else:
            self.log.error(
                "actor.group_unfinished",
                prompt_id=grant.prompt_id,
                reasons=unfinished,
                attempts=GENERATE_ATTEMPTS,
                why=f"the engine ended completions {unfinished} every time; sent for the hub to refuse and requeue",
            )
        version_max = served()
        gen_s = time.perf_counter() - t0
        scores = await self.score(grant, completions, "train")
        return m.RolloutGroup(
            actor_id=actor_id,
            prompt_id=grant.prompt_id,
            epoch=grant.epoch,
            prompt_tokens=grant.prompt_tokens,
            lengths=np.asarray([len(c.token_ids) for c in completions], dtype=np.int32),
            completion_tokens=np.concatenate([c.token_ids for c in completions]),
            behaviour_logprobs=np.concatenate([c.logprobs for c in completions]),
            rewards=scores.rewards,
            finish_reasons=[c.finish_reason for c in completions],
            version_min=version_min,
            version_max=version_max,
            gen_s=gen_s,
            reward_s=time.perf_counter() - t0 - gen_s,
            reward_parts=scores.parts,
            reward_part_names=scores.part_names,
            reward_errors=scores.errors,
        )

    async def episode_group(self, grant: m.WorkGrant, actor_id: str, served: Callable[[], int]) -> m.RolloutGroup:
        """rollout.samples_per_prompt episodes of the grant's prompt, run at once. An episode the environment ended
        by failing keeps finish reason "env_error" (rollout.env_errors = requeue: the hub refuses the group and
        requeues its prompt) or is scored 0 and ended as "length" (zero); either way counted and logged once."""
        assert self.episodes is not None
        t0 = time.perf_counter()
        row = EpisodeRow(prompt=grant.prompt, answer=grant.answer, metadata=self._metadata(grant, "train"))
        version_min = served()
        episodes = await asyncio.gather(*(self.episodes.run(grant.prompt_tokens, row) for _ in range(self.cfg.rollout.samples_per_prompt)))
        version_max = served()
        gen_s = time.perf_counter() - t0
        failed = [e for e in episodes if e.error is not None]
        if failed and (suppressed := self._env_error_log.ready()) is not None:
            self.log.warning(
                "actor.env_errors",
                env=self.cfg.rollout.env,
                errors=len(failed),
                of=len(episodes),
                prompt_id=grant.prompt_id,
                first=failed[0].error,
                then=self.cfg.rollout.env_errors,
                suppressed=suppressed,
            )
        if self.cfg.rollout.env_errors == "zero":
            for e in failed:
                e.finish_reason, e.reward = "length", 0.0
        scores = await self._episode_scores(grant, episodes)
        mask = np.concatenate([np.asarray(e.mask, np.uint8) for e in episodes])
        return m.RolloutGroup(
            actor_id=actor_id,
            prompt_id=grant.prompt_id,
            epoch=grant.epoch,
            prompt_tokens=grant.prompt_tokens,
            lengths=np.asarray([len(e.token_ids) for e in episodes], dtype=np.int32),
            completion_tokens=np.concatenate([np.asarray(e.token_ids, np.int32) for e in episodes]),
            behaviour_logprobs=np.concatenate([np.asarray(e.logprobs, np.float32) for e in episodes]),
            rewards=scores.rewards,
            finish_reasons=[e.finish_reason for e in episodes],
            version_min=version_min,
            version_max=version_max,
            gen_s=gen_s,
            reward_s=time.perf_counter() - t0 - gen_s,
            reward_parts=scores.parts,
            reward_part_names=scores.part_names,
            reward_errors=scores.errors,
            loss_mask=mask if not mask.all() else np.zeros(0, np.uint8),
            turns=np.asarray([e.turns for e in episodes], np.int32),
            tool_calls=np.asarray([e.tool_calls for e in episodes], np.int32),
            env_s=sum(e.env_s for e in episodes),
            env_errors=len(failed),
            env_timeouts=sum(e.timed_out for e in episodes),
        )

    async def _episode_scores(self, grant: m.WorkGrant | m.EvalGrant, episodes: list[Episode]) -> GroupScores:
        """The environment's rewards where every episode has one; else rollout.reward_fn on each episode's whole
        text, the environment's reward taking its place where there is one."""
        given = [e.reward for e in episodes]
        if all(r is not None for r in given):
            return assemble([Outcome(float(r or 0.0), {}) for r in given])
        split = grant.split if isinstance(grant, m.EvalGrant) else "train"
        scores = await self.score_texts(grant, [(e.completion_text, e.finish_reason) for e in episodes], split)
        for i, r in enumerate(given):
            if r is not None:
                scores.rewards[i] = r
        return scores

    async def eval_result(self, grant: m.EvalGrant, actor_id: str, served: Callable[[], int]) -> m.EvalResult:
        """The hub sends no newer weights during a round, so version_min == version_max == grant.policy_version.
        With rollout.env each completion is an episode (not seeded: an episode's turns are requests of their own);
        one its environment ended by failing scores 0."""
        version_min = served()
        t0 = time.perf_counter()
        sampling = Sampling.evaluation(self.cfg, grant.temperature)
        if self.episodes is not None:
            row = EpisodeRow(prompt=grant.prompt, answer=grant.answer, metadata=self._metadata(grant, grant.split))
            episodes = await asyncio.gather(*(self.episodes.run(grant.prompt_tokens, row, sampling) for _ in range(grant.n)))
            for e in episodes:
                if e.error is not None:
                    e.finish_reason, e.reward = "length", 0.0
            gen_s = time.perf_counter() - t0
            scores = await self._episode_scores(grant, episodes)
            lengths, finish = [len(e.token_ids) for e in episodes], [e.finish_reason for e in episodes]
        else:
            completions = await self.engine.generate_group(grant.prompt_tokens, grant.n, seed=grant.seed, sampling=sampling)
            gen_s = time.perf_counter() - t0
            scores = await self.score(grant, completions, grant.split)
            lengths, finish = [len(c.token_ids) for c in completions], [c.finish_reason for c in completions]
        return m.EvalResult(
            actor_id=actor_id,
            eval_round=grant.eval_round,
            split=grant.split,
            prompt_id=grant.prompt_id,
            lengths=np.asarray(lengths, dtype=np.int32),
            rewards=scores.rewards,
            finish_reasons=finish,
            version_min=version_min,
            version_max=served(),
            gen_s=gen_s,
            reward_errors=scores.errors,
        )

    def _metadata(self, grant: m.WorkGrant | m.EvalGrant, split: str) -> dict[str, Any]:
        try:
            return parse_metadata(grant.metadata)
        except ValueError as e:  # json.JSONDecodeError is a ValueError; the reward still runs, with no metadata
            self.log.warning("actor.bad_metadata", prompt_id=grant.prompt_id, split=split, error=str(e))
            return {}

    async def score(self, grant: m.WorkGrant | m.EvalGrant, completions: list[Completion], split: str) -> GroupScores:
        return await self.score_texts(grant, [(c.text, c.finish_reason) for c in completions], split)

    async def score_texts(self, grant: m.WorkGrant | m.EvalGrant, texts: list[tuple[str, str]], split: str) -> GroupScores:
        """Score a group's (text, finish reason) in the reward workers. A failed reward scores 0 and is counted in the
        group (and logged here, once per group, with its first line): the group is sent as usual."""
        metadata = self._metadata(grant, split)
        contexts = [
            RewardContext(completion=text, prompt=grant.prompt, answer=grant.answer, metadata=metadata, finish_reason=finish)
            for text, finish in texts
        ]
        scores = assemble(await self.rewards.score(contexts))
        # at most one line a second: a reward that fails on every row must not flood the log (the counts still go out)
        if scores.errors and (suppressed := self._reward_error_log.ready()) is not None:
            self.log.warning(
                "actor.reward_errors",
                reward=self.cfg.rollout.reward_fn,
                errors=scores.errors,
                of=len(contexts),
                prompt_id=grant.prompt_id,
                split=split,
                first=scores.first_error,
                suppressed=suppressed,
            )
        if scores.dropped_parts and (suppressed := self._dropped_parts_log.ready()) is not None:
            self.log.warning(
                "actor.reward_parts_dropped",
                reward=self.cfg.rollout.reward_fn,
                names=[name[: m.MAX_PART_NAME_CHARS] for name in scores.dropped_parts[:8]],
                why=f"reward parts are metrics: at most {m.MAX_REWARD_PARTS} per group, names of 1..{m.MAX_PART_NAME_CHARS} "
                "printable characters, finite values; the scores are kept",
                suppressed=suppressed,
            )
        return scores
