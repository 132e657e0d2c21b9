"""Learner rank 0's run: it serves the fleet (the hub), trains (with the other ranks), sends weights, records.

    Root()       W&B (a refused login is a config error before any actor registers) -> hub, its state restored
                 on --resume -> hub.start -> weight sender (it serves the restored version to every actor that
                 registers) -> metrics, samples, evaluator, checkpoints
    run()        one update at a time (learner/update.py: take -> shares -> train -> settle), then _after:
                   -> sender.sync(version): every actor gets the new weights; it returns at once, the broadcast
                      runs on the sender's thread (learner/weights/sync.py)
                   -> every eval.every_steps updates: the actors evaluate this version (learner/evaluator.py)
                   -> metrics row (learner/record/row.py), checkpoint (learner/checkpoint.py, learner/resume.py),
                      sample completions
    _finish()    a stop share to the other ranks (with the final checkpoint's step), the hub tells the actors to
                 shut down (a run stopped early leaves them waiting for --resume), the ledger is checked

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
from learner.record.metrics import MetricsWriter
from learner.record.rollout_stats import PART_PREFIX
from learner.record.row import Totals, update_row
from learner.record.samples import SampleWriter
from learner.record.wandb_log import WandbLogger
from learner.resume import STATE_DIR, LearnerState, discard_newer, read_learner_state, restore_metrics, save_engines, write_learner_state
from learner.train.distributed import Topology
from learner.train.shard import Share, scatter_shares
from learner.train.trainer import Trainer
from learner.update import Update, run_update
from learner.weights.source import WeightSource
from protocol.config import Config
from protocol.logs import set_context
from protocol.progress import Eta


@dataclass(kw_only=True, slots=True)
class Progress:
    """What rank 0 carries from update to update (a checkpoint keeps it, with the hub's state)."""

    updates: int = 0  # rollout batches trained
    totals: Totals = field(default_factory=Totals)
    last_row: dict = field(default_factory=dict)  # the newest metrics row, kept in the checkpoint's learner state


class Root:
    def __init__(
        self,
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
    ):
        self.cfg, self.topo, self.trainer, self.log = cfg, topo, trainer, log
        self.total_updates, self.run_dir = total_updates, run_dir
        prompts = data.train
        # W&B first: a missing package or a refused login is a config error before any actor can register.
        wandb = WandbLogger(cfg.log, run_dir, cfg.to_dict()) if cfg.log.wandb else None
        if wandb is not None:
            log.info("learner.wandb", mode=cfg.log.wandb_mode, run=wandb.where)
        # Operator's live settings (learner/hub/core/control.py); token ids of admitted groups stay below the
        # embedding's rows.
        self.hub = hub = Hub(cfg, prompts, control_file=run_dir / "control.toml", vocab_size=trainer.vocab_size)
        self.progress = Progress()
        if checkpoint is not None:
            self._restore(checkpoint)  # before hub.start(): see _restore
        hub.start()  # a port in use raises ConfigError naming hub.bind
        self.sender = weights.sender(cfg)  # in place (ZeRO <= 2) or gathered into a snapshot (ZeRO-3)
        self.snapshot = weights.sender_snapshot
        # Collective under ZeRO-3 (the followers join it at start). A resumed learner's actors come back serving -1
        # and get no work until they serve the hub's version: it is sent to each as it registers.
        self.sender.start(hub.version, hub, self.snapshot)
        self.metrics = MetricsWriter(run_dir, wandb)  # a resumed run's rows (cut by _restore) are in its curve
        self.samples = SampleWriter(run_dir, cfg.log.samples_every_steps, cfg.log.samples_groups, tokenizer, prompts)
        self.evaluator = Evaluator(cfg, data.eval_sets(), hub)
        # The reward part names reported so far (learner/record/rollout_stats.py bounds them); a resumed run's included.
        self.part_names = {key.removeprefix(PART_PREFIX) for key in self.metrics.keys if key.startswith(PART_PREFIX)}
        # Checkpoints: from the model on rank 0, or under ZeRO-3 from the weight snapshot rank 0 already holds.
        self.hf = hf_writer(trainer.engine.module, tokenizer, self.sender.state_dict)
        self.checkpoints = CheckpointManager(cfg.checkpoint, run_dir, self._write_checkpoint)
        self.stop = {"flag": False}
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
            weight_port=self.sender.port,
            updates=self.progress.updates,
            version=hub.version,
        )

    def _restore(self, checkpoint: Path) -> None:
        """--resume, before hub.start(): no actor sees the hub before it holds the restored ledger. metrics.jsonl is
        cut back to the rows of the updates up to the checkpoint."""
        hub, state = self.hub, read_learner_state(checkpoint)
        hub.restore(state.hub, state.version)
        self.progress = Progress(updates=state.updates, totals=Totals.of(state.row), last_row=state.row)
        restore_metrics(self.run_dir, state)
        discard_newer(self.run_dir, state.updates)
        set_context(policy_version=hub.version)
        self.log.info(
            "learner.resumed",
            checkpoint=str(checkpoint),
            updates=state.updates,
            version=hub.version,
            ledger=hub.ledger.state_counts(),
            max_staleness=hub.max_staleness,
        )

    def run(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: self.stop.update(flag=True))
        self.t_start = time.perf_counter()
        self.eta = Eta(self.total_updates)
        run, stop_sent = self.progress, False
        try:
            while run.updates < self.total_updates and not self.stop["flag"]:
                t0 = time.perf_counter()
                # Decided before the update so that every rank saves after the same one (Share.save_step).
                n = run.updates + 1
                save_step = n if self.checkpoints.wants(n, last=n >= self.total_updates) else 0
                update = run_update(self.hub, self.trainer, self.cfg, self.topo, self.stop, self.log, save_step)
                if update is None:
                    break
                if isinstance(update, str):  # refused: its prompts are back in the queue
                    run.totals.refused_batches += 1
                    continue
                run.updates = n
                self._after(update, t0)
            # Stopped early (SIGTERM): keep what was trained, training state included, so --resume can go on.
            final = run.updates if self.checkpoints.wants(run.updates, last=True) else 0
            if self.topo.world > 1:
                scatter_shares(self.topo, [Share(samples=[], mini_batch_tokens=[], stop=True, save_step=final)] * self.topo.dp_size)
                stop_sent = True
            self.checkpoints.maybe_save(run.updates, {}, last=True)
        finally:
            self._finish(stop_sent)
        return 0

    def _after(self, update: Update, t0: float) -> None:
        """Update n is settled: send its weights, evaluate them when due, record it."""
        run, hub, n = self.progress, self.hub, self.progress.updates
        run.totals.add(update.stats)
        if update.stats.critic_failed_steps:
            self.log.warning("learner.critic_optimizer_step_skipped", optimizer_steps=update.stats.critic_failed_steps, update=n)
        set_context(policy_version=update.version)
        t_sync = time.monotonic()
        # Weights that did not move (every step skipped) are not sent again; the followers skip their part too.
        moved = update.stats.applied_steps > 0
        sync = self.sender.sync(update.version, hub, self.snapshot) if moved else {"time/weight_sync": 0.0}
        step_s = time.perf_counter() - t0
        hub.note_update(step_s, t_sync if moved else None, sync["time/weight_sync"], sync.get("time/broadcast"))
        last = n >= self.total_updates
        # Blocks until the actors answer (time/eval, not in time/step); no newer weights go out meanwhile, so the
        # hub's version is what they serve.
        evals = self.evaluator.run(update.version, n, last, should_stop=lambda: self.stop["flag"])
        row = update_row(
            n,
            update,
            run.totals,
            step_s=step_s,
            wall_s=time.perf_counter() - self.t_start,
            part_names=self.part_names,
            critic=self.trainer.critic is not None,
        )
        row.update({**sync, **hub.snapshot(), **evals})
        run.last_row = row
        row.update(self.checkpoints.maybe_save(n, row, last))
        self.metrics.write(row)
        self.samples.write(n, update.version, update.groups)
        stats = update.stats
        self.log.info(
            "learner.step",
            step=n,
            steps_total=self.total_updates,
            eta_s=self.eta.update(n),
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

    def _write_checkpoint(self, path: Path) -> None:
        """DeepSpeed state first: the other ranks are in save_checkpoint already (Share.save_step told them)."""
        try:
            save_engines(self.trainer, path / STATE_DIR)
        except WRITE_ERRORS as e:
            if self.topo.world > 1:  # the other ranks may be waiting at DeepSpeed's closing barrier: stop the group
                raise RuntimeError(f"checkpoint {path}: DeepSpeed state write failed on rank 0: {e}") from e
            raise
        self.hf(path)
        # Read when the checkpoint is written, after the update it follows.
        write_learner_state(
            path / STATE_DIR,
            LearnerState(
                updates=self.progress.updates,
                version=self.hub.version,
                steps_per_update=self.trainer.layout.optimizer_steps,
                world=self.topo.world,
                zero_stage=self.cfg.train.zero_stage,
                hub=self.hub.export_state(),
                row=self.progress.last_row,
            ),
        )

    def _finish(self, stop_sent: bool) -> None:
        hub = self.hub
        if self.topo.world > 1 and not stop_sent:
            scatter_shares(self.topo, [Share(samples=[], mini_batch_tokens=[], stop=True)] * self.topo.dp_size)
        self.sender.wait()
        # Stopped before the end (SIGTERM, an error): the actors stay up and wait for `--resume`. Out of data: the end.
        hub.stop("run finished", tell_actors=self.progress.updates >= self.total_updates or self.stop.get("exhausted", False))
        self.metrics.close()
        plot = self.metrics.plot()
        hub.ledger.check()
        self.log.info(
            "learner.done",
            updates=self.progress.updates,
            version=hub.version,
            wall_s=round(time.perf_counter() - self.t_start, 1),
            plot=str(plot),
            ledger=hub.ledger.state_counts(),
            ledger_epochs=hub.ledger.epochs_opened,
            ledger_prompts=hub.ledger.num_prompts,
            ledger_counts=dict(hub.ledger.counts),
        )
