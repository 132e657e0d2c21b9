"""Learner rank 0's run: it serves the fleet (the hub), trains (with the other ranks), sends weights, records.

    start:  W&B (a refused login is a config error before any actor registers) -> hub, its state restored on
            --resume -> hub.start -> weight sender (serves the restored version to every actor that registers)
    loop, one update at a time (learner/update.py: take -> shares -> train -> settle):
            -> sender.sync(version): every actor gets the new weights; it returns at once, the broadcast runs on
               the sender's thread (learner/weights/sync.py)
            -> every eval.every_steps updates: the actors evaluate this version (learner/evaluator.py)
            -> metrics row (learner/update_row.py), checkpoint (learner/checkpoint.py, learner/resume.py), samples
    end:    a stop share to the other ranks (with the final checkpoint's step), the hub tells the actors to shut
            down (a run stopped early leaves them waiting for --resume), the ledger is checked

The hub owns the policy version (learner/update.py says why); this loop reads it, never keeps its own.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from learner.checkpoint import WRITE_ERRORS, CheckpointManager, hf_writer
from learner.evaluator import Evaluator
from learner.hub.server import Hub
from learner.metrics import MetricsWriter
from learner.resume import STATE_DIR, LearnerState, discard_newer, read_learner_state, restore_metrics, save_engines, write_learner_state
from learner.rollout_stats import PART_PREFIX
from learner.samples import SampleWriter
from learner.train.distributed import Topology
from learner.train.shard import Share, scatter_shares
from learner.train.trainer import Trainer
from learner.update import Update, run_update
from learner.update_row import Totals, update_row
from learner.wandb_log import WandbLogger
from learner.weights.source import WeightSource
from protocol.config import Config
from protocol.logs import set_context
from protocol.progress import Eta


@dataclass(kw_only=True, slots=True)
class RootState:
    """What rank 0 carries from update to update (and a checkpoint keeps, with the hub's state)."""

    updates: int = 0  # rollout batches trained
    totals: Totals = field(default_factory=Totals)
    last_row: dict = field(default_factory=dict)  # the newest metrics row, kept in the checkpoint's learner state


def run_root(
    cfg: Config,
    topo: Topology,
    trainer: Trainer,
    weights: WeightSource,
    tokenizer,
    data,
    total_updates: int,
    run_dir: Path,
    log,
    checkpoint: Path | None,
) -> int:
    prompts = data.train
    # W&B first: a missing package or a refused login is a config error before any actor can register.
    wandb = WandbLogger(cfg.log, run_dir, cfg.to_dict()) if cfg.log.wandb else None
    if wandb is not None:
        log.info("learner.wandb", mode=cfg.log.wandb_mode, run=wandb.where)
    # Operator's live settings (learner/hub/control.py); token ids of admitted groups stay below the embedding's rows.
    hub = Hub(cfg, prompts, control_file=run_dir / "control.toml", vocab_size=trainer.vocab_size)
    run = RootState()
    kept_rows: list[dict] = []
    if checkpoint is not None:  # before hub.start(): no actor sees the hub before it holds the restored ledger
        state = read_learner_state(checkpoint)
        hub.restore(state.hub, state.version)
        run = RootState(updates=state.updates, totals=Totals.of(state.row), last_row=state.row)
        kept_rows = restore_metrics(run_dir, state)
        discard_newer(run_dir, run.updates)
        set_context(policy_version=hub.version)
        log.info(
            "learner.resumed",
            checkpoint=str(checkpoint),
            updates=run.updates,
            version=hub.version,
            ledger=hub.ledger.state_counts(),
            max_staleness=hub.max_staleness,
        )
    hub.start()  # a port in use raises ConfigError naming hub.bind
    sender = weights.sender(cfg)  # in place (ZeRO <= 2) or gathered into a snapshot (ZeRO-3)
    snapshot = weights.sender_snapshot
    # Collective under ZeRO-3 (the followers join it at start). A resumed learner's actors come back serving -1
    # and get no work until they serve the hub's version: it is sent to each as it registers.
    sender.start(hub.version, hub, snapshot)
    metrics = MetricsWriter(run_dir, wandb)
    samples = SampleWriter(run_dir, cfg.log.samples_every_steps, cfg.log.samples_groups, tokenizer, prompts)
    metrics.rows.extend(kept_rows)  # the plot covers the whole run
    evaluator = Evaluator(cfg, data.eval_sets(), hub)
    # The reward part names reported so far (learner/rollout_stats.py bounds them); a resumed run's included.
    part_names = {key.removeprefix(PART_PREFIX) for row in kept_rows for key in row if key.startswith(PART_PREFIX)}
    # Checkpoints: from the model on rank 0, or under ZeRO-3 from the weight snapshot rank 0 already holds.
    hf = hf_writer(trainer.engine.module, tokenizer, sender.state_dict)

    def write_checkpoint(path: Path) -> None:
        """DeepSpeed state first: the other ranks are in save_checkpoint already (Share.save_step told them)."""
        try:
            save_engines(trainer, path / STATE_DIR)
        except WRITE_ERRORS as e:
            if topo.world > 1:  # the other ranks may be waiting at DeepSpeed's closing barrier: stop the group
                raise RuntimeError(f"checkpoint {path}: DeepSpeed state write failed on rank 0: {e}") from e
            raise
        hf(path)
        # Read when the checkpoint is written, after the update it follows.
        write_learner_state(
            path / STATE_DIR,
            LearnerState(
                updates=run.updates,
                version=hub.version,
                steps_per_update=trainer.layout.optimizer_steps,
                world=topo.world,
                zero_stage=cfg.train.zero_stage,
                hub=hub.export_state(),
                row=run.last_row,
            ),
        )

    checkpoints = CheckpointManager(cfg.checkpoint, run_dir, write_checkpoint)
    log.info(
        "learner.ready",
        prompts=len(prompts),
        eval_prompts={k: len(v) for k, v in data.eval_sets().items()},
        params=weights.num_params,
        ranks=topo.world,
        dp=topo.dp_size,
        sp=topo.sp_size,
        steps_per_update=trainer.layout.optimizer_steps,
        hub=cfg.hub.bind,
        weight_port=sender.port,
        updates=run.updates,
        version=hub.version,
    )

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    t_start = time.perf_counter()
    eta = Eta(total_updates)
    stop_sent = False
    try:
        while run.updates < total_updates and not stop["flag"]:
            t0 = time.perf_counter()
            # Decided before the update so that every rank saves after the same one (Share.save_step).
            n = run.updates + 1
            save_step = n if checkpoints.wants(n, last=n >= total_updates) else 0
            update = run_update(hub, trainer, cfg, topo, stop, log, save_step)
            if update is None:
                break
            if isinstance(update, str):  # refused: its prompts are back in the queue
                run.totals.refused_batches += 1
                continue
            run.updates = n
            run.totals.add(update.stats)
            if update.stats.critic_failed_steps:
                log.warning("learner.critic_optimizer_step_skipped", optimizer_steps=update.stats.critic_failed_steps, update=n)
            set_context(policy_version=update.version)
            t_sync = time.monotonic()
            # Weights that did not move (every step skipped) are not sent again; the followers skip their part too.
            moved = update.stats.applied_steps > 0
            sync = sender.sync(update.version, hub, snapshot) if moved else {"time/weight_sync": 0.0}
            step_s = time.perf_counter() - t0
            hub.note_update(step_s, t_sync if moved else None, sync["time/weight_sync"], sync.get("time/broadcast"))
            last = n >= total_updates
            # Blocks until the actors answer (time/eval, not in time/step); no newer weights go out meanwhile,
            # so the hub's version is what they serve.
            evals = evaluator.run(update.version, n, last, should_stop=lambda: stop["flag"])
            row = update_row(
                n,
                update,
                run.totals,
                step_s=step_s,
                wall_s=time.perf_counter() - t_start,
                part_names=part_names,
                critic=trainer.critic is not None,
            )
            row.update({**sync, **hub.snapshot(), **evals})
            run.last_row = row
            row.update(checkpoints.maybe_save(n, row, last))
            metrics.write(row)
            samples.write(n, update.version, update.groups)
            _log_update(log, row, update, total_updates, eta.update(n), sync)
        # Stopped early (SIGTERM): keep what was trained, training state included, so --resume can go on.
        final = run.updates if checkpoints.wants(run.updates, last=True) else 0
        if topo.world > 1:
            scatter_shares(topo, [Share(samples=[], mini_batch_tokens=[], stop=True, save_step=final)] * topo.dp_size)
            stop_sent = True
        checkpoints.maybe_save(run.updates, {}, last=True)
    finally:
        if topo.world > 1 and not stop_sent:
            scatter_shares(topo, [Share(samples=[], mini_batch_tokens=[], stop=True)] * topo.dp_size)
        sender.wait()
        # Stopped before the end (SIGTERM, an error): the actors stay up and wait for `--resume`.
        hub.stop("run finished", tell_actors=run.updates >= total_updates)
        metrics.close()
        plot = metrics.plot()
        hub.ledger.check()
        log.info(
            "learner.done",
            updates=run.updates,
            version=hub.version,
            wall_s=round(time.perf_counter() - t_start, 1),
            plot=str(plot),
            ledger=hub.ledger.state_counts(),
            ledger_epochs=hub.ledger.epochs_opened,
            ledger_prompts=hub.ledger.num_prompts,
            ledger_counts=dict(hub.ledger.counts),
        )
    return 0


def _log_update(log, row: dict, update: Update, total: int, eta_s: float | None, sync: dict) -> None:
    stats = update.stats
    log.info(
        "learner.step",
        step=row["step"],
        steps_total=total,
        eta_s=eta_s,
        version=update.version,
        reward=round(row["reward_mean"], 3),
        length=round(row["response/length_mean"], 1),
        staleness_max=row["staleness_max"],
        mismatch=None if stats.on_policy_tokens == 0 else float(f"{stats.logprob_mismatch:.2e}"),
        wait_s=round(update.wait_s, 2),
        train_s=round(update.train_s, 2),
        sync_s=round(sync["time/weight_sync"], 3),
        broadcast_s=round(sync.get("time/broadcast", 0.0), 3),
    )
