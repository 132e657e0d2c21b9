"""`fleetrl learner`: the learner process (rank 0 also runs the hub).

    loop:  take a batch of admissible groups (blocks)  ->  update (DeepSpeed)  ->  version += 1
           ->  ledger: trained; grants resume  ->  broadcast weights to the actors  ->  metrics
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from learner.data import load_prompts
from learner.hub import Hub
from learner.metrics import MetricsWriter
from learner.weight_sync import WeightSender
from protocol.config import Config, dump_toml, parse_cpus
from protocol.logs import set_context, setup_logging
from protocol.net import pin_cpus


def wait_for_batch(hub: Hub, n: int, stop: dict, log, report_s: float = 30.0):
    """take_batch, but wakes up to honour SIGTERM and to say what it waits for. None when stopping."""
    waited = 0.0
    while not stop["flag"]:
        try:
            return hub.take_batch(n, timeout_s=1.0)
        except TimeoutError:
            waited += 1.0
            if waited % report_s == 0:
                snap = hub.snapshot()
                log.info("learner.waiting_for_rollouts", waited_s=waited, actors=snap["hub/actors"], buffered=snap["hub/buffered"], need=n)
    return None


def run_learner(cfg: Config) -> int:
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    log = setup_logging("learner", run_dir / "logs" / "learner.jsonl", policy_version=0)
    if not cfg.model.path:
        raise ValueError("model.path: empty; point it at a Hugging Face model folder (`fleetrl demo` builds one)")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    pin_cpus(parse_cpus(cfg.train.cpu_affinity, "train.cpu_affinity"))
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.run.seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.trainer import Trainer, init_distributed

    init_distributed()
    if torch.distributed.get_world_size() != 1:
        raise ValueError("the learner runs as one process for now; multi-rank data/sequence parallelism is issue #3")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    prompts = load_prompts(cfg.data, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=getattr(torch, cfg.model.dtype))
    trainer = Trainer(cfg, model)
    hub = Hub(cfg, prompts)
    hub.start()
    sender = WeightSender(cfg.weights, trainer.named_parameters(), cfg.model.dtype)
    sender.guard(trainer.engine.optimizer)  # broadcast from the parameters in place; the next step waits for it
    metrics = MetricsWriter(run_dir)
    log.info("learner.ready", prompts=len(prompts), params=sum(p.numel() for p in model.parameters()), hub=cfg.hub.bind, weight_port=sender.port)

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    t_start = time.perf_counter()
    version = 0
    try:
        while version < cfg.train.total_steps and not stop["flag"]:
            t0 = time.perf_counter()
            batch = wait_for_batch(hub, cfg.train.prompts_per_step, stop, log)
            if batch is None:
                break
            t_wait = time.perf_counter() - t0
            k = hub.max_staleness
            try:
                stats = trainer.update(batch, version, k)
            except Exception:
                hub.abort_update(batch)
                raise
            t_train = time.perf_counter() - t0 - t_wait
            version += 1
            set_context(policy_version=version)
            hub.finish_update(version, [item.key for item in batch])
            sync = sender.sync(version, hub)
            step_s = time.perf_counter() - t0
            row = {
                "step": version, "policy_version": version, "reward_mean": stats.reward_mean, "samples": stats.samples,
                "staleness_max": stats.staleness_max, "staleness_mean": stats.staleness_mean,
                "logprob_mismatch": stats.logprob_mismatch, "on_policy_tokens": stats.on_policy_tokens,
                "tokens_per_s": stats.tokens / step_s, "samples_per_s": stats.samples / step_s,
                "wall_s": time.perf_counter() - t_start, "loss": stats.loss, "clip_frac": stats.clip_frac,
                "grad_norm": stats.grad_norm, "adv_abs_mean": stats.adv_abs_mean, "max_staleness": k,
                "time/wait": t_wait, "time/train": t_train, "time/step": step_s, **sync, **hub.snapshot(),
            }
            metrics.write(row)
            log.info("learner.step", step=version, reward=round(stats.reward_mean, 3), staleness_max=stats.staleness_max,
                     mismatch=None if stats.on_policy_tokens == 0 else float(f"{stats.logprob_mismatch:.2e}"),
                     wait_s=round(t_wait, 2), train_s=round(t_train, 2), sync_s=round(sync["time/weight_sync"], 3), broadcast_s=round(sync.get("time/broadcast", 0.0), 3))
    finally:
        sender.wait()
        hub.stop("run finished" if version >= cfg.train.total_steps else "learner stopping")
        metrics.close()
        plot = metrics.plot()
        hub.ledger.check()
        log.info("learner.done", steps=version, wall_s=round(time.perf_counter() - t_start, 1), plot=str(plot), ledger=hub.ledger.state_counts())
    return 0
