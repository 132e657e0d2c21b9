"""The cost of algo.old_logprobs = recompute: learner update time with and without it, same work, one run.

recompute clips the ratio against the learner's own logprobs before the update. When an update takes S > 1
optimizer steps that costs one no-grad forward per micro-batch before the first step (learner/train/trainer.py:
_prepare); at S = 1 the first step's own logprobs are those, so it costs nothing. One learner process on CPU (the
real DeepSpeed ZeRO-2 path), a Qwen2-shaped model, 64 synthetic samples of 32-128 completion tokens per update in
8-sample micro-batches, packed. The two settings of each S run alternately on the same batches, so a change in
the machine's load hits both.

    python -m bench.recompute [--updates 5] [--warmup 1] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported: it picks its accelerator once

SETTINGS = [
    "train.prompts_per_step=8",
    "rollout.samples_per_prompt=8",
    "train.micro_batch_samples=8",
    "rollout.max_tokens=128",
    "actor.max_model_len=256",
    "train.threads=1",
    "train.zero_stage=2",
    "train.warmup_steps=0",
]


def make_trainer(model_dir: Path, steps: int, old_logprobs: str):
    from transformers import AutoModelForCausalLM

    from learner.plan import make_plan
    from learner.train.distributed import make_topology
    from learner.train.engines import UpdateLayout
    from learner.train.trainer import Trainer
    from protocol.config import load_config

    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            *SETTINGS,
            f"train.mini_batches={steps}",
            f"staleness.max_staleness={steps - 1}",
            f"algo.old_logprobs={old_logprobs}",
        ],
    )
    layout = UpdateLayout.of(make_plan(cfg, num_prompts=100))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return cfg, Trainer(cfg, model, make_topology(1), layout)


def share_for(cfg, update: int, version: int):
    from bench.synthetic import synthetic_groups
    from learner.train.shard import make_shares

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
    return make_shares(cfg, groups, version, cfg.staleness.max_staleness, 1)[0][0]


def time_pair(model_dir: Path, steps: int, warmup: int, updates: int) -> dict[str, float]:
    """Seconds per update for behaviour and recompute at S = steps, alternating update by update."""
    runs = {mode: make_trainer(model_dir, steps, mode) for mode in ("behaviour", "recompute")}
    spent = dict.fromkeys(runs, 0.0)
    for update in range(warmup + updates):
        for mode, (cfg, trainer) in runs.items():
            share = share_for(cfg, update, version=update * steps)
            start = time.perf_counter()
            trainer.update(share)
            if update >= warmup:
                spent[mode] += time.perf_counter() - start
    return {mode: s / updates for mode, s in spent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    from deploy.tiny import build_model
    from learner.train.distributed import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model = build_model(vocab_size=1024, seed=0, hidden=args.hidden, layers=args.layers, heads=args.hidden // 64)
        model.save_pretrained(model_dir)
        params = sum(p.numel() for p in model.parameters())
        rows = [(steps, time_pair(model_dir, steps, args.warmup, args.updates)) for steps in (1, 4)]
    print(f"\nlearner, 1 CPU process, Qwen2-shaped {params / 1e6:.1f}M params, 64 samples x 32-128 tokens per update")
    print("| optimizer steps per update (S) | behaviour s/update | recompute s/update | recompute / behaviour |")
    print("|---:|---:|---:|---:|")
    for steps, t in rows:
        print(f"| {steps} | {t['behaviour']:.2f} | {t['recompute']:.2f} | {t['recompute'] / t['behaviour']:.2f} |")


if __name__ == "__main__":
    main()
