"""`fleetrl check` and `plan --check`: they score a sample in a reward worker process. The commands that start nothing:
tests/unit/test_cli.py."""

import pytest

from deploy.cli import main
from tests.conftest import ROOT

DEMO = str(ROOT / "configs" / "demo.toml")


pytestmark = pytest.mark.usefixtures("keep_logging")  # the commands set up structlog process-wide


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
