"""deploy/submit.py's sbatch options from the config (no Slurm needed: the checks against sinfo are in tests/slurm)."""

import pytest

from deploy.submit import components, parse_gres
from protocol.config import ConfigError, load_config


def test_cpu_fleet_asks_for_no_gpu_and_requeues_before_its_time_limit():
    learner, actors = components(load_config(None, ["actor.device=cpu", "cluster.actor_nodes=2"]))
    assert learner == ["--nodes=1", "--requeue", "--signal=B:USR1@300"]  # job-wide options go with component 0
    assert actors == ["--nodes=2"]


def test_gpu_fleet_asks_each_component_for_its_gpus():
    learner, actors = components(load_config(None, ["cluster.learner_gpus_per_node=8", "cluster.actor_gpus_per_node=4"]))
    assert learner[:2] == ["--nodes=1", "--gpus-per-node=8"] and actors == ["--nodes=1", "--gpus-per-node=4"]


def test_grace_zero_sends_no_signal_and_a_bad_grace_is_one_line():
    learner, _ = components(load_config(None, ["actor.device=cpu", "cluster.time_limit_grace_s=0"]))
    assert learner == ["--nodes=1", "--requeue"]
    with pytest.raises(ConfigError, match=r"cluster.time_limit_grace_s: must be 0 \(off\) to 65535"):
        load_config(None, ["cluster.time_limit_grace_s=70000"])


def test_gres_counts_gpus():
    assert parse_gres("gpu:8") == 8 and parse_gres("gpu:a100:4(S:0-1)") == 4 and parse_gres("gpu:2,shard:8") == 2
    assert parse_gres("(null)") == 0
