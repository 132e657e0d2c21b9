import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

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


def test_every_choice_field_names_itself_and_its_choices():
    """Each Literal[...] field refuses another value with one line: the dotted field and the allowed values."""
    from protocol.config import Config
    from protocol.config.errors import alternatives

    checked = []
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        for name, typ in typing.get_type_hints(cls).items():
            if typing.get_origin(typ) is not typing.Literal:
                continue
            choices = typing.get_args(typ)
            bad = 7 if isinstance(choices[0], int) else "bogus"
            cpu = ["actor.device=cpu"] if name == "cpu_gemm" else []  # a CUDA actor leaves the CPU-only fields alone
            with pytest.raises(ConfigError) as e:
                load_config(None, [*cpu, f"{section.name}.{name}={bad}"])
            assert str(e.value) == f"{section.name}.{name}: {bad!r} must be {alternatives(choices)}"
            checked.append(f"{section.name}.{name}")
    assert {"model.dtype", "data.format", "train.zero_stage", "algo.correction", "auth.curve", "actor.cpu_gemm"} <= set(checked)
    assert len(checked) >= 13


def test_sections_check_their_fields_when_built():
    """A section checks itself at construction, not only in load_config; Config() runs the cross-section checks."""
    from protocol.config import AlgoConfig, Config, RolloutConfig, TrainConfig

    assert Config() == load_config()
    with pytest.raises(ConfigError, match=r"^train\.lr: must be > 0$"):
        TrainConfig(lr=0)
    with pytest.raises(ConfigError, match=r"^algo\.correction: 'bogus' must be none, tis or decoupled$"):
        AlgoConfig(correction="bogus")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^rollout\.samples_per_prompt: algo\.advantage = grpo needs >= 2"):
        Config(rollout=RolloutConfig(samples_per_prompt=1))
    assert Config(rollout=RolloutConfig(samples_per_prompt=1), algo=AlgoConfig(advantage="gae")).rollout.samples_per_prompt == 1
    with pytest.raises(ConfigError, match=r"^train\.cpu_affinity: 'x' is not a CPU list"):
        TrainConfig(cpu_affinity="x")


def test_a_learner_loads_its_config_without_torch():
    """The CPU-only actor checks ask torch about a GPU only once they have failed: a learner never imports it for them."""
    code = (
        "import sys; from protocol.config import ConfigError, load_config; load_config('configs/demo.toml')\n"
        "try: load_config(None, ['actor.device=cpu', 'actor.cpu_gemm=onednn'])\n"
        "except ConfigError: pass\n"
        "assert 'torch' not in sys.modules, 'protocol.config imported torch'"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_step_fields_say_what_they_count():
    """An update (one rollout batch) is S = mini_batches x ppo_epochs optimizer steps: each *_steps doc says which."""
    from deploy.config_list import field_docs

    docs = {f"{d.section}.{d.name}": " ".join(d.doc) for d in field_docs()}
    for name in ("train.total_steps", "eval.every_steps", "checkpoint.every_steps", "log.samples_every_steps"):
        assert "updates" in docs[name] and "rollout batches" in docs[name], name
    assert "optimizer steps" in docs["train.warmup_steps"]
    assert "update" in docs["train.prompts_per_step"] and "optimizer steps" in docs["train.prompts_per_step"]
    assert "optimizer step u -> u+1" in docs["staleness.max_staleness"] and "S - 1" in docs["staleness.max_staleness"]
