"""The training thread's side of the hub: the policy version, the staleness bound in force, the buffer of
admitted groups and the update being assembled from it. No I/O, no lock (HubState's caller holds it).

    hub thread:      admit(group) --> buffered, or too stale   capacity() --> how many prompts the dispatcher may grant
    training thread: take(n) --> (batch, dropped)  --> finish(version) | abort(version)
                     set_max_staleness(k)   note_update(timings)

The ledger is not here: HubState settles the prompts of what this drops, trains or aborts.
"""

from __future__ import annotations

from collections import deque

from learner import staleness as st
from learner.hub.core.records import RECENT_GROUPS, Accepted, UpdateTimes
from protocol.logs import get_logger


class Updates:
    def __init__(self, max_staleness: int, optimizer_steps: int):
        """`optimizer_steps`: optimizer steps (versions) per update, S = train.mini_batches x train.ppo_epochs."""
        self.log = get_logger()
        self.version = 0
        self.training = False  # an update is being assembled or trained: its versions are not out yet
        self.max_staleness = max_staleness
        self.optimizer_steps = optimizer_steps
        self.buffer: deque[Accepted] = deque()
        self.batch_max_staleness = max_staleness  # the k the current update's batch was checked with
        self.recent_staleness: deque[int] = deque(maxlen=RECENT_GROUPS)  # (u + S - 1) - v of taken groups
        self.times = UpdateTimes()

    def admissible(self, version_min: int) -> bool:
        """Whether a sample of `version_min` may still be trained on at the next update."""
        return st.admissible(self.version, version_min, self.max_staleness, self.optimizer_steps)

    def admit(self, item: Accepted) -> bool:
        """Buffer a received group; False if it is too stale already (versions only grow: it can never be used)."""
        if not self.admissible(item.group.version_min):
            return False
        self.buffer.append(item)
        return True

    def capacity(self, prompts_per_step: int, outstanding: int) -> int:
        """Prompts admission control lets the dispatcher grant now, with `outstanding` held by actors or buffered."""
        return st.admission_capacity(self.version, self.training, self.max_staleness, prompts_per_step, outstanding, self.optimizer_steps)

    def take(self, n: int) -> tuple[list[Accepted] | None, list[Accepted]]:
        """Drop buffered groups too stale for the next update; take the `n` oldest if there are that many.
        Returns (the batch or None, the dropped groups in buffer order: their prompts go back to the queue).

        Groups stay in the buffer, counted as outstanding by admission control, until the whole batch is there:
        taking them one by one would let the dispatcher over-grant while the batch fills.
        """
        ok = [i for i in self.buffer if self.admissible(i.group.version_min)]
        dropped = [i for i in self.buffer if not self.admissible(i.group.version_min)]
        if dropped:
            self.buffer = deque(ok)
        if len(self.buffer) < n:
            return None, dropped
        # Oldest versions first (stable in arrival order): they are the ones that would expire at the next update.
        # Arrival order alone drops late, older groups.
        batch = sorted(self.buffer, key=lambda i: i.group.version_min)[:n]
        taken = {id(i) for i in batch}
        self.buffer = deque(i for i in self.buffer if id(i) not in taken)
        # A top-up take (learner/update.py) joins an update already being assembled: its groups passed an earlier
        # take's k, so the update's bound is the largest k of its takes.
        k = self.max_staleness
        self.batch_max_staleness = max(self.batch_max_staleness, k) if self.training else k
        self.recent_staleness.extend(self.version + self.optimizer_steps - 1 - i.group.version_min for i in batch)
        self.training = True
        return batch, dropped

    def finish(self, version: int) -> None:
        """The update produced `version`; grants may resume."""
        self.version = version
        self.training = False

    def abort(self, version: int | None) -> None:
        """A failed update: `version` is where the steps it did apply took the weights (None: unchanged)."""
        if version is not None:
            assert version >= self.version, f"version {version} < {self.version}"
            self.version = version
        self.training = False

    def set_max_staleness(self, k: int, source: str) -> int:
        """Takes effect for admission at once and for every batch taken after it (learner/hub/core/control.py); returns
        the old k. Raises ValueError for a k even fresh samples would break."""
        if k < self.optimizer_steps - 1:
            raise ValueError(
                f"max_staleness: {k} < {self.optimizer_steps} optimizer steps per update - 1; even fresh samples would break it"
            )
        old, self.max_staleness = self.max_staleness, k
        self.log.info("hub.max_staleness_changed", old=old, new=k, version=self.version, source=source)
        return old

    def note_update(self, step_s: float, sync_started: float | None, sync_s: float, broadcast_s: float | None) -> None:
        """The training thread's timings of the update it just finished. `sync_started` is time.monotonic() at the
        start of the weight sync, None when there was none (every step skipped: nothing moved, nothing was sent);
        `broadcast_s` the duration of the last finished broadcast, None when there was none."""
        t = self.times
        t.updates, t.step_s = t.updates + 1, step_s
        if sync_started is None:
            return
        t.syncs, t.sync_started, t.sync_s = t.syncs + 1, sync_started, sync_s
        if broadcast_s is not None:
            t.broadcast_s = broadcast_s

    def restore(self, version: int, k: int) -> None:
        """Continue from a checkpoint taken at `version` under the bound `k`. Raises ValueError before changing anything."""
        if k < self.optimizer_steps - 1:
            raise ValueError(f"max_staleness: the checkpoint's {k} < {self.optimizer_steps} optimizer steps per update - 1")
        if k != self.max_staleness:
            self.log.info("hub.max_staleness_restored", config=self.max_staleness, checkpoint=k)
        self.version, self.max_staleness, self.batch_max_staleness = version, k, k
