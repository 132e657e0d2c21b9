"""A fresh start (no --resume) in a run.dir that holds another run's outputs sets them aside (learner/resume.py):
appended to, the old metrics.jsonl made a second `make demo` report "200 steps" for a run of 100, and a later
--resume could have taken the old run's checkpoint."""

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
    assert restore_metrics(run, LearnerState(updates=1, version=1, steps_per_update=1, world=1, zero_stage=2, hub={})) == [
        {"step": 1, "new": True}
    ]
    assert set_aside_previous_run(tmp_path / "empty", "x") is None
