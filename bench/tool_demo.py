"""The tool demo learning to use its calculator: `fleetrl demo --config configs/demo_tools.toml`, measured.

    python -m bench.tool_demo [--runs 1] [section.field=value ...]

One table row per run: wall time (the warm start is built once and cached, timed apart when this run built it),
mean reward of the first and the last fifth of the updates and the rise, the share of episodes that call the
tool and model turns per episode (first and last fifth), seconds in the environment per turn. The target: the
reward rises by at least 0.3 within 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fifths(rows: list[dict], key: str) -> tuple[float, float]:
    n = max(1, len(rows) // 5)
    return sum(r[key] for r in rows[:n]) / n, sum(r[key] for r in rows[-n:]) / n


def one_run(overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "deploy.cli", "demo", "--config", "configs/demo_tools.toml", f"run.dir={run_dir}", *overrides]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"bench.tool_demo: the demo exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        launcher = [json.loads(x) for x in (run_dir / "logs" / "launcher.jsonl").read_text().splitlines()]
    built = [e.get("seconds", 0.0) for e in launcher if e.get("event") == "demo.model_ready"]
    r0, r1 = fifths(rows, "reward_mean")
    u0, u1 = fifths(rows, "env/tool_use_share")
    t0_, t1_ = fifths(rows, "env/turns_mean")
    return {
        "updates": len(rows),
        "wall_s": wall - sum(built),
        "warm_start_s": sum(built),
        "train_s": rows[-1]["wall_s"],
        "reward_first": r0,
        "reward_last": r1,
        "rise": r1 - r0,
        "tool_use_first": u0,
        "tool_use_last": u1,
        "turns_first": t0_,
        "turns_last": t1_,
        "env_step_ms": 1000 * sum(r["env/step_s"] for r in rows) / len(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="section.field=value for the demo's config")
    args = ap.parse_args()
    print(
        "| run | updates | wall s (warm start s) | train s | reward first fifth | last fifth | rise "
        "| tool use first | last | turns first | last | env ms/turn |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i in range(args.runs):
        r = one_run(args.overrides)
        print(
            f"| {i + 1} | {r['updates']} | {r['wall_s']:.0f} ({r['warm_start_s']:.0f}) | {r['train_s']:.0f} | {r['reward_first']:.3f} | "
            f"{r['reward_last']:.3f} | {r['rise']:+.3f} | {r['tool_use_first']:.2f} | {r['tool_use_last']:.2f} | "
            f"{r['turns_first']:.2f} | {r['turns_last']:.2f} | {r['env_step_ms']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
