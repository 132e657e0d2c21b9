"""Train, checkpoint the training state mid-run, and resume from it, through the real multi-rank path.

    python -m torch.distributed.run --nproc-per-node N tests/drivers/resume_steps.py MODEL_DIR RUN_DIR OUT.json MODE [k=v ...]

MODE `run`: train.total_steps updates on fixed seeded groups (those of tests/drivers/train_steps.py); after update
`checkpoint.every_steps` rank 0 tells every rank in the share's header (Share.save_step) and they save their
DeepSpeed state into the staging folder that rank 0 then completes and renames (learner/checkpoint.py).
MODE `resume`: every rank loads the newest complete checkpoint (learner/resume.py) and trains the remaining updates.
Rank 0 writes the losses per update and the final weights' checksums.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "drivers"))

from train_steps import groups_for  # noqa: E402

from learner.checkpoint import CheckpointManager, staging_dir  # noqa: E402
from learner.plan import make_plan  # noqa: E402
from learner.resume import (  # noqa: E402
    STATE_DIR,
    LearnerState,
    agree_on_checkpoint,
    load_engines,
    read_learner_state,
    save_engines,
    write_learner_state,
)
from learner.train.distributed import exit_process, init_distributed, make_topology  # noqa: E402
from learner.train.engines import UpdateLayout  # noqa: E402
from learner.train.shard import make_shares, scatter_shares  # noqa: E402
from learner.train.trainer import Trainer  # noqa: E402
from learner.weights.source import WeightSource  # noqa: E402
from protocol.config import load_config  # noqa: E402


def main() -> None:
    model_dir, run_dir, out_path, mode, *overrides = sys.argv[1:]
    cfg = load_config(None, [f"model.path={model_dir}", f"run.dir={run_dir}", "weights.bucket_mb=1", *overrides])
    init_distributed()
    topo = make_topology(cfg.train.sequence_parallel_size)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    plan = make_plan(cfg, num_prompts=100)
    layout = UpdateLayout.of(plan)
    trainer = Trainer(cfg, model, topo, layout)
    source = WeightSource(cfg, trainer.engine, topo)  # 1 MiB buckets (weights.bucket_mb=1): several of them
    first, version = 0, 0
    if mode == "resume":
        checkpoint = agree_on_checkpoint(topo, Path(run_dir))
        load_engines(trainer, checkpoint / STATE_DIR)
        state = read_learner_state(checkpoint)
        first, version = state.updates, state.version
    done = first

    def write(path: Path) -> None:
        save_engines(trainer, path / STATE_DIR)  # collective: the other ranks are in it now (Share.save_step)
        write_learner_state(
            path / STATE_DIR,
            LearnerState(
                updates=done,
                version=version,
                steps_per_update=layout.optimizer_steps,
                world=topo.world,
                zero_stage=cfg.train.zero_stage,
                hub={},
            ),
        )

    checkpoints = CheckpointManager(cfg.checkpoint, Path(run_dir), write) if topo.is_root else None
    losses: dict[int, float] = {}
    flats = None
    for update in range(first, cfg.train.total_steps):
        save_step = update + 1 if update + 1 == cfg.checkpoint.every_steps else 0
        shares = None
        if topo.is_root:
            shares = make_shares(cfg, groups_for(update, version, cfg), version, cfg.staleness.max_staleness, topo.dp_size)[0]
            for share in shares:
                share.save_step = save_step
        share = scatter_shares(topo, shares)
        stats = trainer.update(share)
        flats = source.take()
        version += trainer.layout.optimizer_steps
        done = update + 1
        losses[done] = stats.loss
        if checkpoints is not None and save_step:
            assert checkpoints.save(save_step) is not None
        elif share.save_step:
            save_engines(trainer, staging_dir(Path(run_dir), share.save_step) / STATE_DIR)
    if topo.is_root:
        assert flats is not None
        weights = torch.cat(flats).double()
        Path(out_path).write_text(
            json.dumps(
                {
                    "losses": losses,
                    "version": version,
                    "optimizer_steps": trainer.engine.global_steps,
                    "lr": trainer.engine.get_lr()[0],
                    "weight_sum": float(weights.sum()),
                    "weight_abs": float(weights.abs().sum()),
                }
            )
        )

    # Every rank leaves together, once the result is on disk: a rank's exit then cannot cut the others short.
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)  # as a learner rank ends: no interpreter teardown for gloo to abort in
