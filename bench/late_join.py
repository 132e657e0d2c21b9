"""Time from `fleetrl actor` start to its first accepted rollout, for an actor that joins a running learner.

A learner and one actor train the demo task (both on CPU 0); then, `--trials` times, one more actor
is started on CPU 1 with `fleetrl actor --learner ...`, timed until the hub accepts its first group,
and stopped (SIGTERM) again. Each phase comes from the actor's and the learner's logs (same clock):

  imports     process start -> actor.engine_start.begin (Python, torch, the actor's modules)
  engine      actor.engine_start (vLLM: import, AsyncLLM with its engine processes, model load, KV cache)
  warm-up     actor.engine_warmup: one throwaway request (the first is slow), before registering
  register    warmed up -> actor.registered (RegisterAck)
  join+sync   registered -> actor.weights_loaded: the learner forms a group epoch for the newcomer and sends
              it the current version (protocol/abortable.py joins, broadcast, load, repack)
  first group weights loaded -> hub.actor_first_group: its first group the hub admits for training
              (generated, scored, sent, and within the staleness bound when it arrives)

    python -m bench.late_join [--trials 3] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
from pathlib import Path

from bench.fleet import Fleet, exit_on_sigterm, when
from deploy.launch import demo_model
from protocol.config import load_config

PHASES = ("imports", "engine", "warm-up", "register", "join+sync", "first group", "total")


def trial(fleet: Fleet, name: str) -> dict[str, float]:
    fleet.start_actor(name, cpus="1")
    first = fleet.wait_for("learner", "hub.actor_first_group", lambda e: e["actor"] == name, timeout=600)
    begin = fleet.wait_for(name, "actor.engine_start.begin")
    ready = fleet.wait_for(name, "actor.engine_start.done")
    warm = fleet.wait_for(name, "actor.engine_warmup.done")
    reg = fleet.wait_for(name, "actor.registered")
    loaded = fleet.wait_for(name, "actor.weights_loaded")
    fleet.kill(name, signal.SIGTERM)
    fleet.wait_exit(name, 60)
    t0 = fleet.started[name]
    marks = [t0, when(begin), when(ready), when(warm), when(reg), when(loaded), when(first)]
    out = {phase: b - a for phase, a, b in zip(PHASES[:-1], marks[:-1], marks[1:], strict=True)}
    out["total"] = marks[-1] - t0
    out["version"], out["learner_version"] = first["version"], first["learner_version"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    args, overrides = ap.parse_known_args()
    exit_on_sigterm()
    model = demo_model(load_config())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp) / "run", model, ["train.total_steps=100000", "actor.kvcache_gib=1", *overrides])
        try:
            fleet.start_learner(cpus="0")
            fleet.start_actor("first", cpus="0")
            fleet.wait_for("learner", "learner.step", lambda e: e["step"] >= 5, timeout=600)
            for i in range(args.trials):
                rows.append(trial(fleet, f"late{i}"))
                print(f"trial {i}: " + "  ".join(f"{k} {v:.2f}" for k, v in rows[-1].items()), flush=True)
        finally:
            fleet.stop_all()
    print(
        f"\nLate joiner: `fleetrl actor` start -> first accepted group, seconds ({len(rows)} trials; learner + 1 actor on "
        "CPU 0, the joiner on CPU 1)"
    )
    print(f"{'':>8}" + "".join(f"{p:>13}" for p in PHASES))
    for i, r in enumerate(rows):
        print(f"{'trial ' + str(i):>8}" + "".join(f"{r[p]:>13.2f}" for p in PHASES))
    print(f"{'median':>8}" + "".join(f"{statistics.median(r[p] for r in rows):>13.2f}" for p in PHASES))
    print(
        "its first group's staleness when accepted (learner version - its version): "
        + ", ".join(str(int(r["learner_version"] - r["version"])) for r in rows)
    )


if __name__ == "__main__":
    main()
