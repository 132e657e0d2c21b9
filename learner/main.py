"""`fleetrl learner`: one learner rank (rank 0 also runs the hub, the weight sender and the metrics).

    rank 0:  take a batch of admissible groups (blocks) -> advantages -> scatter shares -+
    ranks 1..N-1:                                          receive their share <---------+
    every rank:  update (S optimizer steps, DeepSpeed)  ->  weight snapshot (collective under ZeRO-3)
    rank 0:  version += steps applied (S unless DeepSpeed skipped some) -> ledger: trained, or requeued if a step
             failed (learner/hub/intake.py: settle_update); grants resume -> broadcast weights to the actors
             -> every eval.every_steps: the actors evaluate this version (learner/hub/evaluation.py)
             -> every checkpoint.every_steps: Hugging Face checkpoint (learner/checkpoint.py)
                plus the training state; every rank saves its DeepSpeed shard (learner/resume.py)
             -> metrics
    until the next update: any live actor that lacks the current version gets it (learner/weights/sync.py)

`--resume`: every rank loads the newest complete checkpoint's engines; rank 0 restores the hub
(ledger, version, counters) and the metrics rows before any actor can register.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from learner.checkpoint import WRITE_ERRORS, CheckpointManager, hf_writer, staging_dir
from learner.data.prompts import load_datasets
from learner.evaluator import Evaluator
from learner.hub.intake import settle_update, take_update_batch
from learner.hub.server import Hub
from learner.metrics import MetricsWriter
from learner.model_files import load_tokenizer
from learner.plan import make_plan, render
from learner.resume import (
    STATE_DIR,
    LearnerState,
    agree_on_checkpoint,
    check_compatible,
    discard_newer,
    load_engines,
    read_learner_state,
    restore_metrics,
    save_engines,
    set_aside_previous_run,
    write_learner_state,
)
from learner.rollout_stats import PART_PREFIX, rollout_metrics
from learner.samples import SampleWriter
from learner.train.batch import InvalidBatch
from learner.train.distributed import Topology, init_distributed, make_topology
from learner.train.shard import Share, scatter_shares
from learner.train.trainer import StepLayout, Trainer, make_shares
from learner.wandb_log import WandbLogger
from learner.weights.source import WeightSource
from protocol.config import Config, ConfigError, dump_toml, parse_cpus
from protocol.logs import learner_log_file, set_context, setup_logging
from protocol.net import pin_cpus
from protocol.progress import Eta


def run_learner(cfg: Config, resume: bool = False) -> int:
    """Every learner rank runs this; rank 0 also runs the hub, the weight sender and the metrics.

    `resume`: continue from the newest complete checkpoint in run.dir (learner/resume.py).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    # Its groups are destroyed at exit, before gloo's own teardown could abort a finished rank. DeepSpeed prints
    # "DeepSpeed ... built successfully" on stdout as it joins on a CPU: not news to anyone reading the screen.
    with contextlib.redirect_stdout(io.StringIO()):
        init_distributed()
    return _run_rank(cfg, resume)


def _run_rank(cfg: Config, resume: bool) -> int:
    topo = make_topology(cfg.train.sequence_parallel_size)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = setup_logging("learner", learner_log_file(run_dir, topo.rank), policy_version=0, rank=topo.rank)
    if topo.is_root and not resume:
        stamp = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
        if (aside := set_aside_previous_run(run_dir, stamp)) is not None:
            log.warning("learner.previous_run_set_aside", moved_to=str(aside), hint="to continue a run, start it with --resume")
    pin_cpus(parse_cpus(cfg.train.cpu_affinity, "train.cpu_affinity"))
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.run.seed)

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" and "Writing model shards" bars: one per rank, per checkpoint
    tokenizer = load_tokenizer(cfg.model.path)  # ConfigError naming model.path when the folder is wrong
    data = load_datasets(cfg, tokenizer) if topo.is_root else None
    # Followers need only the batch arithmetic, which does not depend on the prompt count.
    plan = make_plan(cfg, num_prompts=len(data.train) if data is not None else cfg.train.prompts_per_step)
    if plan.learner_ranks != topo.world:
        raise ConfigError(
            f"cluster: the plan has {plan.learner_ranks} learner ranks "
            f"(learner_nodes x learner_gpus_per_node, or debug_gpus), torchrun started {topo.world}"
        )
    layout = StepLayout.of(plan)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    trainer = Trainer(cfg, model, topo, layout)
    checkpoint = None
    if resume:
        checkpoint = agree_on_checkpoint(topo, run_dir)
        check_compatible(read_learner_state(checkpoint), topo, cfg.train.zero_stage, layout.steps)
        load_engines(trainer, checkpoint / STATE_DIR)
        log.info("learner.resumed_engines", checkpoint=str(checkpoint), optimizer_steps=trainer.engine.global_steps)
    if not topo.is_root:
        return _run_follower(cfg, topo, trainer, log)
    assert data is not None
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    log.info("learner.plan", text="\n" + render(plan))
    return _run_root(cfg, topo, trainer, tokenizer, data, plan.rollout_batches, run_dir, log, checkpoint)


def _run_follower(cfg: Config, topo: Topology, trainer: Trainer, log) -> int:
    """Ranks 1..N-1: train the share rank 0 hands out, join the weight snapshot and the checkpoints, until told to stop."""
    # torchrun hands a SIGTERM to every rank. A follower dying under rank 0's collectives would cost the final
    # checkpoint; it stops when rank 0 says so (its stop share), after joining that checkpoint. torchrun
    # SIGKILLs the ranks 30 s after the SIGTERM in any case.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    weights = WeightSource(cfg, trainer)
    weights.follow()  # rank 0's WeightSender.start
    updates = 0
    while True:
        share = scatter_shares(topo, None)
        if not share.stop:
            stats = trainer.update(share)
            set_context(policy_version=share.version + stats.applied_steps)
            if stats.applied_steps:  # rank 0 syncs only weights that moved; every rank knows the same count
                weights.follow()
            updates += 1
        if share.save_step:  # rank 0 writes the same checkpoint now (it decided before the update)
            save_engines(trainer, staging_dir(Path(cfg.run.dir), share.save_step) / STATE_DIR)
        if share.stop:
            break
    log.info("learner.done", rank=topo.rank, updates=updates)
    return 0


def _run_root(
    cfg: Config, topo: Topology, trainer: Trainer, tokenizer, data, total_updates: int, run_dir: Path, log, checkpoint: Path | None
) -> int:
    prompts = data.train
    # W&B first: a missing package or a refused login is a config error before any actor can register.
    wandb = WandbLogger(cfg.log, run_dir, cfg.to_dict()) if cfg.log.wandb else None
    if wandb is not None:
        log.info("learner.wandb", mode=cfg.log.wandb_mode, run=wandb.where)
    # Operator's live settings (learner/hub/control.py); token ids of admitted groups stay below the embedding's rows.
    hub = Hub(cfg, prompts, control_file=run_dir / "control.toml", vocab_size=trainer.vocab_size)
    version, updates = 0, 0
    skipped_steps, refused_batches = 0, 0  # optimizer steps that failed (learner/train/step_check.py), batches refused
    critic_skipped = 0  # the GAE critic's failed steps (its weights stayed as they were)
    kept_rows: list[dict] = []
    last_row: dict = {}  # the newest metrics row, kept in the checkpoint's learner state
    if checkpoint is not None:  # before hub.start(): no actor sees the hub before it holds the restored ledger
        state = read_learner_state(checkpoint)
        hub.restore(state.hub, state.version)
        version, updates, last_row = state.version, state.updates, state.row
        skipped_steps, refused_batches = int(last_row.get("train/skipped_steps", 0)), int(last_row.get("train/refused_batches", 0))
        critic_skipped = int(last_row.get("train/critic_skipped_steps", 0))
        kept_rows = restore_metrics(run_dir, state)
        discard_newer(run_dir, updates)
        set_context(policy_version=version)
        log.info(
            "learner.resumed",
            checkpoint=str(checkpoint),
            updates=updates,
            version=version,
            ledger=hub.ledger.state_counts(),
            max_staleness=hub.max_staleness,
        )
    hub.start()  # a port in use raises ConfigError naming hub.bind
    weights = WeightSource(cfg, trainer)  # in place (ZeRO <= 2) or gathered into a snapshot (ZeRO-3)
    sender = weights.sender(cfg)
    snapshot = weights.snapshot
    # Collective under ZeRO-3 (the followers join it at start). A resumed learner's actors come back serving -1
    # and get no work until they serve `version`: it is sent to each as it registers.
    sender.start(version, hub, snapshot)
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
        # `updates`, `version` and `last_row` are read when the checkpoint is written, after the update it follows.
        write_learner_state(
            path / STATE_DIR,
            LearnerState(
                updates=updates,
                version=version,
                steps_per_update=trainer.layout.steps,
                world=topo.world,
                zero_stage=cfg.train.zero_stage,
                hub=hub.export_state(),
                row=last_row,
            ),
        )

    checkpoints = CheckpointManager(cfg.checkpoint, run_dir, write_checkpoint)
    params = sum(int(np.prod(s)) for s in trainer.full_shapes())
    log.info(
        "learner.ready",
        prompts=len(prompts),
        eval_prompts={k: len(v) for k, v in data.eval_sets().items()},
        params=params,
        ranks=topo.world,
        dp=topo.dp_size,
        sp=topo.sp_size,
        steps_per_update=trainer.layout.steps,
        hub=cfg.hub.bind,
        weight_port=sender.port,
        updates=updates,
        version=version,
    )

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    t_start = time.perf_counter()
    eta = Eta(total_updates)
    stop_sent = False
    try:
        while updates < total_updates and not stop["flag"]:
            t0 = time.perf_counter()
            taken = take_update_batch(hub, cfg, stop, log)
            if taken is None:
                break
            batch, filtered = taken
            t_wait = time.perf_counter() - t0
            k = hub.batch_max_staleness  # not hub.max_staleness: `fleetrl ctl` may have changed it since the take
            groups = [item.group for item in batch]
            # Decided before the update so that every rank saves after the same one (Share.save_step).
            save_step = updates + 1 if checkpoints.wants(updates + 1, last=updates + 1 >= total_updates) else 0
            try:
                shares, advantages = make_shares(cfg, groups, version, k, topo.dp_size, vocab_size=trainer.vocab_size)
                for share in shares:
                    share.save_step = save_step
                stats = trainer.update(scatter_shares(topo, shares))
            except InvalidBatch as e:  # raised before the scatter: no other rank saw the batch, none waits on it
                hub.abort_update(batch + filtered)
                refused_batches += 1
                log.error("learner.batch_refused", error=str(e), groups=len(batch), requeued=len(batch) + len(filtered))
                continue
            except Exception:
                hub.abort_update(batch + filtered)
                raise
            t_train = time.perf_counter() - t0 - t_wait
            start, updates = version, updates + 1
            version = settle_update(hub, batch + filtered, start, stats.applied_steps, stats.failed_steps, log)
            skipped_steps += len(stats.failed_steps)
            if stats.critic_failed_steps:
                critic_skipped += len(stats.critic_failed_steps)
                log.warning("learner.critic_step_skipped", steps=stats.critic_failed_steps, update=updates)
            set_context(policy_version=version)
            t_sync = time.monotonic()
            # Weights that did not move (every step skipped) are not sent again; the followers skip their part too.
            sync = sender.sync(version, hub, snapshot) if stats.applied_steps else {"time/weight_sync": 0.0}
            step_s = time.perf_counter() - t0
            hub.note_update(step_s, t_sync if stats.applied_steps else None, sync["time/weight_sync"], sync.get("time/broadcast"))
            last = updates >= total_updates
            # Blocks until the actors answer (time/eval, not in time/step); no newer weights go out meanwhile,
            # so `version` is what they serve.
            evals = evaluator.run(version, updates, last, should_stop=lambda: stop["flag"])
            stale = [start - g.version_min for g in groups]
            reward_mean = float(np.mean([g.rewards.mean() for g in groups]))
            rollout = rollout_metrics(groups, [item.group for item in filtered], part_names)
            row = {
                "step": updates,
                "policy_version": version,
                "reward_mean": reward_mean,
                "samples": stats.samples,
                "staleness_max": max(stale),
                "staleness_mean": float(np.mean(stale)),
                "logprob_mismatch": stats.logprob_mismatch,
                "on_policy_tokens": stats.on_policy_tokens,
                "packing_efficiency": stats.packing_efficiency,
                "padded_efficiency": stats.padded_efficiency,
                **stats.extra,
                "tokens_per_s": stats.tokens / step_s,
                "samples_per_s": stats.samples / step_s,
                "wall_s": time.perf_counter() - t_start,
                "loss": stats.loss,
                "clip_frac": stats.clip_frac,
                "grad_norm": stats.grad_norm,
                "adv_abs_mean": float(advantages.abs().mean()),
                "max_staleness": k,
                "groups_filtered": len(filtered),
                "train/skipped_steps": skipped_steps,
                **({"train/critic_skipped_steps": critic_skipped} if trainer.critic is not None else {}),
                "train/refused_batches": refused_batches,
                "batch/actors": len({g.actor_id for g in groups}),
                **rollout,
                "batch/on_policy_actors": len({g.actor_id for g, s in zip(groups, stale, strict=True) if s == 0}),
                "time/wait": t_wait,
                "time/train": t_train,
                "time/step": step_s,
                **sync,
                **hub.snapshot(),
                **evals,
            }
            last_row = row
            row.update(checkpoints.maybe_save(updates, row, last))
            metrics.write(row)
            samples.write(updates, version, groups)
            log.info(
                "learner.step",
                step=updates,
                steps_total=total_updates,
                eta_s=eta.update(updates),
                version=version,
                reward=round(reward_mean, 3),
                length=round(rollout["response/length_mean"], 1),
                staleness_max=max(stale),
                mismatch=None if stats.on_policy_tokens == 0 else float(f"{stats.logprob_mismatch:.2e}"),
                wait_s=round(t_wait, 2),
                train_s=round(t_train, 2),
                sync_s=round(sync["time/weight_sync"], 3),
                broadcast_s=round(sync.get("time/broadcast", 0.0), 3),
            )
        # Stopped early (SIGTERM): keep what was trained, training state included, so --resume can go on.
        final = updates if checkpoints.wants(updates, last=True) else 0
        if topo.world > 1:
            scatter_shares(topo, [Share(samples=[], mini_batch_tokens=[], stop=True, save_step=final)] * topo.dp_size)
            stop_sent = True
        checkpoints.maybe_save(updates, {}, last=True)
    finally:
        if topo.world > 1 and not stop_sent:
            scatter_shares(topo, [Share(samples=[], mini_batch_tokens=[], stop=True)] * topo.dp_size)
        sender.wait()
        # Stopped before the end (SIGTERM, an error): the actors stay up and wait for `--resume`.
        hub.stop("run finished", tell_actors=updates >= total_updates)
        metrics.close()
        plot = metrics.plot()
        hub.ledger.check()
        log.info(
            "learner.done",
            updates=updates,
            version=version,
            wall_s=round(time.perf_counter() - t_start, 1),
            plot=str(plot),
            ledger=hub.ledger.state_counts(),
            ledger_epochs=hub.ledger.epochs_opened,
            ledger_prompts=hub.ledger.num_prompts,
            ledger_counts=dict(hub.ledger.counts),
        )
    return 0
