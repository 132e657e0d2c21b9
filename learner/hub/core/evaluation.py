"""Evaluation by the actors: one round per evaluated policy version.

    learner loop, version V just sent to the actors, eval due:   Evaluator.run(V)
      -> hub.start_eval(EvalRound(V, val + test prompts))
      -> hub thread: EvalGrant to actors serving exactly V (at most actor.max_groups each, least loaded first)
      -> EvalResult -> EvalRound.receive   (never the ledger, never the training buffer)
      -> hub.wait_eval: every prompt answered, or eval.timeout_s passed
      -> metrics eval/<split>/reward_mean, eval/<split>/prompts, eval/policy_version

The version stays fixed because the learner sends no newer weights while it waits
for the round, so an actor serving V keeps serving V; a result from any other
version is rejected and its prompt re-granted. An actor that dies or overruns its
lease gives its prompts back and another actor serving V takes them. If no actor is
left, the round ends at eval.timeout_s with the prompts answered so far: the metrics
say how many (eval/<split>/prompts) and eval/partial = 1, and the learner goes on.
Eval grants are outside the ledger and admission control, so training grants
continue unchanged during a round.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

from learner.data.prompts import Prompt, PromptSet
from protocol import messages as m
from protocol.config import Config


@dataclass(frozen=True, slots=True)
class Sampling:
    n: int  # completions per prompt
    temperature: float  # 0.0 = greedy

    @staticmethod
    def from_config(cfg: Config) -> Sampling:
        # Greedy decoding is deterministic: more than one sample would repeat the first.
        return Sampling(n=1, temperature=0.0) if cfg.eval.greedy else Sampling(n=cfg.eval.samples, temperature=cfg.rollout.temperature)


@dataclass(frozen=True, slots=True)
class EvalTask:
    split: str
    prompt_id: int  # index into the split's PromptSet
    prompt: Prompt
    seed: int


COUNTS = ("regranted_dead", "regranted_lease", "rejected", "duplicates")  # reported every round, 0 included


class EvalRound:
    """The hub-side state of one round: pending -> granted(actor, deadline) -> answered. Caller holds the hub lock."""

    def __init__(
        self,
        round_id: int,
        version: int,
        sets: dict[str, PromptSet],
        sampling: Sampling,
        *,
        max_prompts: int = 0,
        lease_s: float = 120.0,
        seed: int = 0,
    ):
        self.round_id, self.version, self.sampling, self.lease_s = round_id, version, sampling, lease_s
        self.tasks: list[EvalTask] = []
        for split, prompts in sets.items():
            count = len(prompts) if max_prompts == 0 else min(max_prompts, len(prompts))
            for i in range(count):  # the first ones: the same prompts every round, so rounds compare
                # Per-prompt seed, the same every round and on every actor (common random numbers).
                self.tasks.append(EvalTask(split, i, prompts[i], zlib.crc32(f"{seed}/{split}/{i}".encode())))
        assert self.tasks, "an eval round needs prompts"
        self.index = {(t.split, t.prompt_id): i for i, t in enumerate(self.tasks)}
        self.pending: deque[int] = deque(range(len(self.tasks)))  # may hold answered ones (skipped on pop)
        self.granted: dict[int, tuple[str, float]] = {}  # task -> (actor, lease deadline)
        self.rewards: dict[int, np.ndarray] = {}  # task -> float32 [n]
        self.reward_errors: dict[int, int] = {}  # task -> completions whose reward raised or timed out
        self.counts: Counter[str] = Counter()  # COUNTS
        self.started = time.monotonic()

    @property
    def done(self) -> bool:
        return len(self.rewards) == len(self.tasks)

    def held_by(self, actor: str) -> int:
        return sum(1 for a, _ in self.granted.values() if a == actor)

    def assign(self, ready: list[str], cap: int, now: float) -> list[tuple[str, m.EvalGrant]]:
        """Grant pending prompts to `ready` actors (those serving self.version), one each in turn, up to `cap` held."""
        out: list[tuple[str, m.EvalGrant]] = []
        held = {a: self.held_by(a) for a in ready}
        while self.pending:
            room = [a for a in sorted(ready, key=lambda a: held[a]) if held[a] < cap]
            if not room:
                break
            for actor in room:
                idx = self._next_pending()
                if idx is None:
                    return out
                self.granted[idx] = (actor, now + self.lease_s)
                held[actor] += 1
                out.append((actor, self._grant(idx)))
        return out

    def _next_pending(self) -> int | None:
        while self.pending:
            idx = self.pending.popleft()
            if idx not in self.rewards and idx not in self.granted:
                return idx
        return None

    def _grant(self, idx: int) -> m.EvalGrant:
        t = self.tasks[idx]
        return m.EvalGrant(
            eval_round=self.round_id,
            split=t.split,
            prompt_id=t.prompt_id,
            prompt_tokens=t.prompt.tokens,
            answer=t.prompt.answer,
            policy_version=self.version,
            n=self.sampling.n,
            temperature=self.sampling.temperature,
            seed=t.seed,
            lease_s=self.lease_s,
            prompt=t.prompt.text,
            metadata=t.prompt.metadata,
        )

    def receive(self, msg: m.EvalResult) -> str | None:
        """Take a result (the first one for its prompt wins). Returns why it was rejected, or None."""
        assert msg.eval_round == self.round_id
        idx = self.index.get((msg.split, msg.prompt_id))
        if idx is None:
            self.counts["rejected"] += 1
            return f"no prompt {msg.split}/{msg.prompt_id} in eval round {self.round_id}"
        if idx in self.rewards:
            self.counts["duplicates"] += 1
            return None
        why = None
        if not msg.version_min == msg.version_max == self.version:
            why = f"generated with versions {msg.version_min}..{msg.version_max}, round {self.round_id} evaluates {self.version}"
        elif msg.rewards.shape[0] != self.sampling.n:
            why = f"{msg.rewards.shape[0]} completions, the round asks for {self.sampling.n}"
        holder = self.granted.get(idx)
        if why is not None:
            self.counts["rejected"] += 1
            if holder is not None and holder[0] == msg.actor_id:  # its grant is spent: let someone redo it
                self._requeue(idx)
            return why
        self.granted.pop(idx, None)
        self.rewards[idx] = np.asarray(msg.rewards, dtype=np.float32)
        self.reward_errors[idx] = msg.reward_errors
        return None

    def _requeue(self, idx: int) -> None:
        del self.granted[idx]
        self.pending.appendleft(idx)

    def release_actor(self, actor: str) -> int:
        """A dead actor's prompts go back to pending."""
        held = [i for i, (a, _) in self.granted.items() if a == actor]
        for i in held:
            self._requeue(i)
        self.counts["regranted_dead"] += len(held)
        return len(held)

    def expire(self, now: float) -> int:
        late = [i for i, (_, deadline) in self.granted.items() if deadline <= now]
        for i in late:
            self._requeue(i)
        self.counts["regranted_lease"] += len(late)
        return len(late)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"eval/policy_version": float(self.version), "eval/partial": float(not self.done)}
        for split in dict.fromkeys(t.split for t in self.tasks):
            answered = [r for i, r in self.rewards.items() if self.tasks[i].split == split]
            out[f"eval/{split}/reward_mean"] = float(np.concatenate(answered).mean()) if answered else math.nan
            out[f"eval/{split}/prompts"] = float(len(answered))
            # a reward that fails scores 0: without this count it reads as a bad policy
            out[f"eval/{split}/reward_errors"] = float(sum(n for i, n in self.reward_errors.items() if self.tasks[i].split == split))
        out.update({f"eval/{k}": float(self.counts[k]) for k in COUNTS})
        out["time/eval"] = time.monotonic() - self.started
        return out
