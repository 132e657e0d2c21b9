"""Weight sync time vs a raw collective broadcast of the same bytes, one run.

FleetRL: rank 0 flattens parameters into buckets (`flatten_buckets`, the
snapshot the learner takes before each sync) and broadcasts each; each receiver
allocates, receives and splits them into named views (`receive_buckets`), the path
the vLLM worker runs before `load_weights`. Raw: one broadcast of one
preallocated flat tensor of the same size. Gloo over TCP loopback, 1 and 2 receivers.

    python -m bench.weight_sync [--mb 64] [--tensors 96] [--trials 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from protocol import weights as wg
from protocol.net import free_port


def shapes_for(total_mb: int, tensors: int) -> list[list[int]]:
    per = total_mb * (1 << 20) // 4 // tensors
    return [[per // 256, 256] for _ in range(tensors)]


def _run(rank: int, world: int, port: int, shapes, bucket_mb: int, trials: int, out):
    store = wg.open_store("127.0.0.1", port, is_master=rank == 0, timeout_s=120)
    group = wg.open_group(store, "127.0.0.1", 1, rank, world, 120)
    names = [f"p{i}" for i in range(len(shapes))]
    total = sum(s[0] * s[1] for s in shapes)
    params = [torch.randn(s) for s in shapes] if rank == 0 else None
    flat = torch.zeros(total)
    buckets = wg.plan_buckets(shapes, 4, bucket_mb << 20)
    sync = torch.zeros(1)
    times = {"raw": [], "fleetrl": [], "snapshot": []}
    flats, landing = None, None  # reused across syncs, as the learner and the vLLM worker do
    for _ in range(trials):
        for mode in ("raw", "fleetrl"):
            wg.broadcast(group, sync)  # line everyone up
            t0 = time.perf_counter()
            if mode == "raw":
                wg.broadcast(group, flat)
            elif rank == 0:
                flats = wg.flatten_buckets(params, buckets, torch.float32, flats)
                times["snapshot"].append(time.perf_counter() - t0)
                for bucket in flats:
                    wg.broadcast(group, bucket)
            else:
                if landing is None:
                    landing = torch.empty(wg.landing_numel(shapes, torch.float32, bucket_mb << 20))
                for pairs in wg.receive_buckets(group, names, shapes, torch.float32, bucket_mb << 20, landing):
                    assert len(pairs) > 0
            wg.broadcast(group, sync)  # everyone has it
            times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({k: statistics.median(v) for k, v in times.items()})


def measure(receivers: int, shapes, bucket_mb: int, trials: int) -> dict[str, float]:
    port = free_port()
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_run, args=(r, receivers + 1, port, shapes, bucket_mb, trials, q)) for r in range(receivers + 1)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--tensors", type=int, default=96)
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    shapes = shapes_for(args.mb, args.tensors)
    print(f"\n{args.mb} MiB in {args.tensors} fp32 tensors, {args.bucket_mb} MiB buckets, gloo on loopback, median of {args.trials}")
    print(f"{'receivers':>10}{'raw s':>10}{'fleetrl s':>12}{'of which snapshot s':>21}{'raw GiB/s':>12}{'fleetrl GiB/s':>15}{'ratio':>8}{'ratio w/o snapshot':>20}")
    for receivers in (1, 2):
        r = measure(receivers, shapes, args.bucket_mb, args.trials)
        gib = args.mb / 1024
        wire = r["fleetrl"] - r["snapshot"]
        print(f"{receivers:>10}{r['raw']:>10.3f}{r['fleetrl']:>12.3f}{r['snapshot']:>21.3f}{gib / r['raw']:>12.2f}{gib / r['fleetrl']:>15.2f}"
              f"{r['raw'] / r['fleetrl']:>8.2f}{r['raw'] / wire:>20.2f}")
    print("\nratio = raw broadcast time / FleetRL bucketed sync time (higher is better); target >= 0.9")
    print("snapshot = the learner's flattening copy into buckets (it runs on the learner thread; the transfer runs in the background)")


if __name__ == "__main__":
    main()
