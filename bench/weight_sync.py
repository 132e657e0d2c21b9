"""Weight sync time vs a raw collective broadcast of the same bytes, one run.

Gloo over TCP loopback, the same process group and receivers for every column; the
learner's parameters are laid out as DeepSpeed ZeRO-1/2 keeps them, views into one
flat buffer (`--separate`: one tensor each, as a plain model or ZeRO-3 has them).
Every column is timed on rank 0 from a barrier-like broadcast before to one after, so
it ends when every receiver holds the bytes.

  raw        one broadcast of one preallocated flat tensor of the same total size,
             into one preallocated flat tensor on each receiver.
  guarded    what the learner's sync does after `WeightSender.guard(optimizer)`:
             `Buckets.send` broadcasts each bucket straight from the parameters' memory
             (a copy per bucket only where they are not back to back), IN_FLIGHT at a
             time as the serving thread does (protocol/abortable.py). Receivers do what
             the vLLM worker does before `load_weights`: receive each bucket into one
             reused landing buffer and split it into named views (`receive_buckets`).
  snapshot   the unguarded sync: `Buckets.snapshot()` on the learner thread (one memcpy
             per bucket, reused buffers), then the same broadcasts and receivers.
  held       how long the learner thread is held by the sync: ~0 when guarded (the
             optimizer's next step waits instead, if the broadcast is still running),
             the snapshot copy when not.
  ratio      raw s / column s, per trial; the table shows the median over --trials and
             the spread (min-max). Target >= 0.9.

    python -m bench.weight_sync [--mb 64] [--tensors 96] [--bucket-mb 32] [--trials 9] [--separate]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
import torch.distributed as dist

from learner.weights.buckets import Buckets
from protocol import weights as wg
from protocol.abortable import Abortable, Graveyard
from protocol.net import free_port

MODES = ("raw", "guarded", "snapshot")


def shapes_for(total_mb: int, tensors: int) -> list[list[int]]:
    per = total_mb * (1 << 20) // 4 // tensors
    return [[per // 256, 256] for _ in range(tensors)]


def learner_params(shapes: list[list[int]], separate: bool) -> list[torch.Tensor]:
    if separate:
        return [torch.randn(s) for s in shapes]
    flat = torch.randn(sum(s[0] * s[1] for s in shapes))  # ZeRO-1/2: every parameter a view of one buffer
    out, offset = [], 0
    for s in shapes:
        out.append(flat[offset : offset + s[0] * s[1]].view(s))
        offset += s[0] * s[1]
    return out


def _run(rank: int, world: int, port: int, shapes, bucket_mb: int, trials: int, separate: bool, out) -> None:
    store = wg.open_store("127.0.0.1", port, is_master=rank == 0, timeout_s=120)
    group = wg.open_group(store, "127.0.0.1", 1, rank, world, 120)
    names = [f"p{i}" for i in range(len(shapes))]
    total = sum(s[0] * s[1] for s in shapes)
    bucket_bytes = bucket_mb << 20
    flat = torch.zeros(total)
    buckets = Buckets(learner_params(shapes, separate), torch.float32, bucket_bytes) if rank == 0 else None
    landing = torch.empty(wg.landing_numel(shapes, torch.float32, bucket_bytes))  # reused, as the vLLM worker does
    line_up = torch.zeros(1)
    waits = Abortable(should_abort=lambda: None, timeout_s=120, graveyard=Graveyard())
    times: dict[str, list[float]] = {mode: [] for mode in (*MODES, "held")}
    for trial in range(trials + 1):  # trial 0 warms up: first-touch page faults of the reused buffers
        for mode in MODES:
            wg.broadcast(group, line_up)
            t0 = time.perf_counter()
            if mode == "raw":
                wg.broadcast(group, flat)
            elif buckets is not None:
                snapshot = buckets.snapshot() if mode == "snapshot" else None
                if mode == "snapshot" and trial > 0:
                    times["held"].append(time.perf_counter() - t0)
                with waits.pipeline() as pipe:

                    def send(g: dist.ProcessGroup, bucket: torch.Tensor) -> None:
                        pipe.room()
                        pipe.start(g, bucket)

                    buckets.send(group, snapshot, bcast=send)
            else:
                for pairs in wg.receive_buckets(group, names, shapes, torch.float32, bucket_bytes, landing):
                    assert len(pairs) > 0
            wg.broadcast(group, line_up)  # everyone has it
            if trial > 0:
                times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)


def measure(receivers: int, shapes, bucket_mb: int, trials: int, separate: bool) -> dict[str, list[float]]:
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, receivers + 1, port, shapes, bucket_mb, trials, separate, q)) for r in range(receivers + 1)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="total parameter MiB")
    ap.add_argument("--tensors", type=int, default=96)
    ap.add_argument("--bucket-mb", type=int, default=32, help="weights.bucket_mb")
    ap.add_argument("--trials", type=int, default=9, help="interleaved trials per column (after one warm-up)")
    ap.add_argument("--separate", action="store_true", help="parameters as separate tensors, not views of one flat buffer")
    args = ap.parse_args()
    shapes = shapes_for(args.mb, args.tensors)
    layout = "separate tensors" if args.separate else "views of one flat buffer (ZeRO-1/2)"
    print(
        f"\n{args.mb} MiB in {args.tensors} fp32 tensors ({layout}), {args.bucket_mb} MiB buckets, gloo on loopback, "
        f"median of {args.trials} trials [min-max]"
    )
    print(f"{'receivers':>9}{'raw s':>8}{'guarded s':>11}{'ratio':>16}{'snapshot s':>12}{'held s':>8}{'ratio':>16}")
    for receivers in (1, 2):
        t = measure(receivers, shapes, args.bucket_mb, args.trials, args.separate)
        cells = []
        for mode in ("guarded", "snapshot"):
            ratios = [r / x for r, x in zip(t["raw"], t[mode], strict=True)]
            spread = f"[{min(ratios):.2f}-{max(ratios):.2f}]"
            cells.append(
                f"{statistics.median(t[mode]):>{11 if mode == 'guarded' else 12}.3f}"
                + (f"{statistics.median(t['held']):>8.3f}" if mode == "snapshot" else "")
                + f"{statistics.median(ratios):>6.2f} {spread:>9}"
            )
        print(f"{receivers:>9}{statistics.median(t['raw']):>8.3f}{cells[0]}{cells[1]}")
    print("\nratio = raw s / FleetRL s, per trial (higher is better); target >= 0.9. See --help for what each column includes.")


if __name__ == "__main__":
    main()
