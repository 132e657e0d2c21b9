"""One hub, many actors: the real hub (learner.hub.server.Hub over HubState) against scripted actors.

    python -m bench.hub_scale [--actors 10,100,300,1000] [--seconds 60] [--hang-s 15] [--mesh 2,10,50,100] [section.field=value ...]

Per fleet size N, in fresh processes: the hub in one (a trainer stand-in on its own thread takes batches of
train.prompts_per_step groups at the demo's pace, TRAIN_S per update, advances the version and sends every live
actor a WeightSync through the hub, which the actors answer with WeightVersion: no model, no weight group), the
actors in three (bench/hub_fleet.py: one DEALER socket each, the real actor's messages, honest groups):
a main group, a tenth that will hang, and up to 100 that will die. Phases, in order:

  steady   --seconds of the whole fleet at work. Grant latency: from an actor's message to the grant the hub
           made in answer to it (hub side: which message of that actor the grant's pump answered; actor side:
           when that message left and when the grant arrived), p50 and p99; grants made later, when admission
           let them, wait for the learner and are not latency. Groups/s taken by the trainer. Hub thread CPU:
           its utime + stime (/proc/self/task/TID/stat) over the phase, as % of one core. Memory per actor:
           the hub process's RSS with the fleet at work minus before it bound, over N. Fairness: the actors
           granted at least once in the phase (of N), and the fewest and most grants one actor had.
  hang     the tenth's process is SIGSTOPped for --hang-s (sockets open, silent), then SIGCONTed: the longest
           gap between two batches taken while it hung.
  kill     the dying group's process is SIGKILLed (every connection closes): seconds until the hub has
           removed all of them and put the leases they held back in the queue.
  end      the hub stops (Shutdown to every actor); the ledger is checked: every prompt in exactly one state,
           none trained twice (the trainer's keys are distinct), every trained prompt trained in the ledger.

Then, with --mesh, weight-group formation (gloo): a group of each size formed from ranks spread over
MESH_PROCS processes (threads in each; one rendezvous store), seconds from the start to every rank's store
client connected, and to every rank's group built. Each size is formed twice. Connecting every pair (gloo's
default, FleetRL's up to weights.gloo_mesh_ranks): each rank holds size - 1 connections, so a process holding
m ranks needs about m x (size - 1) file descriptors; a size that cannot fit is reported, not tried. Lazily
(larger groups): each rank connects only the pairs of the broadcast's binomial tree, and the build ends with
the one-element probe broadcast that FleetRL's open_group makes, so "built" means connected. Then rank 0 sends
WEIGHT_TENSORS seeded tensors as the learner does (Buckets.send) and every other rank receives them as an actor
does (receive_buckets) and compares each with its own copy bit for bit: seconds from rank 0's first bucket to the
last rank holding all of them.
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing as mp
import os
import queue
import signal
import statistics
import threading
import time
from collections import Counter
from typing import Any

from bench.channel import machine
from bench.hub_fleet import serve
from protocol.net import free_port

PROMPTS_PER_STEP = 16  # the demo's (configs/demo.toml)
SAMPLES = 16
TRAIN_S = 0.3  # one demo update on this machine, about (docs/benchmarks.md: 100 updates in 28-37 s)
CAPACITY = 8  # actor.max_groups' default
HEARTBEAT_S = 2.0  # hub.heartbeat_s' default
WAIT_S = 120.0  # a phase that sees nothing for this long fails (a broken run fails, it does not hang)
FLEET_PROC = 250  # main-group actors per process: one Python loop for a thousand lagged behind its own traffic


def rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the hub's process --------------------------------------------------------------------------------
class Recorder:
    """Wraps the hub state's handle and pump (on the instance): which message each grant answered, who got grants."""

    def __init__(self, state: Any):
        from protocol import messages as m

        self.seq: Counter[str] = Counter()  # messages seen per actor
        self.names: dict[bytes, str] = {}  # connection -> actor id
        self.answered: dict[tuple[str, tuple[int, int]], int] = {}  # (actor, key) -> its message the grant answered
        self.grants: dict[str, list[float]] = {}  # actor -> grant times
        handle, pump = state.handle, state.pump

        def handle_(identity: bytes, msg: Any, now: float, key: str | None = None) -> list:
            actor = getattr(msg, "actor_id", None)
            if actor is not None:
                self.seq[actor] += 1
                self.names[identity] = actor
            outs = handle(identity, msg, now, key)
            for out in outs:
                if actor is not None and out.identity == identity and isinstance(out.msg, m.WorkGrant):
                    self.answered[(actor, (out.msg.epoch, out.msg.prompt_id))] = self.seq[actor]
            return outs

        def pump_(now: float) -> list:
            outs = pump(now)
            for out in outs:
                if isinstance(out.msg, m.WorkGrant) and (actor := self.names.get(out.identity)) is not None:
                    self.grants.setdefault(actor, []).append(now)
            return outs

        state.handle, state.pump = handle_, pump_


def _hub(port: int, overrides: list[str], cmds: mp.Queue, out: mp.Queue) -> None:
    import logging

    import numpy as np

    from deploy.tiny import build_tokenizer
    from learner.data.prompts import PromptSet, addition_items
    from learner.hub.core.ledger import State
    from learner.hub.server import Hub
    from protocol import messages as m
    from protocol.config import load_config
    from protocol.logs import setup_logging

    setup_logging("bench", level=logging.ERROR)
    cfg = load_config(
        None,
        [
            f"hub.bind=tcp://127.0.0.1:{port}",
            f"rollout.samples_per_prompt={SAMPLES}",
            f"train.prompts_per_step={PROMPTS_PER_STEP}",
            "staleness.max_staleness=1",
            f"actor.max_groups={CAPACITY}",
            f"hub.heartbeat_s={HEARTBEAT_S}",
            *overrides,
        ],
    )
    hub = Hub(cfg, PromptSet(addition_items(), build_tokenizer()))
    rec = Recorder(hub.state)
    rss0 = rss_kib()
    hub.start()
    tid = next(t.native_id for t in threading.enumerate() if t.name == "fleetrl-hub")
    assert tid is not None
    stop = threading.Event()
    takes: list[float] = []
    trained: list[tuple[int, int]] = []

    def train() -> None:
        version = 0
        while not stop.is_set():
            try:
                batch = hub.take_batch(PROMPTS_PER_STEP, timeout_s=0.5)
            except TimeoutError:
                continue
            takes.append(time.monotonic())
            time.sleep(TRAIN_S)
            keys = [item.key for item in batch]
            trained.extend(keys)
            version += 1
            hub.finish_update(version, keys)
            sync = m.WeightSync(
                policy_version=version,
                group_epoch=1,
                store_host="127.0.0.1",
                store_port=1,
                rank=1,
                ranks=1,
                world_size=2,
                backend="gloo",
                timeout_s=10.0,
                names=["w"],
                shapes=[[4]],
                dtype="float32",
                bucket_bytes=1 << 20,
            )
            hub.send_weight_sync(hub.live_actors(), lambda _actor: sync)  # noqa: B023 (used before the next one is made)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    out.put(("ready", rss0))
    while True:
        cmd, *args = cmds.get()
        if cmd == "count":
            with hub.cond:
                out.put(sum(a.startswith(args[0]) for a in hub.state.actors))
        elif cmd == "mark":
            out.put((time.monotonic(), thread_cpu_s(tid), len(takes), rss_kib()))
        elif cmd == "takes":
            out.put([t for t in takes if t >= args[0]])
        elif cmd == "gone":  # until no actor of this prefix is registered (unless `leases_only`) nor holds a lease
            prefix, t0, leases_only, limit_s = args
            held = 0
            with hub.cond:
                held = sum(len(s.held) for a, s in hub.state.actors.items() if a.startswith(prefix))
            while True:
                with hub.cond:
                    left = 0 if leases_only else sum(a.startswith(prefix) for a in hub.state.actors)
                    leases = sum(
                        1 for e in hub.state.ledger.entries.values() if e.state is State.GRANTED and (e.actor or "").startswith(prefix)
                    )
                if left == 0 and leases == 0:
                    out.put((time.monotonic() - t0, held))
                    break
                if time.monotonic() - t0 > limit_s:
                    out.put((math.nan, held))
                    break
                time.sleep(0.002)
        elif cmd == "stop":
            stop.set()
            trainer.join(timeout=30)
            hub.stop("bench over")
            ledger = hub.state.ledger
            ledger.check()
            counts = ledger.state_counts()
            exact = len(set(trained)) == len(trained) and counts["trained"] == len(trained)
            grants = {a: np.asarray(t) for a, t in rec.grants.items()}
            out.put(("done", rec.answered, grants, exact, counts, dict(hub.state.counters)))
            return


# ---- one fleet size ----------------------------------------------------------------------------------
def _ask(cmds: mp.Queue, out: mp.Queue, procs: list, *cmd: Any) -> Any:
    cmds.put(cmd)
    return _get(out, procs)


def _get(q: mp.Queue, procs: list, wait_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
            if dead:
                raise AssertionError(f"{dead[0].name} exited with {dead[0].exitcode}") from None
    raise AssertionError(f"nothing in {wait_s} s")


def pid_of(p: Any) -> int:
    assert p.pid is not None
    return int(p.pid)


def groups_of(n: int) -> dict[str, int]:
    """The fleet's groups: a tenth that hangs, up to 100 that die (a third at most), the rest."""
    hang = max(1, n // 10)
    kill = max(1, min(100, n // 3))
    return {"h-": hang, "k-": kill, "a-": n - hang - kill}


def run_scale(n: int, seconds: float, hang_s: float, overrides: list[str]) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    port = free_port()
    cmds, out, fleet_out = spawn.Queue(), spawn.Queue(), spawn.Queue()
    hub = spawn.Process(target=_hub, args=(port, overrides, cmds, out), name="hub")
    hub.start()
    _, rss0 = _get(out, [hub])
    addr = f"tcp://127.0.0.1:{port}"
    limit = seconds + hang_s + 120
    fleets = {}
    for seed, (prefix, size) in enumerate(groups_of(n).items()):
        ids = [f"{prefix}{i}" for i in range(size)]
        parts = [ids[i : i + FLEET_PROC] for i in range(0, size, FLEET_PROC)] if prefix == "a-" else [ids]
        for k, part in enumerate(parts):
            fleets[f"{prefix}{k}" if k else prefix] = spawn.Process(
                target=serve,
                args=(addr, part, CAPACITY, SAMPLES, HEARTBEAT_S, 10 * seed + k, limit, fleet_out),
                name=f"fleet {prefix}{k}",
                daemon=True,
            )
    for p in fleets.values():
        p.start()
    procs = [hub, *fleets.values()]
    deadline = time.monotonic() + WAIT_S
    while _ask(cmds, out, procs, "count", "") < n:
        assert time.monotonic() < deadline, f"not all {n} actors registered in {WAIT_S} s"
        time.sleep(0.2)
    time.sleep(3.0)  # warm-up: every actor has asked, synced, sent a group
    t0, cpu0, takes0, _ = _ask(cmds, out, procs, "mark")
    time.sleep(seconds)
    t1, cpu1, takes1, rss1 = _ask(cmds, out, procs, "mark")

    os.kill(pid_of(fleets["h-"]), signal.SIGSTOP)
    h0 = time.monotonic()
    freed_s, hung_leases = _ask(cmds, out, procs, "gone", "h-", h0, True, hang_s)  # nan: still held when it wakes
    time.sleep(max(0.0, h0 + hang_s - time.monotonic()))
    h1 = time.monotonic()
    os.kill(pid_of(fleets["h-"]), signal.SIGCONT)
    taken = [h0, *_ask(cmds, out, procs, "takes", h0), h1]
    taken = sorted(t for t in taken if h0 <= t <= h1)
    pause = max(b - a for a, b in zip(taken, taken[1:], strict=False))
    time.sleep(3.0)

    k0 = time.monotonic()
    os.kill(pid_of(fleets["k-"]), signal.SIGKILL)
    requeue_s, killed_leases = _ask(cmds, out, procs, "gone", "k-", k0, False, WAIT_S)

    _, answered, grants, exact, counts, counters = _ask(cmds, out, procs, "stop")
    report: dict[str, Any] = {}  # the main group's processes' (the hung one answers too)
    for _ in range(len(fleets) - 1):  # every process but the killed one
        report.update({a: r for a, r in _get(fleet_out, procs)[1].items() if a.startswith("a-")})
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()

    latencies = []
    for (actor, key), seq in answered.items():
        if actor in report:
            sends, arrivals = report[actor]
            arrived = arrivals.get(key)
            if arrived is not None and t0 <= arrived <= t1 and seq <= len(sends):
                latencies.append(arrived - sends[seq - 1])
    per_actor = [int(((g >= t0) & (g <= t1)).sum()) for g in grants.values()] + [0] * (n - len(grants))
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [math.nan] * 99
    return {
        "n": n,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
        "latencies": len(latencies),
        "groups_s": (takes1 - takes0) * PROMPTS_PER_STEP / (t1 - t0),
        "cpu": (cpu1 - cpu0) / (t1 - t0),
        "kib_per_actor": (rss1 - rss0) / n,
        "granted": sum(c > 0 for c in per_actor),
        "min_grants": min(per_actor),
        "max_grants": max(per_actor),
        "hung": groups_of(n)["h-"],
        "pause_s": pause,
        "hung_leases": hung_leases,
        "freed_s": freed_s,
        "killed": groups_of(n)["k-"],
        "killed_leases": killed_leases,
        "requeue_s": requeue_s,
        "exact": exact,
        "trained": counts["trained"],
    }


# ---- weight-group formation --------------------------------------------------------------------------
MESH_PROCS = 4  # processes the ranks are spread over (the learner's rank 0 is in the first)
MESH_TIMEOUT_S = 120.0


WEIGHT_SHAPE = [128, 512]  # float32: 256 KiB per tensor
WEIGHT_TENSORS = 16  # 4 MiB of weights
WEIGHT_BUCKET_BYTES = 1 << 20  # 4 buckets


def mesh_weights() -> list:
    """The weights the mesh's rank 0 broadcasts, the same in every process (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randn(WEIGHT_SHAPE, generator=gen) for _ in range(WEIGHT_TENSORS)]


def _mesh_ranks(port: int, ranks: list[int], size: int, lazy: bool, go: Any, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from learner.weights.buckets import Buckets
    from protocol import weights as wg

    stored: list[float] = []  # when each rank's store client had connected
    done: list[float] = []  # when each rank's group was built (lazy: its probe broadcast done)
    received: list[float] = []  # when each rank other than 0 held every bucket, each tensor checked bit for bit
    sent: list[float] = []  # when rank 0 began sending
    errors: list[str] = []
    weights = mesh_weights()
    names = [f"w{i}" for i in range(len(weights))]
    shapes = [list(w.shape) for w in weights]

    def join(rank: int) -> None:
        try:
            store = wg.open_store("127.0.0.1", port, is_master=False, timeout_s=MESH_TIMEOUT_S)
            stored.append(time.monotonic())
            group = wg.open_group(store, "127.0.0.1", 1, rank, size, MESH_TIMEOUT_S, lazy=lazy)
            done.append(time.monotonic())
            keep.append(group)
            # The weights, as the learner sends them (Buckets.send) and an actor receives them (receive_buckets).
            if rank == 0:
                sent.append(time.monotonic())
                Buckets(weights, torch.float32, WEIGHT_BUCKET_BYTES).send(group, None)
                return
            expect = dict(zip(names, weights, strict=True))
            got = 0
            for bucket in wg.receive_buckets(group, names, shapes, torch.float32, WEIGHT_BUCKET_BYTES):
                for name, tensor in bucket:
                    if not torch.equal(tensor, expect[name]):
                        raise RuntimeError(f"rank {rank}: {name} differs from what rank 0 sent")
                    got += 1
            if got != len(names):
                raise RuntimeError(f"rank {rank}: {got} of {len(names)} tensors")
            received.append(time.monotonic())
        except (RuntimeError, dist.DistError) as e:
            errors.append(str(e).splitlines()[0][:200])

    keep: list[Any] = []
    out.put("ready")
    go.wait()
    threads = [threading.Thread(target=join, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last = (max(stored) if stored else math.nan, max(done) if done else math.nan)
    out.put((last, errors, len(os.listdir("/proc/self/fd")), sent, received))
    time.sleep(2.0)  # keep the groups open until every process has reported


def mesh(size: int, lazy: bool) -> dict[str, Any]:
    """Form one gloo group of `size` ranks (every pair connected, or `lazy`: the broadcast tree's pairs)."""
    from protocol import weights as wg

    limit = os.sysconf("SC_OPEN_MAX")
    per_proc = math.ceil(size / MESH_PROCS)
    links = size - 1 if lazy else size * (size - 1) // 2  # a binomial tree has size - 1 edges
    need = per_proc * (2 * math.ceil(math.log2(size)) + 4 if lazy else size - 1)
    row: dict[str, Any] = {"size": size, "how": "lazy" if lazy else "every pair", "connections": links, "fds": need}
    if need > limit * 0.9:
        row["result"] = f"not tried: {need:,} fds per process > the limit {limit:,}"
        return row
    spawn = mp.get_context("spawn")
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=MESH_TIMEOUT_S)
    go, out = spawn.Event(), spawn.Queue()
    ranks, nprocs = list(range(size)), min(MESH_PROCS, size)
    procs = [spawn.Process(target=_mesh_ranks, args=(store.port, ranks[i::nprocs], size, lazy, go, out)) for i in range(nprocs)]
    for p in procs:
        p.start()
    for _ in procs:
        assert _get(out, procs, MESH_TIMEOUT_S) == "ready"
    t0 = time.monotonic()
    go.set()
    results = [_get(out, procs, MESH_TIMEOUT_S + 30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errors = [e for r in results for e in r[1]]
    if not errors:
        row["stores_s"] = max(r[0][0] for r in results) - t0
        row["seconds"] = max(r[0][1] for r in results) - t0
        sent = [t for r in results for t in r[3]]
        received = [t for r in results for t in r[4]]
        row["weights_s"] = max(received) - sent[0]
        row["exact"] = len(received)
    row["fds_seen"] = max(r[2] for r in results)
    row["result"] = f"failed: {len(errors)} ranks, {errors[0]}" if errors else "formed"
    return row


# ---- the tables --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actors", default="10,100,300,1000", help="fleet sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=60.0, help="the steady phase per fleet size")
    ap.add_argument("--hang-s", type=float, default=15.0, help="how long the tenth hangs")
    ap.add_argument("--mesh", default="2,10,50,100,300,1000", help="weight-group sizes to form (gloo); empty: none")
    ap.add_argument("overrides", nargs="*", help="the hub's config overrides, section.field=value (e.g. hub.silent_s=30)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.actors.split(",") if x]
    rows = [run_scale(n, args.seconds, args.hang_s, args.overrides) for n in sizes]
    meshes = [mesh(int(x), lazy) for x in args.mesh.split(",") if x for lazy in (False, True)]
    extra = "".join(f" {o}" for o in args.overrides)
    cmd = f"python -m bench.hub_scale --actors {args.actors} --seconds {args.seconds:g} --hang-s {args.hang_s:g} --mesh {args.mesh}{extra}"
    print(f"\n`{cmd}`; {machine()}; {datetime.date.today().isoformat()}.\n")
    print(
        f"Steady phase ({args.seconds:g} s; demo pace: {PROMPTS_PER_STEP} prompts x {SAMPLES} samples per update, "
        f"{TRAIN_S} s per update, k = 1, {CAPACITY} prompts per actor):\n"
    )
    print(
        "| actors | grant latency p50 / p99 ms (grants) | groups/s | hub thread CPU | hub memory per actor | actors granted "
        "| grants per actor min-max |"
    )
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        print(
            f"| {r['n']:,} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} ({r['latencies']:,}) | {r['groups_s']:.1f} | {r['cpu']:.1%} "
            f"| {r['kib_per_actor']:.0f} KiB | {r['granted']:,} of {r['n']:,} | {r['min_grants']}-{r['max_grants']} |"
        )
    print(f"\nFaults (a tenth hung for {args.hang_s:g} s; then up to 100 killed at once):\n")
    print(
        "| actors | hung (leases held) | their leases back in the queue | longest training pause | killed (leases held) "
        "| all removed, leases requeued | ledger exact | prompts trained |"
    )
    print("|--:|--:|--:|--:|--:|--:|:-:|--:|")
    for r in rows:
        freed = f"{r['freed_s']:.1f} s" if not math.isnan(r["freed_s"]) else f"not in {args.hang_s:g} s"
        print(
            f"| {r['n']:,} | {r['hung']} ({r['hung_leases']}) | {freed} | {r['pause_s']:.1f} s | {r['killed']} ({r['killed_leases']}) "
            f"| {r['requeue_s'] * 1e3:.0f} ms | {'yes' if r['exact'] else 'NO'} | {r['trained']:,} |"
        )
    if meshes:
        print(f"\nWeight-group formation, gloo (ranks in {MESH_PROCS} processes, threads in each):\n")
        mib = WEIGHT_TENSORS * math.prod(WEIGHT_SHAPE) * 4 / 2**20
        print(
            "| ranks | connects | connections | fds per process (seen) | store clients in | formed in "
            f"| {mib:g} MiB of weights to every rank ({WEIGHT_BUCKET_BYTES >> 20} MiB buckets) | ranks holding them exactly | result |"
        )
        print("|--:|---|--:|--:|--:|--:|--:|--:|---|")
        for r in meshes:
            secs = f"{r['seconds']:.1f} s" if "seconds" in r else "-"
            stores = f"{r['stores_s']:.1f} s" if "stores_s" in r else "-"
            weights = f"{r['weights_s']:.1f} s" if "weights_s" in r else "-"
            exact = f"{r['exact']:,} of {r['size'] - 1:,}" if "exact" in r else "-"
            seen = f" ({r['fds_seen']:,})" if "fds_seen" in r else ""
            print(
                f"| {r['size']:,} | {r['how']} | {r['connections']:,} | {r['fds']:,}{seen} | {stores} | {secs} | {weights} | {exact} "
                f"| {r['result']} |"
            )


if __name__ == "__main__":
    main()
