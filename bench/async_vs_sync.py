"""Samples per second of asynchronous (k = 1) vs synchronous (k = 0) training on the demo settings.

Runs the real demo (2 actors + learner, vLLM CPU engines) twice, once per bound,
and compares steady-state throughput: samples trained after the first `--skip`
steps (engine start and warm-up excluded) over the wall time they took.

By default the learner runs on CPU 0 and the actors on CPU 1, as training and
inference run on separate GPUs in a real deployment. Sharing every core instead
(`--shared`) measures contention, not asynchrony: on 2 cores both phases are
CPU-bound, and overlapping them only slows each down.

The two runs of a pair go one after the other, and the pairs alternate (k0 k1 k0 k1 ...), so a
machine that slows down for a minute moves one pair, not the median.

    python -m bench.async_vs_sync [--steps 40] [--skip 5] [--repeats 3] [--shared] [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from protocol.net import free_port


def run(k: int, steps: int, extra: list[str], root: Path) -> dict:
    run_dir = root / f"k{k}"
    cmd = [
        sys.executable,
        "-m",
        "deploy.cli",
        "demo",
        f"run.dir={run_dir}",
        f"staleness.max_staleness={k}",
        f"train.total_steps={steps}",
        f"hub.bind=tcp://127.0.0.1:{free_port()}",
        *extra,
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    total = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "total_s": total}


def summarize(rows: list[dict], skip: int, total_s: float) -> dict[str, float]:
    base = rows[skip - 1]
    steady = rows[skip:]
    elapsed = rows[-1]["wall_s"] - base["wall_s"]
    return {
        "samples_per_s": sum(x["samples"] for x in steady) / elapsed,
        "step_s": elapsed / len(steady),
        "total_s": total_s,
        "wait_s": sum(x["time/wait"] for x in steady) / len(steady),
        "reward_last": sum(x["reward_mean"] for x in rows[-5:]) / 5,
        "dropped": rows[-1].get("hub/dropped_stale", 0.0),
        "train_s": sum(x["time/train"] for x in steady) / len(steady),
        "sync_s": sum(x["time/weight_sync"] for x in steady) / len(steady),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="k = 0 / k = 1 pairs, run alternately; the ratio reported is their median")
    ap.add_argument("--shared", action="store_true", help="do not pin learner and actors to separate CPUs")
    args, extra = ap.parse_known_args()
    if args.repeats < 1 or not 1 <= args.skip < args.steps:
        ap.error(f"need --repeats >= 1 and 1 <= --skip < --steps (got {args.repeats}, {args.skip}, {args.steps})")
    if not args.shared:
        extra = ["train.cpu_affinity=0", "actor.cpu_affinity=1", *extra]
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            pair, root = {}, Path(tmp) / str(i)
            root.mkdir()
            for k in (0, 1):
                r = run(k, args.steps, extra, root)
                pair[k] = summarize(r["rows"], args.skip, r["total_s"])
            pairs.append(pair)
    print(
        f"\n{'pair':>5}{'max_staleness':>14}{'samples/s':>11}{'s/step':>9}{'wait s/step':>13}{'train s/step':>14}{'sync s/step':>13}"
        f"{'dropped stale':>15}{'reward (last 5)':>17}{'run wall s':>12}{'async / sync':>14}"
    )
    ratios = []
    for i, pair in enumerate(pairs):
        ratios.append(pair[1]["samples_per_s"] / pair[0]["samples_per_s"])
        for k, r in pair.items():
            ratio = f"{ratios[-1]:.2f}x" if k == 1 else ""
            print(
                f"{i:>5}{k:>14}{r['samples_per_s']:>11.1f}{r['step_s']:>9.3f}{r['wait_s']:>13.3f}{r['train_s']:>14.3f}{r['sync_s']:>13.3f}"
                f"{r['dropped']:>15.0f}{r['reward_last']:>17.3f}{r['total_s']:>12.1f}{ratio:>14}"
            )
    print(
        f"\nasync / sync samples per second: median {statistics.median(ratios):.2f}x of {len(ratios)} pairs "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}; target >= 1.6x; 2x is the limit when generation and training take equal time)"
    )


if __name__ == "__main__":
    main()
