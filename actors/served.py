"""The weights an actor's engine serves: their policy version, and applying a WeightSync to the engine.

    WeightSync -> offered (the newest group) -> apply: under the sync lock, skip a sync of an older group ->
        pause engine (keep in-flight) -> receive buckets -> load -> resume -> serve its version -> WeightVersion
    (a failed sync is logged and survived: the learner forms a new group epoch and sends again)

A sample's version_min is the version served when its generation started; the served version is bumped only after
new weights are loaded, so a sample is never tagged newer than the weights that produced it.

Learner lost (`forget`): the weights held may come from versions a resumed learner will train again differently,
so the engine serves version -1 until the next learner's sync, and its worker leaves the old weight group first (a
new learner has a new rendezvous). A sync begun before the loss does not set the version it loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from actors.engine import Engine
from protocol import messages as m
from protocol.logs import set_context


class ServedWeights:
    def __init__(self, actor_id: str, log: Any):
        self.actor_id, self.log = actor_id, log
        self.version = 0  # the weights in model.path are the learner's version 0
        self.changed = asyncio.Condition()  # notified when `version` is set
        self.newest_group: tuple[str, int, int] | None = None  # (store host, port, epoch) of the last WeightSync received
        self.lost = 0  # times the learner was lost; a sync started before a loss must not set `version`
        self.leave_group = False  # the worker must drop its weight group and store before the next sync
        self.synced = 0  # weight syncs applied
        self._lock = asyncio.Lock()  # one sync at a time, in the order received

    @property
    def syncing(self) -> bool:
        return self._lock.locked()

    def offered(self, sync: m.WeightSync) -> None:
        """A WeightSync arrived: syncs of older groups still queued behind the lock are skipped (`apply`)."""
        self.newest_group = (sync.store_host, sync.store_port, sync.group_epoch)

    def forget(self) -> None:
        """The learner is lost: distrust the weights (serve -1) and leave its weight group at the next sync."""
        self.lost += 1
        self.version = -1
        self.leave_group = True
        self.newest_group = None  # syncs of the lost learner still queued behind the sync lock are skipped
        set_context(policy_version=-1)

    async def serving(self, version: int) -> None:
        """Until the engine serves `version` (a grant's: the hub grants only what the weights it sent can make)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.version >= version)

    async def apply(self, sync: m.WeightSync, engine: Engine, send: Callable[[m.Message], Awaitable[None]]) -> bool:
        """Load `sync` into `engine` and `send` the hub its WeightVersion (under the lock: the hub hears the versions
        in the order they were loaded): whether the engine now serves sync.policy_version."""
        async with self._lock:
            if (sync.store_host, sync.store_port, sync.group_epoch) != self.newest_group:
                # The learner sends a new epoch only after it is done with the old one, so a sync of an older
                # group is abandoned (queued behind one that failed slowly, e.g. while our link was down):
                # joining it would cost a timeout. Within one group every broadcast must be received, in order.
                self.log.info("actor.weights_skipped", version=sync.policy_version, epoch=sync.group_epoch, newer=self.newest_group)
                return False
            t0 = time.perf_counter()
            lost, leave, self.leave_group = self.lost, self.leave_group, False
            result, paused_s = await engine.apply_weights(sync, leave_group=leave)
            if result.failed:
                # The group broke (a member died, the link to the learner was down, or the learner died). The
                # learner gives the epoch up and sends again in a new one (learner/weights/sync.py); until then we serve the
                # old version (or nothing, paused, if some buckets were loaded) and the hub grants us nothing newer.
                # A learner that is gone shows as a closed connection (actors/session.py), not here.
                self.log.warning(
                    "actor.weights_failed",
                    version=sync.policy_version,
                    epoch=sync.group_epoch,
                    served=self.version,
                    paused=result.torn,
                    **result.log_fields(),
                    paused_s=paused_s,
                )
                return False
            if lost != self.lost:  # weights of a learner that is gone: keep serving -1 until the next one's sync
                self.log.info("actor.stale_sync_ignored", version=sync.policy_version, epoch=sync.group_epoch)
                return False
            first = self.synced == 0
            self.synced += 1
            async with self.changed:
                self.version = sync.policy_version
                self.changed.notify_all()
            set_context(policy_version=sync.policy_version)
            load_s = time.perf_counter() - t0
            # The first sync is the join (a late joiner's catch-up); later ones are routine, every update.
            (self.log.info if first else self.log.debug)(
                "actor.weights_loaded",
                version=sync.policy_version,
                epoch=sync.group_epoch,
                load_s=round(load_s, 4),
                **result.log_fields(),
                paused_s=paused_s,
            )
            await send(
                m.WeightVersion(actor_id=self.actor_id, served_version=sync.policy_version, group_epoch=sync.group_epoch, load_s=load_s)
            )
        return True
