"""Run a few learner updates on fixed synthetic rollout groups, through the real multi-rank path.

    python -m torch.distributed.run --nproc-per-node N tests/drivers/train_steps.py MODEL_DIR OUT.json [section.field=value ...]

Rank 0 builds the same seeded groups whatever the world size, advantages it, cuts the shares
and scatters them (learner/train/shard.py); every rank trains its share (learner/train/trainer.py) and joins
the weight snapshot. Rank 0 writes the loss of every update and a checksum of the weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.synthetic import synthetic_groups  # noqa: E402
from learner.plan import make_plan  # noqa: E402
from learner.train.distributed import exit_process, init_distributed, make_topology  # noqa: E402
from learner.train.engines import UpdateLayout  # noqa: E402
from learner.train.shard import make_shares, scatter_shares  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402
from learner.weights.source import WeightSource  # noqa: E402
from protocol.config import load_config  # noqa: E402
from protocol.messages import RolloutGroup  # noqa: E402


def groups_for(update: int, version: int, cfg) -> list[RolloutGroup]:
    return synthetic_groups(
        groups=cfg.train.prompts_per_step,
        samples=cfg.rollout.samples_per_prompt,
        seed=1000 + update,
        version=version,
        prompt_len=4,
        completion=(1, 4),
        vocab=(3, 20),
        behaviour_logp=-2.5,
    )


def main() -> None:
    model_dir, out_path, *overrides = sys.argv[1:]
    cfg = load_config(None, [f"model.path={model_dir}", "weights.bucket_mb=1", *overrides])
    init_distributed()
    topo = make_topology(cfg.train.sequence_parallel_size)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    plan = make_plan(cfg, num_prompts=100)
    layout = UpdateLayout.of(plan)
    trainer = Trainer(cfg, model, topo, layout)
    source = WeightSource(cfg, trainer.engine, topo)  # 1 MiB buckets (weights.bucket_mb=1): several of them
    losses, grad_norms, extras, micro, version, flats = [], [], [], [], 0, None
    for update in range(cfg.train.total_steps):
        shares = (
            make_shares(cfg, groups_for(update, version, cfg), version, cfg.staleness.max_staleness, topo.dp_size)[0]
            if topo.is_root
            else None
        )
        share = scatter_shares(topo, shares)
        micro.append(share.micro_sizes)  # rank 0's: how its samples were cut into micro-batches
        stats = trainer.update(share)
        flats = source.take()
        version += trainer.layout.optimizer_steps
        losses.append(stats.loss)
        grad_norms.append(stats.grad_norm)
        extras.append({**stats.extra, "packing_efficiency": stats.packing_efficiency, "padded_efficiency": stats.padded_efficiency})
    if topo.is_root:
        assert flats is not None
        weights = torch.cat(flats)
        Path(out_path).write_text(
            json.dumps(
                {
                    "losses": losses,
                    "grad_norms": grad_norms,
                    "extras": extras,
                    "micro_sizes": micro,
                    "version": version,
                    "samples": stats.samples,
                    "weight_sum": float(weights.double().sum()),
                    "weight_abs": float(weights.double().abs().sum()),
                    "world": topo.world,
                    "grad_accum_dtype": str(trainer.engine.get_data_types()[1]),  # what DeepSpeed sums micro-batches in
                }
            )
        )

    # Every rank leaves together, once the result is on disk: a rank's exit then cannot cut the others short.
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)  # as a learner rank ends: no interpreter teardown for gloo to abort in
