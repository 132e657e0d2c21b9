"""Per-step rollout metrics (length, truncation, reward parts and errors), sample completions in the run directory,
the step line's N/total and ETA, and the plot's panels."""

import json

import numpy as np
import pytest
import structlog

from deploy.tiny import build_tokenizer
from learner.record.metrics import MetricsWriter
from learner.record.rollout_stats import MAX_RUN_PART_NAMES, rollout_metrics
from learner.record.samples import SampleWriter
from protocol.logs import format_duration, setup_logging
from protocol.messages import RolloutGroup
from protocol.progress import Eta


def group(tokens: list[list[int]], rewards, reasons, parts=None, errors=0, prompt_id=0) -> RolloutGroup:
    names = sorted(parts or {})
    table = (
        np.asarray([[parts[k][i] for k in names] for i in range(len(tokens))], np.float32).reshape(-1) if names else np.zeros(0, np.float32)
    )
    flat = [t for seq in tokens for t in seq]
    return RolloutGroup(
        actor_id="a0",
        prompt_id=prompt_id,
        epoch=0,
        prompt_tokens=np.asarray([3, 4], np.int32),
        lengths=np.asarray([len(t) for t in tokens], np.int32),
        completion_tokens=np.asarray(flat, np.int32),
        behaviour_logprobs=np.zeros(len(flat), np.float32),
        rewards=np.asarray(rewards, np.float32),
        finish_reasons=reasons,
        version_min=0,
        version_max=0,
        gen_s=0.1,
        reward_s=0.0,
        reward_parts=table,
        reward_part_names=names,
        reward_errors=errors,
    )


def test_rollout_metrics():
    a = group([[5, 6, 1], [5, 1]], [1.0, 0.0], ["stop", "stop"], {"correct": [1.0, 0.0], "format": [1.0, 1.0]})
    b = group([[7, 7, 7, 7], [8]], [0.0, 1.0], ["length", "stop"], {"correct": [0.0, 1.0]}, errors=1)
    c = group([[9, 9]], [0.5], ["length"])  # a group with no parts: counted in lengths, not in any part's mean
    m = rollout_metrics([a, b, c])
    assert m == {
        "response/length_mean": pytest.approx((3 + 2 + 4 + 1 + 2) / 5),
        "response/length_max": 4.0,
        "response/truncation_rate": pytest.approx(2 / 5),
        "reward/errors": 1.0,
        "reward/part/correct": pytest.approx(2 / 4),
        "reward/part/format": 1.0,
    }
    assert list(m)[-2:] == ["reward/part/correct", "reward/part/format"]


def test_a_run_reports_a_bounded_number_of_part_names():
    """Each group may carry 16 names, the hub's limit; across a run the first MAX_RUN_PART_NAMES are reported and later
    names are left out, so actors that vary their names cannot mint metric keys without bound."""
    seen: set[str] = set()
    keys: set[str] = set()
    for step in range(10):
        names = {f"s{step}p{i:02d}": [1.0] for i in range(16)}
        keys |= set(rollout_metrics([group([[1]], [1.0], ["stop"], names)], part_names=seen))
    parts = sorted(k for k in keys if k.startswith("reward/part/"))
    assert len(parts) == MAX_RUN_PART_NAMES == 64 and parts[0] == "reward/part/s0p00" and parts[-1] == "reward/part/s3p15"
    again = rollout_metrics([group([[1]], [1.0], ["stop"], {"s0p00": [0.5], "late": [1.0]})], part_names=seen)
    assert again["reward/part/s0p00"] == 0.5 and "reward/part/late" not in again  # known names keep being reported


def test_samples_every_n_steps(tmp_path):
    tok = build_tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id

    class Prompt:
        def __init__(self, text, answer):
            self.text, self.answer = text, answer

    prompts = [Prompt("1+2=", "3"), Prompt("4+4=", "8")]
    writer = SampleWriter(tmp_path, every_steps=3, groups=1, tokenizer=tok, prompts=prompts)
    g = group([ids("8") + [eos], ids("12")], [1.0, 0.0], ["stop", "length"], {"correct": [1.0, 0.0]}, prompt_id=1)
    other = group([ids("3") + [eos]], [1.0], ["stop"], prompt_id=0)
    written = [writer.write(step, 10 * step, [g, other]) for step in range(1, 7)]
    assert written == [0, 0, 1, 0, 0, 1]
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(x["step"], x["policy_version"]) for x in lines] == [(3, 30), (6, 60)]
    assert lines[0] == {
        "step": 3,
        "policy_version": 30,
        "version_min": 0,
        "version_max": 0,
        "prompt_id": 1,
        "epoch": 0,
        "actor_id": "a0",
        "prompt": "4+4=",
        "answer": "8",
        "completions": [
            {"text": "8<eos>", "reward": 1.0, "parts": {"correct": 1.0}, "finish_reason": "stop", "tokens": 2},
            {"text": "12", "reward": 0.0, "parts": {"correct": 0.0}, "finish_reason": "length", "tokens": 2},
        ],
    }
    off = SampleWriter(tmp_path / "off", every_steps=0, groups=1, tokenizer=tok, prompts=prompts)
    assert off.write(10, 10, [g]) == 0 and not (tmp_path / "off").exists()


def test_eta_and_the_step_line(capsys):
    now = [100.0]
    eta = Eta(total=10, clock=lambda: now[0])
    assert eta.update(1) is None  # the first step holds the fleet's start: no pace yet
    now[0] += 4.0
    assert eta.update(2) == pytest.approx(4.0 * 8)
    now[0] += 8.0
    assert eta.update(4) == pytest.approx(12.0 / 3 * 6)
    assert eta.update(10) == 0.0
    assert [format_duration(s) for s in (0, 42.4, 185, 7380)] == ["0s", "42s", "3m05s", "2h03m"]
    saved = structlog.get_config()  # setup_logging is process-wide: the console it binds is capsys's
    try:
        log = setup_logging("learner", None)
        log.info("learner.step", step=4, steps_total=10, eta_s=24.0, version=4, reward=0.5)
        log.info("learner.step", step=1, steps_total=10, eta_s=None, version=1)
    finally:
        structlog.configure(**saved)
    first, second = capsys.readouterr().err.splitlines()
    assert "learner.step" in first and first.split("learner.step")[1].split() == [
        "step=4/10",
        "eta=24s",
        "version=4",
        "reward=0.5",
        "role=learner",
        "actor_id=None",
        "policy_version=None",
    ]
    assert second.split("learner.step")[1].split()[:2] == ["step=1/10", "eta=?"]


def test_plot_has_eval_and_length(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(1, 7):
        row = {"step": step, "reward_mean": step / 10, "response/length_mean": 2.0 + step, "response/length_max": 4.0 + step}
        if step % 3 == 0:
            row["eval/val/reward_mean"] = step / 8
        writer.write(row)
    writer.close()
    assert writer.curve.series("eval/val/reward_mean") == ([3, 6], [3 / 8, 6 / 8])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    captured = []
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kwargs):
        captured.append(fig)
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = spy
    try:
        path = writer.plot()
    finally:
        plt.Figure.savefig = real_savefig
    assert path == tmp_path / "reward_curve.png" and path.stat().st_size > 0
    (fig,) = captured
    top, bottom = fig.axes
    assert [ln.get_label() for ln in top.lines] == ["train reward_mean", "train, moving mean (1 steps)", "eval val reward_mean"]
    assert list(top.lines[2].get_xdata()) == [3, 6]
    assert [ln.get_label() for ln in bottom.lines] == ["length_mean", "length_max"]
    assert list(bottom.lines[1].get_ydata()) == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]


def test_reward_errors_count_filtered_groups_too():
    """A failing reward scores a whole group 0, and filter_equal_rewards drops exactly such groups: their errors must
    still show, or a reward that always raises reads as no errors at all."""
    trained = group([[5, 1]], [1.0], ["stop"])
    dropped = group([[6, 1], [7, 1]], [0.0, 0.0], ["stop", "stop"], errors=2)
    m = rollout_metrics([trained], [dropped])
    assert m["reward/errors"] == 2.0 and m["response/length_mean"] == 2.0  # lengths: the trained groups only
