"""`fleetrl learner`: one learner rank (rank 0 also runs the hub, the weight sender and the metrics).

    rank 0:  take a batch of admissible groups (blocks) -> advantages -> scatter shares -+   learner/update.py
    ranks 1..N-1:                                          receive their share <---------+   _run_follower
    every rank:  update (S optimizer steps, DeepSpeed)  ->  weight snapshot (collective under ZeRO-3)
    rank 0:  the hub's version += steps applied (S unless DeepSpeed skipped some) -> ledger: trained, or requeued
             if a step failed; grants resume -> broadcast weights to the actors    learner/root.py from here on
             -> every eval.every_steps updates: the actors evaluate this version (learner/hub/core/evaluation.py)
             -> every checkpoint.every_steps updates: Hugging Face checkpoint (learner/checkpoint.py)
                plus the training state; every rank saves its DeepSpeed shard (learner/resume.py)
             -> metrics
    until the next update: any live actor that lacks the current version gets it (learner/weights/sync.py)

This module sets a rank up (process group, logging, model, plan, trainer, --resume's engines) and runs it.

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

import torch

from learner.checkpoint import staging_dir
from learner.data.prompts import load_datasets
from learner.model_files import load_tokenizer
from learner.plan import make_plan, render
from learner.resume import (
    STATE_DIR,
    agree_on_checkpoint,
    check_compatible,
    load_engines,
    read_learner_state,
    save_engines,
    set_aside_previous_run,
)
from learner.root import Root
from learner.train.distributed import Topology, exit_process, init_distributed, make_topology
from learner.train.engines import UpdateLayout
from learner.train.shard import scatter_shares
from learner.train.trainer import Trainer
from learner.weights.source import WeightSource
from protocol.config import Config, ConfigError, dump_toml, parse_cpus
from protocol.logs import learner_log_file, set_context, setup_logging
from protocol.net import pin_cpus


def run_learner(cfg: Config, resume: bool = False) -> int:
    """Every learner rank runs this; rank 0 also runs the hub, the weight sender and the metrics.

    `resume`: continue from the newest complete checkpoint in run.dir (learner/resume.py).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    # Its groups are destroyed at exit, before gloo's own teardown could abort a finished rank. DeepSpeed prints
    # "DeepSpeed ... built successfully" on stdout as it joins on a CPU: not news to anyone reading the screen.
    with contextlib.redirect_stdout(io.StringIO()):
        init_distributed()
    code = _run_rank(cfg, resume)
    exit_process(code)  # a clean finish ends here, before the interpreter's teardown (learner/train/distributed.py)
    return code


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
    if plan.placement.learner_ranks != topo.world:
        raise ConfigError(
            f"cluster: the plan has {plan.placement.learner_ranks} learner ranks "
            f"(learner_nodes x learner_gpus_per_node, or debug_gpus), torchrun started {topo.world}"
        )
    layout = UpdateLayout.of(plan)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    trainer = Trainer(cfg, model, topo, layout)
    checkpoint = None
    if resume:
        checkpoint = agree_on_checkpoint(topo, run_dir)
        check_compatible(read_learner_state(checkpoint), topo, cfg.train.zero_stage, layout.optimizer_steps)
        load_engines(trainer, checkpoint / STATE_DIR)
        log.info("learner.resumed_engines", checkpoint=str(checkpoint), optimizer_steps=trainer.engine.global_steps)
    if not topo.is_root:
        return _run_follower(cfg, topo, trainer, log)
    assert data is not None
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    log.info("learner.plan", text="\n" + render(plan))
    weights = WeightSource(cfg, trainer.engine, topo)
    return Root(cfg, topo, trainer, weights, tokenizer, data, plan.length.updates, run_dir, log, checkpoint).run()


def _run_follower(cfg: Config, topo: Topology, trainer: Trainer, log) -> int:
    """Ranks 1..N-1: train the share rank 0 hands out, join the weight snapshot and the checkpoints, until told to stop."""
    # torchrun hands a SIGTERM to every rank. A follower dying under rank 0's collectives would cost the final
    # checkpoint; it stops when rank 0 says so (its stop share), after joining that checkpoint. torchrun
    # SIGKILLs the ranks 30 s after the SIGTERM in any case.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    weights = WeightSource(cfg, trainer.engine, topo)
    weights.follow()  # rank 0's WeightSender.start
    updates = 0
    while True:
        share = scatter_shares(topo, None)
        if not share.stop:
            set_context(policy_version=share.version)  # rank 0's hub owns the version; the share carries it
            stats = trainer.update(share)
            if stats.applied_steps:  # rank 0 syncs only weights that moved; every rank knows the same count
                weights.follow()
            updates += 1
        if share.save_step:  # rank 0 writes the same checkpoint now (it decided before the update)
            save_engines(trainer, staging_dir(Path(cfg.run.dir), share.save_step) / STATE_DIR)
        if share.stop:
            break
    log.info("learner.done", rank=topo.rank, updates=updates)
    return 0
