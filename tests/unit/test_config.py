import os

import pytest

from protocol.config import ConfigError, dump_toml, load_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config()
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(cfg))
    assert load_config(path) == cfg


def test_overrides_parse_types():
    cfg = load_config(None, ["train.lr=0.01", "staleness.max_staleness=3", "run.dir=/tmp/x", 'rollout.reward_fn="a.b:c"'])
    assert cfg.train.lr == 0.01 and cfg.staleness.max_staleness == 3 and cfg.run.dir == "/tmp/x"
    assert cfg.rollout.reward_fn == "a.b:c"


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=-1", "train.lr"),
        ("train.lr=fast", "train.lr"),
        ("train.nope=1", "train.nope"),
        ("staleness.max_staleness=-1", "staleness.max_staleness"),
        ("rollout.samples_per_prompt=1", "rollout.samples_per_prompt"),
        ("hub.bind=localhost:5", "hub.bind"),
        ("train.zero_stage=4", "train.zero_stage"),
        ("algo.advantage=ppo", "algo.advantage"),
        ("model.dtype=int8", "model.dtype"),
        ("actor.max_model_len=2", "actor.max_model_len"),
        ("train.cpu_affinity=zero", "train.cpu_affinity"),
        ("actor.cpu_bind=auto", "actor.worker_in_engine"),  # binding OMP threads needs vLLM's own worker process
        ("algo.advantage_normalize=true", "algo.advantage_normalize"),  # grpo: whitening is for GAE advantages
        ("train.max_tokens_per_micro_batch=-1", "train.max_tokens_per_micro_batch"),
        ("weights.snapshot=gpu", "weights.snapshot"),
        ("cluster.gpu_memory_gib=0", "cluster.gpu_memory_gib"),
        ("eval.top_p=0.95", "eval.greedy"),  # greedy decoding would ignore it silently
        ("rollout.min_logprob=0", "rollout.min_logprob"),
        ("rollout.reward_bound=0", "rollout.reward_bound"),
        ("hub.quarantine_after=-1", "hub.quarantine_after"),
        ("hub.quarantine_s=0", "hub.quarantine_s"),
    ],
)
def test_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[train]\nlr = true\n")
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(wrong)


def test_shipped_configs_load():
    from pathlib import Path

    for path in (Path(__file__).resolve().parents[2] / "configs").glob("*.toml"):
        load_config(path)


def test_engine_env_follows_worker_in_engine(monkeypatch):
    """actor.worker_in_engine decides where vLLM runs its worker; an inherited environment does not."""
    from actors.engine import engine_env

    monkeypatch.setattr(os, "environ", dict(os.environ))  # engine_env sets other variables too: keep them here
    for value, expected in (("true", "0"), ("false", "1")):
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if expected == "0" else "0")
        engine_env(load_config(None, [f"actor.worker_in_engine={value}"]), on_cuda=False)
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == expected
    assert load_config(None, ["actor.cpu_bind=auto", "actor.worker_in_engine=false"]).actor.cpu_bind == "auto"
