"""Samples per second of asynchronous (k = 1) vs synchronous (k = 0) training on the demo settings.

Runs the real demo (2 actors + learner, vLLM CPU engines) twice, once per bound,
and compares steady-state throughput: samples trained after the first `--skip`
steps (engine start and warm-up excluded) over the wall time they took.

By default the learner runs on CPU 0 and the actors on CPU 1, as training and
inference run on separate GPUs in a real deployment. Sharing every core instead
(`--shared`) measures contention, not asynchrony: on 2 cores both phases are
CPU-bound, and overlapping them only slows each down.

    python -m bench.async_vs_sync [--steps 40] [--skip 5] [--shared] [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from protocol.net import free_port


def run(k: int, steps: int, extra: list[str], root: Path) -> dict[str, float]:
    run_dir = root / f"k{k}"
    cmd = [sys.executable, "-m", "deploy.cli", "demo", f"run.dir={run_dir}", f"staleness.max_staleness={k}",
           f"train.total_steps={steps}", f"hub.bind=tcp://127.0.0.1:{free_port()}", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    total = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--shared", action="store_true", help="do not pin learner and actors to separate CPUs")
    args, extra = ap.parse_known_args()
    if not args.shared:
        extra = ["train.cpu_affinity=0", "actor.cpu_affinity=1", *extra]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (0, 1):
            r = run(k, args.steps, extra, Path(tmp))
            rows = r["rows"]
            base = rows[args.skip - 1]
            samples = sum(x["samples"] for x in rows[args.skip :])
            elapsed = rows[-1]["wall_s"] - base["wall_s"]
            results[k] = {
                "samples_per_s": samples / elapsed, "step_s": elapsed / (len(rows) - args.skip), "total_s": r["total_s"],
                "wait_s": sum(x["time/wait"] for x in rows[args.skip :]) / (len(rows) - args.skip),
                "reward_last": sum(x["reward_mean"] for x in rows[-5:]) / 5,
                "dropped": rows[-1].get("hub/dropped_stale", 0.0),
                "train_s": sum(x["time/train"] for x in rows[args.skip :]) / (len(rows) - args.skip),
                "sync_s": sum(x["time/weight_sync"] for x in rows[args.skip :]) / (len(rows) - args.skip),
            }
    print(f"\n{'max_staleness':>14}{'samples/s':>11}{'s/step':>9}{'wait s/step':>13}{'train s/step':>14}{'sync s/step':>13}{'dropped stale':>15}{'reward (last 5)':>17}{'run wall s':>12}")
    for k, r in results.items():
        print(f"{k:>14}{r['samples_per_s']:>11.1f}{r['step_s']:>9.3f}{r['wait_s']:>13.3f}{r['train_s']:>14.3f}{r['sync_s']:>13.3f}{r['dropped']:>15.0f}{r['reward_last']:>17.3f}{r['total_s']:>12.1f}")
    print(f"\nasync / sync samples per second: {results[1]['samples_per_s'] / results[0]['samples_per_s']:.2f}x (target >= 1.6x; 2x is the limit when generation and training take equal time)")


if __name__ == "__main__":
    main()
