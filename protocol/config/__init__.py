"""One typed config for a run: a TOML file plus `section.field=value` overrides.

The same file serves the learner and the actors. Each section is a dataclass whose fields carry a one-line doc
(the comment beside or above them) and whose `__post_init__` checks them; a bad value fails at start with one
line naming the dotted field. `fleetrl config --list` and docs/configuration.md list every field from here.

    errors.py   ConfigError, and the helpers a section checks its fields with
    inputs.py   run, model, data, demo: what a run starts from
    rollout.py  rollout, eval: how completions are sampled and scored
    train.py    train, algo: the learner's update
    fleet.py    cluster, staleness, hub, weights, auth: the processes and what joins them
    actor.py    actor: the inference engine
    records.py  checkpoint, log: what the learner writes as it goes
    root.py     Config: the sections together, and the checks between sections
    loader.py   load_config (TOML + overrides), dump_toml

"Step" means two things here, named apart in every doc: an update trains one rollout batch
(train.prompts_per_step prompts) in S = train.mini_batches x train.ppo_epochs optimizer steps. The policy
version and train.warmup_steps count optimizer steps; train.total_steps, eval.every_steps,
checkpoint.every_steps and log.samples_every_steps count updates.
"""

from protocol.config.actor import ActorConfig
from protocol.config.errors import ConfigError, parse_cpus
from protocol.config.fleet import AuthConfig, ClusterConfig, HubConfig, StalenessConfig, WeightsConfig, tcp_port
from protocol.config.inputs import DATA_FORMATS, DataConfig, DemoConfig, ModelConfig, RunConfig
from protocol.config.loader import dump_toml, load_config, toml_value
from protocol.config.records import WANDB_MODES, CheckpointConfig, LogConfig
from protocol.config.rollout import EvalConfig, RolloutConfig
from protocol.config.root import Config
from protocol.config.train import AlgoConfig, TrainConfig

__all__ = [
    "DATA_FORMATS",
    "WANDB_MODES",
    "ActorConfig",
    "AlgoConfig",
    "AuthConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DemoConfig",
    "EvalConfig",
    "HubConfig",
    "LogConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "StalenessConfig",
    "TrainConfig",
    "WeightsConfig",
    "dump_toml",
    "load_config",
    "parse_cpus",
    "tcp_port",
    "toml_value",
]
