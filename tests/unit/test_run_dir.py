"""The run directory's files at a start (learner/resume.py). A fresh start (no --resume) in a run.dir that holds another
run's outputs sets them aside: appended to, the old metrics.jsonl made a second `make demo` report "200 steps" for a
run of 100, and a later --resume could have taken the old run's checkpoint. A resume cuts metrics.jsonl back to the
checkpoint it resumes from."""

import json

from learner.resume import RUN_OUTPUTS, LearnerState, restore_metrics, set_aside_previous_run


def test_a_fresh_start_sets_the_previous_run_aside(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-100").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    (run / "logs").mkdir()
    (run / "logs" / "actor-a.jsonl").write_text("{}\n")  # the actors' logs, written before the learner starts
    (run / "config.toml").write_text("[run]\n")  # the launcher's, for this start
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 101)))
    (run / "samples.jsonl").write_text("{}\n")
    aside = set_aside_previous_run(run, "20261125-000000-1")
    assert aside == run / "previous-20261125-000000-1"
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "metrics.jsonl", "samples.jsonl", "tensorboard"]
    assert not any((run / name).exists() for name in RUN_OUTPUTS)  # the new run starts with none of them
    assert (run / "logs" / "actor-a.jsonl").exists() and (run / "config.toml").exists()
    assert (aside / "checkpoints" / "step-100").is_dir() and len((aside / "metrics.jsonl").read_text().splitlines()) == 100
    # The new run's metrics alone: a --resume of it reads no row of the old one.
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "new": True}) + "\n")
    assert restore_metrics(run, LearnerState(updates=1, version=1, steps_per_update=1, world=1, zero_stage=2, hub={})) == 1
    assert [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == [{"step": 1, "new": True}]
    assert set_aside_previous_run(tmp_path / "empty", "x") is None


def _row(step: int) -> str:
    return json.dumps({"step": step, "policy_version": 2 * step, "reward_mean": 0.5})


def test_metrics_cut_back_to_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(_row(s) + "\n" for s in range(1, 7)) + '{"step": 7, "rew')  # torn last line
    state = LearnerState(updates=4, version=8, steps_per_update=2, world=1, zero_stage=2, hub={}, row={"step": 4})
    assert restore_metrics(tmp_path, state) == 4
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(_row(s) + "\n" for s in range(1, 5))
    # The crash came after checkpoint 5 was renamed, before row 5 was written: the checkpoint's copy fills it in.
    (tmp_path / "metrics.jsonl").write_text("".join(_row(s) + "\n" for s in range(1, 5)))
    state5 = LearnerState(updates=5, version=10, steps_per_update=2, world=1, zero_stage=2, hub={}, row=json.loads(_row(5)))
    assert restore_metrics(tmp_path, state5) == 5
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_metrics_cut_keeps_the_first_row_of_an_update_in_update_order(tmp_path):
    """Rows out of order, a repeated update, a foreign line, a last row with no newline: the file comes back as
    rows 1..N, each the first written, each on its own line."""
    lines = [_row(2), _row(1), "not json", json.dumps({"step": 2, "again": True}), "[1, 2]", _row(3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    state = LearnerState(updates=3, version=6, steps_per_update=2, world=1, zero_stage=2, hub={})
    assert restore_metrics(tmp_path, state) == 3
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(_row(s) + "\n" for s in (1, 2, 3))
