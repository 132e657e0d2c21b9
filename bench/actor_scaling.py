"""Throughput with 1, 2 and 3 actors: samples/s trained by the learner, same settings, one run.

The learner starts with one actor; after `--window` steps at each size, one more actor is attached
(`fleetrl actor --learner ...`), and measuring resumes once it has delivered. Per phase: samples
trained per second, where each step's time went (waiting for rollouts vs training), each actor's
accepted groups, and the CPU the actors used (all their processes: actor, vLLM engine core).

Placement (2 cores here): the learner on CPU 0 and every actor on `--actor-cpus` (CPU 1 by
default), so the actors share one core, as they would share a node's inference GPUs only if there
were fewer GPUs than engines. `--actor-cpus 0-1` lets them use both cores, beside the learner.
`--actor-cpus 0/1` gives each actor its own spec: the first shares CPU 0 with the learner and the
second brings CPU 1, the one placement on 2 cores where a new actor adds a core.

    python -m bench.actor_scaling [--window 30] [--actor-cpus 1 | 0-1 | 0/1/1] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import Event, Fleet, exit_on_sigterm, when
from deploy.launch import demo_model
from deploy.status import fetch
from protocol.config import load_config

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pgid: int) -> float:
    """User + system CPU time of every live process in process group `pgid`."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid:  # fields[0] is the state (stat field 3); pgrp is stat field 5
            total += int(fields[11]) + int(fields[12])  # utime, stime: stat fields 14, 15
    return total / TICK


@dataclass(kw_only=True, slots=True)
class Phase:
    samples_per_s: float
    step_s: float
    wait_s: float  # learner waiting for rollouts, per step
    train_s: float
    groups: dict[str, float]  # accepted groups per second, per actor
    cpu: dict[str, float]  # CPU-seconds per second, per actor (all its processes)


def phase(fleet: Fleet, actors: list[str], window: int) -> Phase:
    """Measure `window` steps from now: samples/s, time split, per-actor groups and CPU."""
    start = fleet.wait_for("learner", "learner.step", after=len(fleet.log("learner")), timeout=300)["step"]
    s0, c0, t0 = fetch(fleet.addr), {a: cpu_seconds(fleet.procs[a].pid) for a in actors}, time.time()
    fleet.wait_for("learner", "learner.step", lambda e: e["step"] >= start + window, timeout=900)
    s1, c1, t1 = fetch(fleet.addr), {a: cpu_seconds(fleet.procs[a].pid) for a in actors}, time.time()
    rows = [r for r in fleet.metrics() if start < r["step"] <= start + window]
    wall = rows[-1]["wall_s"] - next(r for r in fleet.metrics() if r["step"] == start)["wall_s"]
    g0 = dict(zip(s0.actor_ids, s0.actor_groups.tolist(), strict=True))
    g1 = dict(zip(s1.actor_ids, s1.actor_groups.tolist(), strict=True))
    return Phase(
        samples_per_s=sum(r["samples"] for r in rows) / wall,
        step_s=wall / len(rows),
        wait_s=sum(r["time/wait"] for r in rows) / len(rows),
        train_s=sum(r["time/train"] for r in rows) / len(rows),
        groups={a: (g1.get(a, 0) - g0.get(a, 0)) / (t1 - t0) for a in actors},
        cpu={a: (c1[a] - c0[a]) / (t1 - t0) for a in actors},
    )


def field_is(key: str, value: object) -> Callable[[Event], bool]:
    return lambda e: e[key] == value


def logged_after(t: float) -> Callable[[Event], bool]:
    return lambda e: when(e) > t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=30, help="steps measured per fleet size")
    ap.add_argument(
        "--actor-cpus", default="1", help='CPU ids for every actor ("1", "0-1"), or one spec per actor joined by \'/\' ("0/1/1")'
    )
    ap.add_argument("--max-actors", type=int, default=3)
    args, overrides = ap.parse_known_args()
    exit_on_sigterm()
    per_actor = args.actor_cpus.split("/")
    cpus_of = lambda i: per_actor[min(i, len(per_actor) - 1)]  # noqa: E731  # the last spec repeats
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(Path(tmp) / "run", demo_model(load_config()), ["train.total_steps=100000", "actor.kvcache_gib=1", *overrides])
        try:
            fleet.start_learner(cpus="0")
            actors: list[str] = []
            for n in range(1, args.max_actors + 1):
                name = f"a{n - 1}"
                mark = len(fleet.log("learner"))
                fleet.start_actor(name, cpus=cpus_of(n - 1))
                first = fleet.wait_for("learner", "hub.actor_first_group", field_is("actor", name), after=mark, timeout=900)
                actors.append(name)
                fleet.wait_for("learner", "learner.step", logged_after(when(first) + 5.0), timeout=300)  # warmed up
                results.append(phase(fleet, list(actors), args.window))
                print(f"{n} actor(s): {results[-1].samples_per_s:.1f} samples/s", flush=True)
        finally:
            fleet.stop_all()
    k, n = fleet.cfg.staleness.max_staleness, fleet.cfg.train.prompts_per_step * fleet.cfg.rollout.samples_per_prompt
    print(
        f"\nThroughput by fleet size: demo settings ({n} samples per step, k = {k}), learner on CPU 0, actors on CPU(s) "
        f"{' / '.join(cpus_of(i) for i in range(len(results)))}, {args.window} steps each, "
        "measured after each new actor had delivered and warmed up"
    )
    print(f"{'actors':>6}{'samples/s':>11}{'x 1 actor':>10}{'s/step':>8}{'wait s':>8}{'train s':>9}{'actor CPU':>11}   groups/s per actor")
    base = results[0].samples_per_s
    for i, r in enumerate(results):
        print(
            f"{i + 1:>6}{r.samples_per_s:>11.1f}{r.samples_per_s / base:>10.2f}{r.step_s:>8.3f}{r.wait_s:>8.3f}"
            f"{r.train_s:>9.3f}{sum(r.cpu.values()):>11.2f}   " + "  ".join(f"{a} {g:.1f}" for a, g in r.groups.items())
        )
    print("\nactor CPU: CPU-seconds per second used by all actor processes together (1.00 = one full core).")


if __name__ == "__main__":
    main()
