"""FleetRL's learner on one GPU against a plain PyTorch loop doing the same work, one run, one table.

Qwen2.5-shaped random models (bench/learner_gpu_cases.py: shapes, the per-case settings and why
they fit 80 GB), synthetic GRPO groups (bench/synthetic.py), one optimizer step per update.
Each side of each case runs in a process of its own (bench/learner_gpu_sides.py):

  FleetRL   learner.train.trainer.Trainer: DeepSpeed ZeRO-2 on one rank, packed rows, the case's
            token budget per micro-batch, chunked logprobs, gradient checkpointing where the
            case says; then the weight path: WeightSource.snapshot, the WeightSender's bucket copy
            (learner/weights/buckets.py), and a broadcast through a weight group of world size 1.
  plain     bench/plain_loop.py: the same samples in rollout order, right-padded, transformers'
            SDPA, full logits -> log-softmax -> the same clipped PPO loss, AdamW (fused on CUDA).

tokens/s counts prompt + completion positions per second of update (padding not counted);
MFU = 6 x params x tokens/s / peak. Figures of the median of --updates timed updates, after --warmup.

    python -m bench.learner_gpu [--cases 1.5B-short,0.5B-short,0.5B-long] [--updates 5] [--warmup 2]
                                [--peak-tflops 989] [--timeout 110] [--budget 250]
    python -m bench.learner_gpu --smoke      # tiny model on the CPU: every code path, in seconds
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.learner_gpu_cases import CASES, GPU_CASES, Case
from deploy.procs import path_with, run_capped

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"fleetrl": "FleetRL", "plain": "plain PyTorch"}


def run_side(side: str, case: Case, args: argparse.Namespace, tmp: Path, limit_s: float) -> dict:
    """One side in a process of its own, killed after `limit_s` (its --timeout, or what is left of --budget)."""
    out = tmp / f"{case.name}-{side}.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.learner_gpu_sides",
        "--side",
        side,
        "--case",
        case.name,
        "--device",
        args.device,
        "--warmup",
        str(args.warmup),
        "--updates",
        str(args.updates),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": path_with(ROOT)}
    if limit_s <= 0:
        return {"error": f"not run: --budget {args.budget:g} s spent", "failed": True}
    ran = run_capped(cmd, limit_s, env=env, cwd=ROOT)
    if ran.returncode is None:
        if ran.stderr.strip():
            sys.stderr.write(f"\n{case.name} {side} ran out of time; the end of its stderr:\n{ran.stderr[-4000:]}\n")
        bound = f"--timeout {args.timeout:g} s" if limit_s >= args.timeout else f"what was left of --budget {args.budget:g} s"
        return {"error": f"out of time: no result within {limit_s:.1f} s", "detail": f"({bound})", "failed": True}
    if ran.returncode != 0 or not out.exists():
        sys.stderr.write(f"\n{case.name} {side} failed (exit {ran.returncode}):\n{ran.stderr[-4000:]}\n")
        return {"error": f"failed (exit {ran.returncode})", "failed": True}
    return json.loads(out.read_text())


def _num(r: dict, key: str, fmt: str) -> str:
    return format(r[key], fmt) if key in r else "-"


def speed_table(cases: list[Case], results: dict, peak: float) -> list[str]:
    lines = [
        "| case | loop | s/update | tokens/s | MFU | peak GiB | FleetRL / plain | loss, update 1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        fleet, plain = results[case.name, "fleetrl"], results[case.name, "plain"]
        ratio = f"{fleet['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if "error" not in fleet and "error" not in plain else "-"
        for side, r in (("fleetrl", fleet), ("plain", plain)):
            if "error" in r:
                lines.append(f"| {case.name} | {SIDES[side]} | {r['error']} | | | | | |")
                continue
            mfu = 6 * r["params"] * r["tokens_per_s"] / peak
            lines.append(
                f"| {case.name} | {SIDES[side]} | {r['s_per_update']:.3f} | {r['tokens_per_s']:,.0f} | {mfu:.1%} | "
                f"{_num(r, 'peak_gib', '.1f')} | {ratio if side == 'fleetrl' else ''} | {r['first_loss']:.6f} |"
            )
    return lines


def weight_table(cases: list[Case], results: dict) -> list[str]:
    lines = [
        "| case | params | weights GB | snapshot GB/s | snapshot device | bucket copy GB/s | broadcast GB/s | backend |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for case in cases:
        r = results[case.name, "fleetrl"]
        if "error" in r:
            lines.append(f"| {case.name} | {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {case.name} | {r['params'] / 1e6:,.1f}M | {r['weight_gb']:.3f} | {r['snapshot_gbps']:,.1f} | "
            f"{r['snapshot_on']} | {r['bucket_gbps']:,.1f} | {r['broadcast_gbps']:,.1f} | {r['backend']} |"
        )
    return lines


def settings(case: Case) -> str:
    ckpt = ", gradient checkpointing" if case.checkpointing else ""
    return (
        f"- {case.name}: {case.shape} shape, {case.tokens_text} per update; FleetRL up to {case.token_budget} tokens "
        f"per micro-batch; plain {case.plain_rows} padded rows per micro-batch{ckpt}"
    )


def parse_args() -> argparse.Namespace:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(CASES)} (default: {', '.join(GPU_CASES)})")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--updates", type=int, default=5, help="timed updates per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense peak for MFU (H100 SXM bf16: 989)")
    # Both bounds fit the GPU check's bench stage (../shared/gpu/check.sh caps it at 270 s) and a 10-minute run:
    # a hung side costs --timeout, and the table is still printed before the stage's cap kills the run.
    ap.add_argument("--timeout", type=float, default=110.0, help="seconds one side may take (it is killed then)")
    ap.add_argument("--budget", type=float, default=250.0, help="seconds all sides together may take; a side gets what is left")
    ap.add_argument("--smoke", action="store_true", help="the tiny case on the CPU, 1 warm-up + 2 timed updates")
    args = ap.parse_args()
    if args.smoke:
        args.cases, args.device, args.warmup, args.updates = args.cases or "tiny", "cpu", 1, 2
    args.cases = [c for c in (args.cases or ",".join(GPU_CASES)).split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown} (known: {', '.join(CASES)})")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --smoke or --device cpu)")
    if args.updates < 1 or args.warmup < 0 or args.peak_tflops <= 0 or args.timeout <= 0 or args.budget <= 0:
        ap.error("--updates must be >= 1, --warmup >= 0, --peak-tflops, --timeout and --budget > 0")
    return args


def main() -> None:
    args = parse_args()
    cases = [CASES[name] for name in args.cases]
    results: dict[tuple[str, str], dict] = {}
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            for side in SIDES:
                limit = min(args.timeout, deadline - time.monotonic())
                r = results[case.name, side] = run_side(side, case, args, Path(tmp), limit)
                done = (
                    f"{r['error']} {r.get('detail', '')}".strip()
                    if "error" in r
                    else f"{r['s_per_update']:.3f} s/update, {r['tokens_per_s']:,.0f} tokens/s"
                )
                print(f"{case.name} {SIDES[side]}: {done}", flush=True)
    import torch

    # The GPU's name comes from a side: asking here would hold a CUDA context on the GPU through the whole run.
    name = next((r["machine"] for r in results.values() if "machine" in r), f"{args.device} (no side finished)")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\ncommand: python -m bench.learner_gpu {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {name}, torch {torch.__version__}, {now}")
    print(
        f"MFU peak: {args.peak_tflops:g} TFLOP/s (--peak-tflops); MFU counts 6 x params per position, not the "
        "recompute of gradient checkpointing\n"
    )
    print("\n".join(speed_table(cases, results, args.peak_tflops * 1e12)))
    print(
        f"\n- tokens/s: prompt + completion positions per second of update, padding not counted. s/update and tokens/s "
        f"are the median update's (by tokens/s) of {args.updates} timed after {args.warmup} warm-up."
    )
    print("- peak GiB: torch.cuda.max_memory_allocated over the side's updates, model and optimizer state included.")
    print("- loss, update 1: both loops start from the same weights and samples, so it agrees to rounding (bf16 on GPUs).")
    print("\n".join(settings(c) for c in cases))
    print()
    print("\n".join(weight_table(cases, results)))
    print("\n- snapshot: WeightSource.snapshot, every weight copied into the weight-group buckets (the ZeRO-3 path).")
    print("- bucket copy: the WeightSender's copy from the parameters (learner/weights/buckets.py, the ZeRO-0/1/2 path).")
    print("- broadcast: every bucket through a weight group of world size 1. With one member nothing crosses a link:")
    print("  it measures the call path, not a link.")
    if any(r.get("failed") for r in results.values()):  # an out-of-memory is a result; a crash or a hang is not
        sys.exit(1)


if __name__ == "__main__":
    main()
