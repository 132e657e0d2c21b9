"""Samples per second of asynchronous (k = 1) vs synchronous (k = 0) training on the demo settings.

Runs the real demo (2 actors + learner, vLLM CPU engines) twice, once per bound,
and compares steady-state throughput: samples trained after the first `--skip`
steps (engine start and warm-up excluded) over the wall time they took.

    python -m bench.async_vs_sync [--steps 40] [--skip 5] [ARGS...]
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
    args, extra = ap.parse_known_args()
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
            }
    print(f"\n{'max_staleness':>14}{'samples/s':>11}{'s/step':>9}{'learner wait s/step':>21}{'dropped stale':>15}{'reward (last 5)':>17}{'run wall s':>12}")
    for k, r in results.items():
        print(f"{k:>14}{r['samples_per_s']:>11.1f}{r['step_s']:>9.3f}{r['wait_s']:>21.3f}{r['dropped']:>15.0f}{r['reward_last']:>17.3f}{r['total_s']:>12.1f}")
    print(f"\nasync / sync samples per second: {results[1]['samples_per_s'] / results[0]['samples_per_s']:.2f}x (target >= 1.6x; 2x is the limit when generation and training take equal time)")


if __name__ == "__main__":
    main()
