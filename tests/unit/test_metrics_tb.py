"""MetricsWriter also writes TensorBoard scalars: every finite numeric key of a row, at step = row["step"]."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learner.record.metrics import MetricsWriter


def test_rows_become_tensorboard_scalars(tmp_path):
    rows = [
        {
            "step": s,
            "policy_version": 2 * s,
            "reward_mean": 0.25 * s,
            "time/step": 0.1 + s / 1000,
            "staleness/max_staleness": 1.0,
            "hub/granted": float(8 * s),
            "logprob_mismatch": float("nan"),
            "eval/val/reward_mean": 0.5 if s == 2 else None,
            "note": "text",
        }
        for s in (1, 2, 3)
    ]
    writer = MetricsWriter(tmp_path)
    for row in rows:
        writer.write(row)
    writer.close()

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"policy_version", "reward_mean", "time/step", "staleness/max_staleness", "hub/granted", "eval/val/reward_mean"}
    for key in ("policy_version", "reward_mean", "time/step", "hub/granted"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3]
        assert [e.value for e in events] == pytest.approx([float(r[key]) for r in rows], rel=1e-6)
    (only,) = acc.Scalars("eval/val/reward_mean")  # a key only some rows have
    assert (only.step, only.value) == (2, 0.5)
    # metrics.jsonl is unchanged: NaN written as null, every key kept
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["logprob_mismatch"] is None and lines[0]["note"] == "text"
