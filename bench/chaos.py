"""Chaos: the demo trains while a seeded schedule breaks the fleet, and the run is checked at the end.

    python -m bench.chaos [--minutes 5] [--seed 0] [section.field=value ...]

A learner and two actors (real processes: vLLM engines, DeepSpeed, ZeroMQ) train the demo task. Every
`--every` seconds the schedule (random.Random(seed)) injects one fault:

  actor_kill     SIGKILL one actor's process alone (not its group): its engine processes must follow it;
                 the actor is started again under the same id a few seconds later
  actor_attach   start one more actor (at most --max-actors alive)
  learner_kill   SIGKILL the learner, then `fleetrl learner --resume`: the actors wait and re-register
  staleness      `fleetrl ctl set max_staleness K` with K drawn from 0..3 (at least S - 1)
  rogue          a client that registers as an actor and answers its grants with one bad group of each kind
                 (bench/rogue.py): token id >= vocabulary, negative token id, reward 3e38, a completion longer
                 than rollout.max_tokens, an empty prompt, a prompt never granted, a logprob of -200

Then the learner is stopped with SIGTERM and everything else after it. The table:

  faults injected, by kind; what the rogue's groups got back (each must be refused)
  learner steps; any stall over 10 s between two steps, except while the learner itself was down
  the ledger at the end: prompts lost (the learner's exit checks none is), trained twice, requeued
  staleness violations: a step whose staleness_max exceeds the bound it was taken with
  peak RSS of each process (learner, actors, their engine processes); RSS growth per learner, actor and an actor's engine
  processes: within its longest life (2-3 min in against its last minute), and from its first life to its last
  leftover processes: anything the run started still alive after the stop, and any engine process
  still alive 10 s after its actor was SIGKILLed

Every process of the run carries FLEETRL_CHAOS=<token> in its environment; /proc finds them by it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from actors.lifeline import descendants
from bench.fleet import Fleet, exit_on_sigterm, when
from bench.rogue import Rogue
from deploy.ctl import set_setting
from deploy.launch import demo_model
from protocol.config import load_config

STALL_S = 10.0
ORPHAN_WAIT_S = 10.0
FAULTS = ("actor_kill", "actor_attach", "learner_kill", "staleness", "rogue")
SETTINGS = [
    "train.total_steps=100000",
    "data.epochs=100000",  # the demo's 1,000 passes over its 100 prompts last 6,250 updates: about 30 minutes here
    "actor.kvcache_gib=1",
    "hub.heartbeat_s=0.5",
    "checkpoint.every_steps=5",
    "checkpoint.keep=2",
    "log.samples_every_steps=0",
]


# ---- processes, found by the marker in their environment ---------------------------------------------
def marked(token: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries FLEETRL_CHAOS=token."""
    needle = f"FLEETRL_CHAOS={token}".encode()
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                out[int(entry.name)] = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, or not ours
            continue
    return {pid: cmd for pid, cmd in out.items() if cmd}  # zombies have no command line


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_name(pid: int) -> str:
    """A child's own name (/proc/PID/comm: "VLLM::EngineCor" for an engine core), so an actor's engine and its
    small helpers are reported apart; "child" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "child"
    except OSError:
        return "child"


def label(cmd: str) -> str:
    if " learner" in cmd:
        return "learner"
    if " actor " in cmd:
        return "actor " + cmd.split("--id ", 1)[1].split()[0] if "--id " in cmd else "actor"
    if "VLLM" in cmd or "vllm" in cmd.lower():
        return "engine (" + cmd.split()[0].rsplit("/", 1)[-1] + ")"
    return cmd.split()[0].rsplit("/", 1)[-1]


class RssWatch:
    """RSS of every fleet process, sampled every second on a thread; engine processes are labelled by their actor.
    Keeps each process's samples: pid -> (label, [(time, MiB)])."""

    def __init__(self, token: str):
        self.token = token
        self.owner: dict[int, str] = {}  # pid -> label of the fleet process it descends from
        self.series: dict[int, tuple[str, list[tuple[float, float]]]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def peak_mib(self) -> dict[str, float]:
        peak: dict[str, float] = {}
        for name, samples in self.series.values():
            peak[name] = max([peak.get(name, 0.0), *(m for _, m in samples)])
        return peak

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            now = time.time()
            for pid, cmd in marked(self.token).items():
                name = label(cmd)
                if name.startswith(("learner", "actor")):
                    self.owner[pid] = name
                    for d in descendants(pid):  # named as they are now: vLLM renames its engine core once started
                        self.owner[d] = f"{name}: {process_name(d)}"
                samples = self.series.get(pid, ("", []))[1]
                self.series[pid] = (self.owner.get(pid, name), samples)
                samples.append((now, rss_kib(pid) / 1024))


def level(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Median MiB of the samples taken in [start, end), or None when there are none."""
    inside = sorted(m for t, m in samples if start <= t < end)
    return inside[len(inside) // 2] if inside else None


def rss_growth(
    series: dict[int, tuple[str, list[tuple[float, float]]]], settle_s: float = 120.0, window_s: float = 60.0
) -> dict[str, dict]:
    """Per label (learner, actor aN, an actor's child processes by name: "actor aN: VLLM::EngineCor"), the RSS its
    processes grow by. The process behind a label is replaced when a fault kills it, so: `lives` incarnations;
    `longest_min`, the longest life, and its RSS `settle_s` after it started and over its last `window_s` (growth
    within one life); `first`/`last`: the first and last incarnations' RSS at the same age (growth carried across
    restarts: ledger, checkpoints). No I/O."""
    out: dict[str, dict] = {}
    for name, samples in series.values():
        if not samples:
            continue
        out.setdefault(name, {"lives": []})["lives"].append(samples)
    for entry in out.values():
        lives = sorted(entry.pop("lives"), key=lambda s: s[0][0])
        longest = max(lives, key=lambda s: s[-1][0] - s[0][0])
        t0, t1 = longest[0][0], longest[-1][0]
        entry["lives"] = len(lives)
        entry["longest_min"] = (t1 - t0) / 60
        entry["settled"] = level(longest, t0 + settle_s, t0 + settle_s + window_s)
        entry["end"] = level(longest, t1 - window_s, t1 + 1)
        at_age = [level(s, s[0][0] + settle_s, s[0][0] + settle_s + window_s) for s in lives]
        known = [m for m in at_age if m is not None]
        entry["first"], entry["last"] = (known[0], known[-1]) if known else (None, None)
    return out


# ---- the run ------------------------------------------------------------------------------------------
@dataclass
class Chaos:
    fleet: Fleet
    token: str
    rng: random.Random
    max_actors: int
    faults: Counter = field(default_factory=Counter)
    learner_down: list[tuple[float, float]] = field(default_factory=list)  # (killed, first step after) in time.time()
    orphans: list[str] = field(default_factory=list)  # engine processes alive ORPHAN_WAIT_S after their actor's SIGKILL
    rogue_replies: dict[str, Counter] = field(default_factory=dict)
    actors: list[str] = field(default_factory=list)
    next_id: int = 0

    def start_actor(self, name: str | None = None) -> str:
        if name is None:
            name, self.next_id = f"a{self.next_id}", self.next_id + 1
        self.fleet.start_actor(name, env={"FLEETRL_CHAOS": self.token})
        if name not in self.actors:
            self.actors.append(name)
        return name

    def actor_kill(self) -> None:
        name = self.rng.choice(self.actors)
        proc = self.fleet.procs[name]
        children = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the actor alone: its engine processes must not outlive it
        proc.wait(timeout=30)
        time.sleep(ORPHAN_WAIT_S)
        still = marked(self.token)  # every process of the run carries the marker, orphans included (zombies excluded)
        self.orphans += [f"{name}: pid {pid}" for pid in sorted(children) if pid in still]
        self.start_actor(name)

    def actor_attach(self) -> None:
        if sum(self.fleet.procs[a].poll() is None for a in self.actors) >= self.max_actors:
            self.faults["actor_attach (skipped: at --max-actors)"] += 1
            return
        self.start_actor()

    def learner_kill(self) -> None:
        t = self.fleet.kill("learner")
        self.fleet.procs["learner"].wait(timeout=30)
        after = len(self.fleet.log("learner"))
        self.fleet.start_learner(env={"FLEETRL_CHAOS": self.token}, resume=True)
        step = self.fleet.wait_for("learner", "learner.step", after=after, timeout=600)
        self.learner_down.append((t, when(step)))

    def staleness(self) -> None:
        k = self.rng.randint(0, 3)
        try:
            set_setting(self.fleet.addr, "max_staleness", k)
        except ValueError:  # refused (k < S - 1): counted as injected all the same
            pass

    def rogue(self) -> None:
        cfg = self.fleet.cfg
        vocab = json.loads((Path(cfg.model.path) / "config.json").read_text())["vocab_size"]
        r = Rogue(self.fleet.addr, vocab, cfg.rollout.max_tokens, cfg.rollout.samples_per_prompt)
        r.run()
        for kind, code in r.replies.items():
            self.rogue_replies.setdefault(kind, Counter())[code] += 1

    def inject(self, kind: str) -> None:
        self.faults[kind] += 1
        getattr(self, kind)()


def stalls(steps: list[float], down: list[tuple[float, float]]) -> list[float]:
    """Gaps over STALL_S between consecutive learner steps that no learner downtime explains."""
    out = []
    for a, b in zip(steps, steps[1:], strict=False):
        if b - a > STALL_S and not any(k <= b and a <= up for k, up in down):
            out.append(b - a)
    return out


def run(
    minutes: float, seed: int, every_s: float, max_actors: int, overrides: list[str], run_dir: Path, schedule: list[str] | None = None
) -> dict:
    """The chaos run; returns the report (also what the test checks). `schedule`: these faults in this order
    instead of random ones."""
    token = uuid.uuid4().hex
    model = demo_model(load_config())
    fleet = Fleet(run_dir, model, [*SETTINGS, *overrides])
    chaos = Chaos(fleet, token, random.Random(seed), max_actors)
    watch = RssWatch(token)
    leftovers: dict[int, str] = {}
    exit_code = None
    try:
        fleet.start_learner(env={"FLEETRL_CHAOS": token})
        chaos.start_actor()
        chaos.start_actor()
        fleet.wait_for("learner", "learner.step", lambda e: e["step"] >= 3, timeout=600)
        end = time.monotonic() + 60 * minutes
        plan = list(schedule) if schedule is not None else None
        while (plan is None and time.monotonic() < end) or plan:
            kind = plan.pop(0) if plan is not None else chaos.rng.choice(FAULTS)
            chaos.inject(kind)
            print(f"{time.strftime('%H:%M:%S')} injected {kind}", flush=True)
            time.sleep(every_s)
        after = len(fleet.log("learner"))
        fleet.wait_for("learner", "learner.step", after=after, timeout=300)  # still training after the last fault
        fleet.kill("learner", signal.SIGTERM)
        exit_code = fleet.wait_exit("learner", 300)
    finally:
        fleet.stop_all()
        watch.stop.set()
        time.sleep(2)
        leftovers = marked(token)
    steps = [when(e) for e in fleet.find("learner", "learner.step")]
    done = fleet.find("learner", "learner.done")
    ledger = done[-1]["ledger"] if done else {}
    rows = fleet.metrics()
    counts = {k.removeprefix("ledger/"): v for k, v in (rows[-1] if rows else {}).items() if k.startswith("ledger/requeued")}
    return {
        "faults": dict(chaos.faults),
        "rogue": {k: dict(v) for k, v in chaos.rogue_replies.items()},
        "learner_exit": exit_code,
        "learner_starts": 1 + chaos.faults["learner_kill"],
        "steps": len(rows),
        "stalls_s": stalls(steps, chaos.learner_down),
        "down_s": [round(b - a, 1) for a, b in chaos.learner_down],
        "ledger": ledger,
        "ledger_counts": counts,
        "violations": sum(r["staleness_max"] > r["max_staleness"] for r in rows),
        "rejected": {k: v for k, v in (rows[-1] if rows else {}).items() if k.startswith("hub/rejected")},
        "peak_rss_mib": watch.peak_mib,
        "rss_growth": rss_growth(watch.series),
        "leftovers": [f"{pid} {cmd[:80]}" for pid, cmd in leftovers.items()],
        "orphans": chaos.orphans,
    }


def render(report: dict, header: str) -> str:
    lines = [header, "", "| | |", "|---|---|"]
    lines += [f"| fault: {k} | {v} |" for k, v in sorted(report["faults"].items())]
    lines += [f"| rogue group: {k} | {', '.join(f'{c} x{n}' for c, n in v.items())} |" for k, v in sorted(report["rogue"].items())]
    lines += [
        f"| learner steps | {report['steps']} (learner exit {report['learner_exit']}, {report['learner_starts']} starts, "
        f"down {report['down_s']} s) |",
        f"| stalls > {STALL_S:.0f} s (learner up) | {len(report['stalls_s'])} {[round(s, 1) for s in report['stalls_s']]} |",
        f"| ledger at the end | {report['ledger']} |",
        f"| lost | {'0 (the learner exit checked the ledger)' if report['learner_exit'] == 0 else 'unknown: the learner failed'} |",
        f"| trained twice | {'0 (Ledger.trained refuses a second time)' if report['learner_exit'] == 0 else 'unknown'} |",
        f"| requeued | {sum(v for k, v in report['ledger_counts'].items() if k.startswith('requeued'))} "
        f"{ {k: v for k, v in report['ledger_counts'].items() if k.startswith('requeued')} } |",
        f"| staleness violations | {report['violations']} |",
        f"| groups refused by the hub | {report['rejected']} |",
    ]
    lines += [f"| peak RSS: {k} | {v:.0f} MiB |" for k, v in sorted(report["peak_rss_mib"].items())]
    mib = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    for k, g in sorted(report["rss_growth"].items()):
        lines.append(
            f"| RSS growth: {k} | longest of {g['lives']} lives {g['longest_min']:.1f} min: {mib(g['settled'])} -> {mib(g['end'])} MiB; "
            f"first -> last life at 2 min: {mib(g['first'])} -> {mib(g['last'])} MiB |"
        )
    lines += [
        f"| leftover processes after the stop | {len(report['leftovers'])} {report['leftovers']} |",
        f"| engine processes alive {ORPHAN_WAIT_S:.0f} s after their actor's SIGKILL | {len(report['orphans'])} {report['orphans']} |",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--max-actors", type=int, default=3)
    args, overrides = ap.parse_known_args()
    exit_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="fleetrl-chaos-"))
    t0 = time.strftime("%Y-%m-%d")
    try:
        report = run(args.minutes, args.seed, args.every, args.max_actors, overrides, tmp / "run")
    except BaseException:
        print(f"the run failed: its directory (logs, checkpoints) is kept in {tmp / 'run'}", flush=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = f"python -m bench.chaos --minutes {args.minutes:g} --seed {args.seed} --every {args.every:g}"
    print(render(report, f"Chaos run: `{cmd}`, {os.cpu_count()}-CPU machine, {t0}"))


if __name__ == "__main__":
    main()
