"""Learner tokens/s with DeepSpeed ZeRO-2 vs ZeRO-3 on 2 CPU processes, same model, same data, one run.

Each stage runs the real multi-rank path (torchrun, gloo): rank 0 advantages the groups and
scatters the shares, both ranks train (learner/train/trainer.py), then join the weight snapshot
that feeds the actors (a full gather under ZeRO-3). Synthetic rollout groups: completions of
32-128 tokens, random rewards. Tokens/s counts completion tokens trained per second of update
+ snapshot, after warm-up updates.

    python -m bench.learner_zero [--updates 5] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deploy.procs import path_with

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "train.prompts_per_step=8",
    "rollout.samples_per_prompt=8",
    "train.micro_batch_samples=8",
    "rollout.max_tokens=128",
    "actor.max_model_len=256",
    "cluster.learner_gpus_per_node=2",
    "staleness.max_staleness=0",
    "train.threads=1",
]


def rank_main(model_dir: str, out: str, warmup: int, updates: int, overrides: list[str]) -> None:
    from bench.synthetic import synthetic_groups
    from learner.plan import make_plan
    from learner.train.distributed import init_distributed, make_topology
    from learner.train.engines import UpdateLayout
    from learner.train.shard import make_shares, scatter_shares
    from learner.train.trainer import Trainer
    from learner.weights.source import WeightSource
    from protocol.config import load_config

    cfg = load_config(None, [f"model.path={model_dir}", *SETTINGS, *overrides])
    init_distributed()
    torch.set_num_threads(cfg.train.threads)
    topo = make_topology(1)
    from transformers import AutoModelForCausalLM

    plan = make_plan(cfg, num_prompts=100)
    layout = UpdateLayout.of(plan)
    trainer = Trainer(cfg, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), topo, layout)
    source = WeightSource(cfg, trainer.engine, topo)
    version, tokens, t0 = 0, 0, 0.0
    for update in range(warmup + updates):
        if update == warmup:
            torch.distributed.barrier()
            t0 = time.perf_counter()
        groups = synthetic_groups(
            groups=cfg.train.prompts_per_step,
            samples=cfg.rollout.samples_per_prompt,
            seed=update,
            version=version,
            prompt_len=32,
            completion=(32, 128),
            vocab=(3, 1000),
            behaviour_logp=-7.0,
        )
        shares = make_shares(cfg, groups, version, 0, topo.dp_size)[0] if topo.is_root else None
        stats = trainer.update(scatter_shares(topo, shares))
        source.take()
        version += 1
        if update >= warmup:
            tokens += stats.tokens
    elapsed = time.perf_counter() - t0
    if topo.is_root:
        Path(out).write_text(json.dumps({"tokens_per_s": tokens / elapsed, "s_per_update": elapsed / updates}))


def run_stage(model_dir: Path, label: str, overrides: list[str], args) -> dict:
    from protocol.net import free_port

    out = model_dir.parent / f"{label}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(Path(__file__).resolve()),
        "--rank",
        str(model_dir),
        str(out),
        str(args.warmup),
        str(args.updates),
        *overrides,
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": path_with(ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        model_dir, out, warmup, updates, *overrides = sys.argv[2:]
        rank_main(model_dir, out, int(warmup), int(updates), overrides)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from deploy.tiny import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model = build_model(vocab_size=1024, seed=0, hidden=args.hidden, layers=args.layers, heads=args.hidden // 64)
        model.save_pretrained(model_dir)
        params = sum(p.numel() for p in model.parameters())
        rows = [(label, run_stage(model_dir, label, overrides, args)) for label, overrides in STAGES]
    base = rows[0][1]["tokens_per_s"]
    print(f"\nlearner, 2 CPU processes (gloo), Qwen2-shaped {params / 1e6:.1f}M params, 64 samples x 32-128 tokens per update")
    print(f"{'setting':<26}{'tokens/s':>12}{'s/update':>12}{'vs ZeRO-2':>12}")
    for label, r in rows:
        print(f"{label:<26}{r['tokens_per_s']:>12,.0f}{r['s_per_update']:>12.2f}{r['tokens_per_s'] / base:>12.2f}")


STAGES = [("ZeRO-2", ["train.zero_stage=2"]), ("ZeRO-3", ["train.zero_stage=3"])]

if __name__ == "__main__":
    main()
