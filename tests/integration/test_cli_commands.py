"""`fleetrl --version`, `fleetrl config --list`, `plan --config`, and `fleetrl check`."""

import dataclasses
import tomllib

import pytest
import structlog

from deploy.cli import main
from deploy.config_list import field_docs, render, sections
from protocol.config import load_config
from protocol.messages import PROTOCOL_VERSION
from tests.conftest import ROOT

DEMO = str(ROOT / "configs" / "demo.toml")


@pytest.fixture(autouse=True)
def _keep_logging():
    """The commands set up structlog process-wide (`check` at warning level): later tests get it back as it was."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"fleetrl 0.1.0 (wire protocol {PROTOCOL_VERSION})\n"


def test_config_list_documents_every_field(tmp_path, capsys):
    docs = field_docs()
    every = [(name, f.name) for name, cls in sections() for f in dataclasses.fields(cls)]
    assert [(d.section, d.name) for d in docs] == every and len(every) > 100
    undocumented = [f"{d.section}.{d.name}" for d in docs if not d.doc or not all(d.doc)]
    assert not undocumented
    by_name = {f"{d.section}.{d.name}": d for d in docs}
    assert by_name["train.lr"].doc == ["AdamW peak learning rate"]
    assert by_name["actor.cpu_gemm"].doc[0] == "How the CPU build runs linear layers (no effect on GPUs):"  # a block above
    assert by_name["rollout.stop"].doc[0].startswith("stop strings")  # a comment after a default_factory
    # The listing is a TOML file of the defaults: loaded back, it is the default config.
    assert main(["config", "--list"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "listed.toml").write_text(text)
    assert load_config(tmp_path / "listed.toml") == load_config()
    assert "lr = 0.0005  # AdamW peak learning rate" in text.splitlines()
    assert render("log.wandb").splitlines() == [
        "[log]",
        "# What the learner records beside metrics.jsonl: sample completions, and Weights & Biases (learner/metrics.py).",
        "wandb = false  # also send each metrics row to Weights & Biases (needs `pip install 'fleetrl[wandb]'`)",
        'wandb_project = "fleetrl"  # W&B project',
        'wandb_run_name = ""  # W&B run name ("" = the run directory\'s name)',
        'wandb_mode = "online"  # online | offline: write RUN_DIR/wandb only, no network (`wandb sync` uploads it later)',
    ]


def test_config_resolved(capsys):
    assert main(["config", DEMO, "train.lr=0.01"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["train"]["lr"] == 0.01


def test_plan_takes_config_like_the_other_commands(capsys):
    assert main(["plan", DEMO, "train.total_steps=7"]) == 0
    positional = capsys.readouterr().out
    assert main(["plan", "--config", DEMO, "train.total_steps=7"]) == 0
    assert capsys.readouterr().out == positional and "rollout batches                  7" in positional
    assert main(["plan", "train.total_steps=7", "--config", DEMO]) == 0
    assert capsys.readouterr().out == positional


def test_check_loads_model_data_and_reward(tmp_path, tiny_model_dir, capsys):
    rows = tmp_path / "rows.jsonl"  # a nested answer, a template, and a column that becomes metadata
    rows.write_text(
        '{"question": "3+4=", "solution": {"value": "7"}, "source": "hand"}\n'
        '{"question": "1+1=", "solution": {"value": "2"}, "source": "hand"}\n'
    )
    overrides = [
        f"model.path={tiny_model_dir}",
        "data.task=file",
        f"data.path={rows}",
        "data.prompt_key=question",
        "data.answer_key=solution.value",
        "data.prompt_template=({prompt})",
    ]
    assert main(["check", DEMO, *overrides]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"model   {tiny_model_dir}: qwen2, 2 layers, hidden 128, vocabulary 20; tokenizer")
    assert out[1] == f"data    {rows}: train 2 prompts"
    assert out[2:5] == [
        "        the first training prompt as the model sees it (6 tokens):",
        "          | (3+4=)",
        '        answer \'7\'; metadata {"source": "hand"}',
    ]
    assert out[5] == ("reward  actors.rewards:exact_match ((completion, answer) form): the answer above as a stopped completion scores 1")
    assert out[-1] == "ok: model, tokenizer, data and reward load; nothing was started"
    # A reward with parts, through `plan --check`.
    assert main(["plan", "--check", DEMO, *overrides, "rollout.reward_fn=actors.rewards:math_verify"]) == 0
    out = capsys.readouterr().out
    assert "Batch arithmetic" in out
    assert (
        'reward  actors.rewards:math_verify (RewardContext form): the answer above as a stopped completion scores 0, parts {"boxed": 0.0}'
    ) in out.splitlines()


def test_check_reports_a_reward_that_raises(tmp_path, tiny_model_dir, capsys, monkeypatch):
    (tmp_path / "picky_reward.py").write_text("def score(ctx):\n    return float(ctx.metadata['dataset'] == 'x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the reward worker is a process of its own
    assert main(["check", DEMO, f"run.dir={tmp_path}", f"model.path={tiny_model_dir}", "rollout.reward_fn=picky_reward:score"]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == "        answer '0'; metadata {}"  # what it was scoring
    assert captured.err == (
        "fleetrl: config error: rollout.reward_fn: picky_reward:score failed on the sample above "
        "(KeyError: 'dataset'); the actors would score such completions 0 and count a reward error\n"
    )
