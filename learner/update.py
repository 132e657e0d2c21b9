"""Rank 0's update, top to bottom: take a rollout batch from the hub, train it on every rank, settle it with the hub.

    take_batch   block until prompts_per_step admissible groups are buffered (stoppable by SIGTERM);
                 with algo.filter_equal_rewards, groups whose rewards are all equal are consumed and the batch
                 topped up from the hub
    shares       group advantages, samples cut into one share per DP rank (learner/train/shard.py: make_shares);
                 a batch no model could train on is refused here, before any other rank sees it
    train        scatter the shares; every rank runs S = mini_batches x ppo_epochs optimizer steps (Trainer.update)
    settle       the hub's policy version += the steps that reached the weights; the ledger marks the prompts
                 trained, or requeues them all if a step failed; grants resume

The hub owns the policy version (HubState.version): it checks staleness against it, a checkpoint stores it,
and rank 0 hands it to the other ranks in each share. Nothing else keeps a copy.

Filtering: a group whose rewards are all equal carries no GRPO signal (every advantage is 0). It is consumed (its
prompt counts as trained, `groups_filtered`) and the batch is topped up, as DAPO's dynamic sampling does. When a
policy solves (or fails) nearly everything, that could drain the prompt set without training; after
`MAX_FILTERED_BATCHES` batches' worth of filtered groups the update goes ahead with uninformative groups in it,
and says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from learner.hub.core.ledger import Key
from learner.hub.core.records import Accepted
from learner.train.advantages import informative_groups
from learner.train.batch import InvalidBatch
from learner.train.distributed import Topology
from learner.train.shard import make_shares, scatter_shares
from learner.train.trainer import Trainer, UpdateStats
from protocol.config import Config

MAX_FILTERED_BATCHES = 4


class UpdateHub(Protocol):
    """What an update needs of the hub (learner/hub/server.py's Hub)."""

    @property
    def version(self) -> int: ...
    @property
    def batch_max_staleness(self) -> int: ...
    def take_batch(self, n: int, timeout_s: float | None = None) -> list[Accepted]: ...
    def left_to_train(self) -> int | None: ...
    def snapshot(self) -> dict[str, float]: ...
    def finish_update(self, version: int, trained: list[Key]) -> None: ...
    def abort_update(self, batch: list[Accepted], version: int | None = None) -> None: ...


@dataclass(kw_only=True, slots=True)
class Update:
    """One settled update."""

    batch: list[Accepted]  # the groups trained on
    filtered: list[Accepted]  # the groups the filter consumed
    stats: UpdateStats
    advantages: torch.Tensor  # [groups, samples] rank 0's group advantages (zeros under GAE)
    start: int  # the policy version the update started from
    version: int  # the version it reached: start + stats.applied_steps
    max_staleness: int  # the bound its batch was checked with
    wait_s: float  # blocked in take_batch
    train_s: float  # shares, scatter and the update itself

    @property
    def groups(self) -> list:
        return [item.group for item in self.batch]


def run_update(hub: UpdateHub, trainer: Trainer, cfg: Config, topo: Topology, stop: dict, log, save_step: int) -> Update | str | None:
    """Take, train and settle one update. None: stopping before a batch was taken (nothing to settle). A string: the
    batch was refused before the scatter (learner/train/batch.py says why); its prompts are back in the queue.
    `save_step`: every rank saves its training state into that checkpoint after the update (0: none)."""
    t0 = time.perf_counter()
    taken = take_batch(hub, cfg, stop, log)
    if taken is None:
        return None
    batch, filtered = taken
    t_wait = time.perf_counter() - t0
    start = hub.version
    k = hub.batch_max_staleness  # not hub.max_staleness: `fleetrl ctl` may have changed it since the take
    groups = [item.group for item in batch]
    try:
        shares, advantages = make_shares(cfg, groups, start, k, topo.dp_size, vocab_size=trainer.vocab_size)
        for share in shares:
            share.save_step = save_step
        stats = trainer.update(scatter_shares(topo, shares))
    except InvalidBatch as e:  # raised before the scatter: no other rank saw the batch, none waits on it
        hub.abort_update(batch + filtered)
        log.error("learner.batch_refused", error=str(e), groups=len(batch), requeued=len(batch) + len(filtered))
        return str(e)
    except Exception:
        hub.abort_update(batch + filtered)
        raise
    t_train = time.perf_counter() - t0 - t_wait
    settle(hub, batch + filtered, start, stats.applied_steps, stats.failed_steps, log)
    return Update(
        batch=batch,
        filtered=filtered,
        stats=stats,
        advantages=advantages,
        start=start,
        version=hub.version,
        max_staleness=k,
        wait_s=t_wait,
        train_s=t_train,
    )


def wait_for_batch(hub: UpdateHub, n: int, stop: dict, log, report_s: float = 30.0, held: int = 0) -> list[Accepted] | None:
    """take_batch, but wakes up to honour SIGTERM and to say what it waits for. None when stopping, and when the data
    can no longer give `n` more groups (every epoch of data.epochs opened, fewer than `n` untrained prompts besides
    the `held` this batch already took): then stop["exhausted"] is set, and the run ends as finished."""
    waited = 0.0
    while not stop["flag"]:
        try:
            return hub.take_batch(n, timeout_s=1.0)
        except TimeoutError:
            waited += 1.0
            if (left := hub.left_to_train()) is not None and left - held < n:
                log.warning("learner.data_exhausted", untrained=left, need=n, detail="every epoch of data.epochs is out: the run ends here")
                stop.update(flag=True, exhausted=True)
                return None
            if waited % report_s == 0:
                snap = hub.snapshot()
                log.info("learner.waiting_for_rollouts", waited_s=waited, actors=snap["hub/actors"], buffered=snap["hub/buffered"], need=n)
    return None


def take_batch(hub: UpdateHub, cfg: Config, stop: dict, log) -> tuple[list[Accepted], list[Accepted]] | None:
    """(groups to train on, groups consumed by the filter); None when stopping (taken groups go back)."""
    n = cfg.train.prompts_per_step
    kept: list[Accepted] = []
    filtered: list[Accepted] = []
    while len(kept) < n:
        batch = wait_for_batch(hub, n - len(kept), stop, log, held=len(kept) + len(filtered))
        if batch is None:
            hub.abort_update(kept + filtered)
            return None
        if not cfg.algo.filter_equal_rewards:
            return batch, []
        rewards = torch.from_numpy(np.stack([item.group.rewards for item in batch]).astype(np.float32))
        for item, useful in zip(batch, informative_groups(rewards).tolist(), strict=True):
            (kept if useful else filtered).append(item)
        if len(filtered) >= MAX_FILTERED_BATCHES * n and len(kept) < n:
            log.warning(
                "learner.filter_exhausted",
                filtered=len(filtered),
                kept=len(kept),
                detail="training on uninformative groups to keep the update size",
            )
            need = n - len(kept)
            kept, filtered = kept + filtered[:need], filtered[need:]
    return kept, filtered


def settle(hub: UpdateHub, items: list[Accepted], start: int, applied: int, failed: list[int], log) -> None:
    """After an update of S optimizer steps from version `start`: tell the hub the version it reached.

    The version counts optimizer steps that reached the weights the actors get: `applied` of them. An update with
    a failed step (skipped by DeepSpeed, or a non-finite loss or gradient norm: learner/train/step_check.py) marks
    none of its prompts trained: they go back to the queue, to be generated afresh (the samples of its other steps
    did move the weights, which an honest version says, but the ledger never calls a prompt trained that a
    skipped step dropped)."""
    version = start + applied
    if failed:
        log.warning(
            "learner.optimizer_step_skipped",
            optimizer_steps=failed,
            applied=applied,
            version=version,
            requeued=len(items),
            detail="a non-finite loss or gradient: the update's prompts go back to the queue",
        )
        hub.abort_update(items, version)
    else:
        hub.finish_update(version, [item.key for item in items])
