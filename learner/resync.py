"""Re-sending the current weights while rank 0 waits for rollouts.

Weights go out after each update. If that broadcast reached no one (the only actor's link was down, or a
member died before joining a new group epoch, so every member's rendezvous timed out), or an actor came
back (re-registered) while the learner had nothing to train, then no actor serves the current version: the
hub grants nothing (grants need the current version), no update comes, and no regular sync ever follows.
Seen in tests/test_multihost.py: a lone actor cut for 10 s came back and the learner waited forever.

So while it waits for a batch, the learner re-sends its current version when a live actor has lagged
behind it for longer than a broadcast may take (weights.timeout_s + 1 s: by then the last one has finished
or failed). It re-sends the last snapshot: no collective, so no other learner rank is involved. The sender
forms a new group epoch when the membership changed (an actor joined, left, or registered again)
or the last broadcast failed.

A resumed learner (learner/resume.py) starts at its checkpoint's version with every actor serving -1:
it is built with that version and a `last_sync` a patience ago, so the first idle tick sends at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from learner.hub import Hub
from learner.weight_sync import WeightSender
from protocol.logs import get_logger


@dataclass(kw_only=True, slots=True)
class Resync:
    sender: WeightSender
    hub: Hub
    patience_s: float  # how long an actor may lag after a sync before the version is sent again
    version: int = 0  # the version last sent
    last_sync: float = field(default_factory=time.monotonic)
    count: int = 0  # re-sends so far (weights/resyncs)

    def synced(self, version: int) -> None:
        """The training loop sent `version` (a regular sync after an update)."""
        self.version, self.last_sync = version, time.monotonic()

    def __call__(self) -> None:
        """The wait loop's idle hook (about once a second while no batch is ready)."""
        if self.version == 0 or time.monotonic() - self.last_sync < self.patience_s:
            return  # version 0 is the weights every actor loads from model.path
        lagging = self.hub.lagging_actors(self.version)
        if not lagging:
            return
        get_logger().warning("weights.resync", version=self.version, lagging=lagging)
        self.sender.resend(self.version, self.hub)
        self.synced(self.version)
        self.count += 1
