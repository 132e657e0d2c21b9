"""One side of one bench.learner_gpu case, in a process of its own; writes its figures as JSON.

A process per side: each starts with an empty GPU, so its peak memory is its own, what DeepSpeed
leaves behind cannot slow the next side, and an out-of-memory is one cell of the table, not the
end of the run.

    python -m bench.learner_gpu_sides --side fleetrl|plain --case NAME --device cuda|cpu --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.learner_gpu_cases import CASES, Case, Update, build_model, case_config, positions, update_data


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median wall time of `reps` calls after one untimed call (first-touch allocations, plan caches)."""
    times = []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i > 0:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_updates(step: Callable[[Update], float], updates: list[Update], warmup: int, device: torch.device) -> dict:
    """The median update after `warmup`, ranked by positions/s (lengths differ per update, so a median of seconds
    and one of rates could come from different updates): its seconds and its rate. Also the first update's loss:
    both sides start from the same weights and data, so it shows they do the same work."""
    if device.type == "cuda":  # from what the model and optimizer hold: not the transients of building them
        torch.cuda.reset_peak_memory_stats(device)
    timed, losses = [], []
    for i, update in enumerate(updates):
        _sync(device)
        t0 = time.perf_counter()
        losses.append(step(update))
        _sync(device)
        dt = time.perf_counter() - t0
        if i >= warmup:
            timed.append((positions(update.samples) / dt, dt))
    rate, seconds = statistics.median_low(timed)
    out = {"s_per_update": seconds, "tokens_per_s": rate, "first_loss": losses[0]}
    if device.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def weight_rates(source, bucket_mb: int, reps: int, device: torch.device) -> dict:
    """GB/s of the two copies that feed the weight group, and of its broadcast with world size 1.
    `source`: the learner's WeightSource (learner/weights/source.py) over the trained engine."""
    from learner.weights.buckets import Buckets
    from protocol import weights as wg

    dtype = source.dtype
    nbytes = sum(wg.bucket_numels(source.shapes, source.buckets)) * dtype.itemsize
    snapshot_s = _median_s(source.take, reps, device)
    flats = source.take()
    assert flats is not None
    sender = Buckets(list(source.params), dtype, bucket_mb << 20)
    bucket_s = _median_s(sender.snapshot, reps, device)
    # The learner alone in its group: the backend and device as protocol/weights.py picks them for any epoch.
    plan = wg.plan_group(wg.device_identity(device), [])
    on = wg.group_device(plan.backend, device)
    assert all(f.device == on for f in flats), f"snapshot on {flats[0].device}, the {plan.backend} group sends from {on}"
    store = wg.open_store("127.0.0.1", 0, is_master=True, timeout_s=120)
    group = wg.open_group(store, "127.0.0.1", 1, 0, plan.world_size, 120, plan.backend, on)
    broadcast_s = _median_s(lambda: [wg.broadcast(group, f) for f in flats], reps, device)
    return {
        "weight_gb": nbytes / 1e9,
        "snapshot_gbps": nbytes / 1e9 / snapshot_s,
        "snapshot_on": flats[0].device.type,
        "bucket_gbps": nbytes / 1e9 / bucket_s,
        "broadcast_gbps": nbytes / 1e9 / broadcast_s,
        "backend": plan.backend,
    }


def run_fleetrl(case: Case, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    from learner.plan import make_plan
    from learner.train.distributed import init_distributed, make_topology
    from learner.train.engines import UpdateLayout
    from learner.train.trainer import Trainer
    from learner.weights.source import WeightSource

    cfg = case_config(case, str(dtype).removeprefix("torch."))
    init_distributed()
    topo = make_topology(1)
    model = build_model(case, topo.device, dtype)
    params = sum(p.numel() for p in model.parameters())
    trainer = Trainer(cfg, model, topo, UpdateLayout.of(make_plan(cfg, num_prompts=case.samples // case.group)))

    def step(update: Update) -> float:
        stats = trainer.update(update.share)
        assert stats.samples == case.samples and stats.tokens > 0, stats
        return stats.loss

    out = timed_updates(step, update_data(cfg, case, args.warmup + args.updates), args.warmup, device)
    source = WeightSource(cfg, trainer.engine, topo)
    return {**out, "params": params, **weight_rates(source, cfg.weights.bucket_mb, args.weight_reps, device)}


def run_plain(case: Case, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> dict:
    from bench.plain_loop import PlainLoop

    cfg = case_config(case, str(dtype).removeprefix("torch."))
    model = build_model(case, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    loop = PlainLoop(
        model,
        lr=cfg.train.lr,
        grad_clip=cfg.train.grad_clip,
        clip=(cfg.algo.clip_low, cfg.algo.clip_high),
        rows=case.plain_rows,
        checkpointing=case.checkpointing,
    )
    out = timed_updates(lambda u: loop.update(u.samples), update_data(cfg, case, args.warmup + args.updates), args.warmup, device)
    return {**out, "params": params}


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=("fleetrl", "plain"), required=True)
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--updates", type=int, required=True)
    ap.add_argument("--weight-reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["DS_ACCELERATOR"] = args.device  # before DeepSpeed is imported: it picks its accelerator once
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    # bf16 on the GPU, as the targets are stated; float32 on the CPU, where the two loops' first losses must
    # agree to float32 rounding (tests/integration/test_bench_learner_gpu.py checks that they do the same work).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":  # one intra-op thread, the learner's default (train.threads): on shared cores a
        torch.set_num_threads(1)  # descheduled OpenMP worker stalls every op of a tiny model
    run = run_fleetrl if args.side == "fleetrl" else run_plain
    try:
        result = run(CASES[args.case], device, dtype, args)
    except torch.cuda.OutOfMemoryError as e:  # a result for the table: this setting does not fit the GPU
        result = {"error": "out of memory", "detail": str(e).splitlines()[0][:300]}
    Path(args.out).write_text(json.dumps({**result, "machine": machine(device)}))


if __name__ == "__main__":
    main()
