"""Config: the run's sections together, and the checks between sections.

Each section checks its own fields in its `__post_init__`; a rule that reads two sections is here, run when a
Config is built (after its sections), so `Config()` and every loaded file pass through both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from protocol.config.actor import ActorConfig
from protocol.config.errors import need
from protocol.config.fleet import AuthConfig, ClusterConfig, HubConfig, StalenessConfig, WeightsConfig
from protocol.config.inputs import DataConfig, DemoConfig, ModelConfig, RunConfig
from protocol.config.records import CheckpointConfig, LogConfig
from protocol.config.rollout import EvalConfig, RolloutConfig
from protocol.config.train import AlgoConfig, TrainConfig
from protocol.net import is_loopback


@dataclass(kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        _check_groups(self.rollout, self.algo)
        _check_sequence_terms(self.train, self.algo)
        need(self.actor.max_model_len > self.rollout.max_tokens, "actor.max_model_len", "must exceed rollout.max_tokens")
        need(
            self.data.max_prompt_tokens < self.actor.max_model_len,
            "data.max_prompt_tokens",
            f"{self.data.max_prompt_tokens} leaves no room to generate in actor.max_model_len {self.actor.max_model_len}",
        )
        _check_checkpoint_scores(self.checkpoint, self.eval)
        _check_auth(self.auth, self.hub)

    @property
    def prompt_budget(self) -> int:
        """Prompt tokens a prompt may have (data.max_prompt_tokens, or all that leaves rollout.max_tokens to generate)."""
        return self.data.max_prompt_tokens or self.actor.max_model_len - self.rollout.max_tokens

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_groups(rollout: RolloutConfig, algo: AlgoConfig) -> None:
    # Group-normalized advantages need a group; PPO with a critic can learn from one sample per prompt (Tulu 3).
    need(
        rollout.samples_per_prompt >= 2 or algo.advantage == "gae",
        "rollout.samples_per_prompt",
        f"algo.advantage = {algo.advantage} needs >= 2 per group (only gae works with 1)",
    )


def _check_sequence_terms(train: TrainConfig, algo: AlgoConfig) -> None:
    """A sequence-level ratio or mask needs all of a sample's log-ratios on one rank; sequence parallelism splits a
    packed row, so a sample can straddle two ranks (learner/train/sequence_parallel.py)."""
    for name, on in (("algo.ratio", algo.ratio == "sequence"), ("algo.seq_mask_bound", algo.seq_mask_bound > 0)):
        need(
            not on or train.sequence_parallel_size == 1,
            name,
            f"a per-sample mean over the sample's tokens does not run with train.sequence_parallel_size = "
            f"{train.sequence_parallel_size} yet (a sample can straddle two ranks)",
        )


def _check_checkpoint_scores(checkpoint: CheckpointConfig, evaluation: EvalConfig) -> None:
    """Every checkpoint gets a score when the best one is picked by an eval metric."""
    scored = checkpoint.best_metric.startswith("eval/") and evaluation.every_steps > 0 and checkpoint.every_steps > 0
    need(
        not scored or checkpoint.every_steps % evaluation.every_steps == 0,
        "checkpoint.every_steps",
        f"{checkpoint.every_steps} must be a multiple of eval.every_steps ({evaluation.every_steps}), "
        f"so every checkpoint gets a {checkpoint.best_metric} score",
    )


def _check_auth(a: AuthConfig, hub: HubConfig) -> None:
    """CURVE is on by default off loopback; only the keys' presence is checked here (files: protocol/auth.py)."""
    loopback = is_loopback(hub.bind)
    need(
        a.curve != "off" or loopback,
        "auth.curve",
        f"off is refused for hub.bind {hub.bind} (not loopback): anyone who reaches it could take prompts "
        "and submit samples; run `fleetrl keys --out keys` and set the auth.* key files",
    )
    if a.curve == "on" or not loopback:
        need(
            any((a.server_key, a.server_secret, a.client_key, a.authorized)),
            "auth",
            f"CURVE is on (auth.curve = {a.curve}, hub.bind {hub.bind}) but no key is set: run "
            "`fleetrl keys --out keys`, then set auth.server_secret and auth.authorized on the learner, "
            "auth.server_key and auth.client_key on actors and other clients",
        )
