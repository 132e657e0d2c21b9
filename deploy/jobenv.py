"""The run's placement as shell variables, for the launch scripts (deploy/slurm/*.sbatch, deploy/fleet.sh):

    eval "$(python -m deploy.jobenv CONFIG [section.field=value ...])"

Each line is `FLEETRL_X=${FLEETRL_X:-value}`: the config gives the default, the environment may override it
(e.g. FLEETRL_ACTORS_PER_NODE=4 for added nodes with fewer GPUs). A bad config exits 2 naming the field.
"""

from __future__ import annotations

import shlex
import sys

from protocol.config import Config, ConfigError, load_config


def gpu_fleet(cfg: Config) -> bool:
    """Whether the fleet's nodes need GPUs. Learner rank 0 and every actor share one weight group, NCCL or gloo: a
    CPU actor (actor.device = "cpu") means a CPU learner too, and "auto" on a Slurm cluster means CUDA."""
    return cfg.actor.device != "cpu"


def job_env(cfg: Config) -> dict[str, str]:
    c = cfg.cluster
    if c.actor_gpus_per_node % c.tensor_parallel_size:
        raise ConfigError(
            f"cluster.tensor_parallel_size: {c.tensor_parallel_size} does not divide cluster.actor_gpus_per_node = {c.actor_gpus_per_node}"
        )
    port = cfg.hub.bind.rpartition(":")[2]
    if not port.isdigit():
        raise ConfigError(f"hub.bind: {cfg.hub.bind!r} has no port (expected tcp://HOST:PORT)")
    return {
        "FLEETRL_LEARNER_NODES": str(c.learner_nodes),
        "FLEETRL_LEARNER_GPUS_PER_NODE": str(c.learner_gpus_per_node),
        "FLEETRL_ACTOR_NODES": str(c.actor_nodes),
        "FLEETRL_ACTORS_PER_NODE": str(c.actor_gpus_per_node // c.tensor_parallel_size),
        "FLEETRL_GPUS_PER_ACTOR": str(c.tensor_parallel_size),
        "FLEETRL_RUN_DIR": cfg.run.dir,
        "FLEETRL_HUB_PORT": port,
        "FLEETRL_CURVE_KEYS": "given" if cfg.auth.server_secret else "",  # else the job makes them (fleet.sbatch)
        "FLEETRL_NEEDS_GPUS": "1" if gpu_fleet(cfg) else "0",
        "FLEETRL_ACTOR_DEVICE": cfg.actor.device,
    }


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m deploy.jobenv CONFIG [section.field=value ...]", file=sys.stderr)
        return 2
    try:
        env = job_env(load_config(argv[0], argv[1:]))
    except ConfigError as e:
        print(f"fleetrl: config error: {e}", file=sys.stderr)
        return 2
    for name, value in env.items():
        print(f"{name}=${{{name}:-{shlex.quote(value)}}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
