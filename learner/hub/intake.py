"""Rank 0 takes the groups of one update from the hub (blocking, stoppable, optionally filtered), and settles
the update with the hub once it ran.

With algo.filter_equal_rewards, a group whose rewards are all equal carries no GRPO signal
(every advantage is 0): it is consumed (its prompt counts as trained, `groups_filtered`)
and the batch is topped up from the hub, as DAPO's dynamic sampling does. When a policy
solves (or fails) nearly everything, that could drain the prompt set without training;
after `MAX_FILTERED_BATCHES` batches' worth of filtered groups the update goes ahead with
uninformative groups in it, and says so.
"""

from __future__ import annotations

from learner.hub.records import Accepted
from learner.hub.server import Hub
from learner.train.advantages import informative_groups
from protocol.config import Config

MAX_FILTERED_BATCHES = 4


def wait_for_batch(hub: Hub, n: int, stop: dict, log, report_s: float = 30.0) -> list[Accepted] | None:
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


def take_update_batch(hub: Hub, cfg: Config, stop: dict, log) -> tuple[list[Accepted], list[Accepted]] | None:
    """(groups to train on, groups consumed by the filter); None when stopping (taken groups go back)."""
    import numpy as np
    import torch

    n = cfg.train.prompts_per_step
    kept: list[Accepted] = []
    filtered: list[Accepted] = []
    while len(kept) < n:
        batch = wait_for_batch(hub, n - len(kept), stop, log)
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


def settle_update(hub: Hub, items: list[Accepted], start: int, applied: int, failed: list[int], log) -> int:
    """After an update of S optimizer steps from version `start`: the version it reached, told to the hub.

    The version counts optimizer steps that reached the weights the actors get: `applied` of them. An update with
    a failed step (skipped by DeepSpeed, or a non-finite loss or gradient norm: learner/train/step_check.py) marks
    none of its prompts trained: they go back to the queue, to be generated afresh (the samples of its other steps
    did move the weights, which an honest version says, but the ledger never calls a prompt trained that a
    skipped step dropped)."""
    version = start + applied
    if failed:
        log.warning(
            "learner.step_skipped",
            steps=failed,
            applied=applied,
            version=version,
            requeued=len(items),
            detail="a non-finite loss or gradient: the update's prompts go back to the queue",
        )
        hub.abort_update(items, version)
    else:
        hub.finish_update(version, [item.key for item in items])
    return version
