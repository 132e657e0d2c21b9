"""How completions are sampled and scored: for training (rollout) and for evaluation (eval)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.config.errors import check_choices, need

EnvErrors = Literal["requeue", "zero"]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    samples_per_prompt: int = 16  # completions per prompt (the GRPO group size; 16 as in DAPO)
    max_tokens: int = 4  # generation length limit per completion
    temperature: float = 1.0  # sampling temperature; behaviour logprobs are taken after it
    top_p: float = 1.0  # nucleus sampling: the most likely tokens up to this mass (1 = off); the learner scores the same
    top_k: int = 0  # sample among the k most likely tokens (0 = off); the learner scores the same
    stop: list[str] = field(default_factory=list)  # stop strings: generation ends at the first one (finish reason "stop")
    include_stop_str_in_output: bool = False  # the reward's text keeps the stop string that ended it (ORZ's "</answer>"); eval too
    reward_fn: str = "actors.rewards:exact_match"  # import path `package.module:function` (built-ins: actors/rewards)
    reward_timeout_s: float = 10.0  # a reward call running longer is killed (its worker replaced) and scores 0, counted an error
    reward_workers: int = 2  # processes per actor that run the reward function, off the actor's event loop
    # A group with a behaviour logprob below this is refused: sampling any token this unlikely has a chance of at
    # most vocabulary x e^min_logprob, whatever the distribution (e^-88 for 152k tokens), so it means a broken actor
    min_logprob: float = -100.0
    # a group with a reward beyond +-this is refused: the built-ins stay within +-10; 3e38 overflowed the advantages
    reward_bound: float = 1e4
    # Multi-turn episodes (docs/multi-turn.md): an environment class, `package.module:Class`, one instance per episode;
    # "" = one completion per sample. rollout.max_tokens is then the limit of one model turn.
    env: str = ""
    max_turns: int = 4  # model turns per episode at most (with rollout.env)
    max_episode_tokens: int = 0  # an episode's tokens after the prompt, model and observation (0 = up to actor.max_model_len)
    env_timeout_s: float = 30.0  # an environment call running longer ends its episode (env/timeouts)
    # an episode whose environment raised, hung or answered garbage: requeue its group (the prompt goes back to the
    # queue, nothing trained) | zero (the episode ends there, scored 0, and its group is trained)
    env_errors: EnvErrors = "requeue"

    def __post_init__(self) -> None:
        check_choices(self, "rollout")
        # samples_per_prompt >= 2 unless algo.advantage = gae: protocol/config/root.py (it depends on algo)
        need(self.samples_per_prompt >= 1, "rollout.samples_per_prompt", "must be >= 1")
        need(self.max_tokens >= 1, "rollout.max_tokens", "must be >= 1")
        need(self.temperature > 0, "rollout.temperature", "must be > 0")
        need(0 < self.top_p <= 1, "rollout.top_p", f"{self.top_p} must be in (0, 1] (1 = off)")
        need(self.top_k >= 0, "rollout.top_k", f"{self.top_k} must be >= 0 (0 = off)")
        need(all(self.stop), "rollout.stop", "an empty stop string would stop every completion at once")
        need(":" in self.reward_fn, "rollout.reward_fn", "must look like package.module:function")
        need(self.reward_timeout_s > 0, "rollout.reward_timeout_s", "must be > 0")
        need(self.reward_workers >= 1, "rollout.reward_workers", "must be >= 1")
        need(self.min_logprob < 0, "rollout.min_logprob", f"{self.min_logprob} must be < 0 (logprobs are <= 0)")
        need(self.reward_bound > 0, "rollout.reward_bound", f"{self.reward_bound} must be > 0")
        need(not self.env or ":" in self.env, "rollout.env", "must look like package.module:Class")
        need(self.max_turns >= 1, "rollout.max_turns", "must be >= 1")
        need(self.max_episode_tokens >= 0, "rollout.max_episode_tokens", "must be >= 0 (0 = up to actor.max_model_len)")
        need(self.env_timeout_s > 0, "rollout.env_timeout_s", "must be > 0")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every_steps: int = 0  # evaluate the validation and test sets every N updates (rollout batches; 0 = never)
    greedy: bool = True  # greedy decoding for evaluation; false = sample like training
    samples: int = 1  # completions per eval prompt when sampling
    top_p: float = 1.0  # nucleus sampling for evaluation when eval.greedy = false (1 = off)
    top_k: int = 0  # top-k sampling for evaluation when eval.greedy = false (0 = off)
    stop: list[str] = field(default_factory=list)  # stop strings for evaluation (greedy or not); set them as rollout.stop's
    max_prompts: int = 0  # evaluate at most this many prompts per set (0 = all)
    timeout_s: float = 300.0  # an eval round unfinished after this long is recorded partial (eval/*/prompts says how many)

    def __post_init__(self) -> None:
        need(self.every_steps >= 0, "eval.every_steps", "must be >= 0 (0 = never)")
        need(self.samples >= 1, "eval.samples", "must be >= 1")
        need(0 < self.top_p <= 1, "eval.top_p", f"{self.top_p} must be in (0, 1] (1 = off)")
        need(self.top_k >= 0, "eval.top_k", f"{self.top_k} must be >= 0 (0 = off)")
        need(
            not self.greedy or (self.top_p == 1 and self.top_k == 0),
            "eval.greedy",
            "greedy decoding ignores eval.top_p and eval.top_k: set eval.greedy = false to sample with them",
        )
        need(all(self.stop), "eval.stop", "an empty stop string would stop every completion at once")
        need(self.max_prompts >= 0, "eval.max_prompts", "must be >= 0 (0 = all)")
        need(self.timeout_s > 0, "eval.timeout_s", "must be > 0")
