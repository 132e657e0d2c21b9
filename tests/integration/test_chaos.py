"""A short chaos run (bench/chaos.py): a rogue client's bad groups, a live staleness change and an actor
SIGKILLed alone, against a real fleet. Nothing crashes, nothing is lost, no engine outlives its actor."""

import pytest

from bench.chaos import render, run
from bench.rogue import BAD_KINDS

pytestmark = pytest.mark.engine


def test_short_chaos_run_keeps_the_fleet_whole(tmp_path):
    report = run(
        0,
        seed=0,
        every_s=1.0,
        max_actors=2,
        overrides=["train.prompts_per_step=8"],
        run_dir=tmp_path / "run",
        schedule=["rogue", "staleness", "actor_kill"],
    )
    print("\n" + render(report, "short chaos run"))
    assert report["learner_exit"] == 0  # the learner never crashed, and its exit checked the ledger: none lost
    assert set(report["rogue"]) == set(BAD_KINDS)
    refused = {kind: codes for kind, codes in report["rogue"].items() if set(codes) - {"rejected", "quarantined"}}
    assert not refused, f"bad groups not refused: {refused}"
    assert report["violations"] == 0 and report["stalls_s"] == []
    assert report["orphans"] == [], "engine processes outlived their SIGKILLed actor"
    assert report["leftovers"] == [], "processes left after the fleet stopped"
