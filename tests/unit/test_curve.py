"""The reward curve keeps only what it draws (learner/record/curve.py): a long run's metrics rows are not held in
memory, and a resumed learner's curve still covers the whole run."""

import json
import random
import tracemalloc

from learner.record.curve import moving_mean
from learner.record.metrics import MetricsWriter


def _row(step: int) -> dict:
    """A row like the demo's, shorter: thirty keys, a reward part, an eval set every tenth update."""
    row = {"step": step, "reward_mean": step % 7 / 7, "response/length_mean": 20.0 + step % 5, "response/length_max": 40.0}
    row.update({f"stat/key_{i}": float(step * i) for i in range(26)})
    row["reward_part/format"] = 0.5
    row["note"] = "a string"
    if step % 10 == 0:
        row["eval/val/reward_mean"] = step / 1000
    return row


def test_moving_mean_is_the_mean_of_each_window():
    rng = random.Random(0)
    values = [rng.random() for _ in range(200)]
    for window in (1, 3, 20, 200, 500):
        naive = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
        assert max(abs(a - b) for a, b in zip(moving_mean(values, window), naive, strict=True)) < 1e-12


def test_the_writer_does_not_hold_its_rows(tmp_path):
    """Rows kept whole for the plot took kilobytes each: a 60-minute chaos run's learner grew by their size."""
    writer = MetricsWriter(tmp_path)
    for step in range(1, 201):  # TensorBoard's and the file's buffers, warmed up
        writer.write(_row(step))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(201, 1201):
        writer.write(_row(step))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    writer.close()
    assert grown / 1000 < 256, f"{grown / 1000:.0f} bytes held per row"
    assert writer.curve.series("reward_mean")[0] == list(range(1, 1201))


def test_a_resumed_writer_draws_the_whole_run(tmp_path):
    first = MetricsWriter(tmp_path)
    for step in range(1, 31):
        first.write(_row(step))
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 31, "rew')  # torn by a SIGKILL
    second = MetricsWriter(tmp_path)
    second.write(_row(31))
    second.close()
    assert second.curve.series("reward_mean") == ([*range(1, 32)], [_row(s)["reward_mean"] for s in range(1, 32)])
    assert second.curve.series("eval/val/reward_mean") == ([10, 20, 30], [0.01, 0.02, 0.03])
    assert "reward_part/format" in second.keys and "note" in second.keys  # the learner's reward part names come from these
    assert second.plot() == tmp_path / "reward_curve.png"
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 31
