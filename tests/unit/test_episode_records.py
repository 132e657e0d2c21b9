"""What rank 0 records of multi-turn episodes: the env/* metrics (learner/record/rollout_stats.py) and the
episode's turns in samples.jsonl (learner/record/samples.py), model and environment told apart."""

import numpy as np
import pytest
from conftest import rollout_group
from test_loss_mask import episode_group

from deploy.tiny import TOOL_TAGS, build_tokenizer
from learner.record.rollout_stats import rollout_metrics
from learner.record.samples import SampleWriter


def with_episodes(g, turns, calls, env_s=0.6, errors=0, timeouts=0):
    g.turns, g.tool_calls = np.asarray(turns, np.int32), np.asarray(calls, np.int32)
    g.env_s, g.env_errors, g.env_timeouts = env_s, errors, timeouts
    return g


def test_env_metrics_count_turns_calls_observations_and_failures():
    groups = [
        with_episodes(episode_group(seed=0), [2, 2, 1], [1, 1, 0]),
        with_episodes(episode_group(seed=1), [3, 1, 2], [2, 0, 1], 0.3, 1, 1),
    ]
    filtered = [with_episodes(episode_group(seed=2), [1, 1, 1], [0, 0, 0], 0.1, 2)]
    out = rollout_metrics(groups, filtered)
    assert out["env/turns_mean"] == pytest.approx(11 / 6) and out["env/tool_calls_mean"] == pytest.approx(5 / 6)
    assert out["env/tool_use_share"] == pytest.approx(4 / 6)
    assert out["env/obs_token_share"] == pytest.approx(10 / 30)  # 5 observation tokens of 15 in each group
    assert out["env/step_s"] == pytest.approx(0.9 / 11)
    assert (out["env/errors"], out["env/timeouts"]) == (3.0, 1.0)  # the filtered group's count too
    assert not any(k.startswith("env/") for k in rollout_metrics([rollout_group()]))  # one-turn runs: none


def test_samples_show_an_episodes_turns(tmp_path):
    tok = build_tokenizer(TOOL_TAGS)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in ("<calc>37+45</calc>", "<result>82</result>", "82")]
    g = rollout_group(n=1)
    g.lengths = np.asarray([sum(map(len, ids))], np.int32)
    g.completion_tokens = np.asarray([t for part in ids for t in part], np.int32)
    g.loss_mask = np.asarray([m for part, m in zip(ids, (1, 0, 1), strict=True) for _ in part], np.uint8)
    g.behaviour_logprobs = np.where(g.loss_mask == 1, -0.5, 0.0).astype(np.float32)
    with_episodes(g, [2], [1])
    writer = SampleWriter(tmp_path, 1, 1, tok, {g.prompt_id: type("P", (), {"text": "37+45=", "answer": "82"})()})
    (c,) = writer.record(1, 1, g)["completions"]
    assert c["turns"] == [
        {"role": "model", "text": "<calc>37+45</calc>"},
        {"role": "env", "text": "<result>82</result>"},
        {"role": "model", "text": "82"},
    ]
    assert (c["model_turns"], c["tool_calls"], c["text"]) == (2, 1, "<calc>37+45</calc><result>82</result>82")
