"""Operating a running learner: live settings (`fleetrl ctl`, RUN_DIR/control.toml) and fleet status.

    fleetrl ctl set max_staleness 2 --> ControlRequest --> [hub ROUTER] --> apply() --> ControlReply
    echo 'max_staleness = 2' > RUN_DIR/control.toml --> hub housekeeping (1/s) --> apply() --> log
    fleetrl status                  --> StatusRequest  --> [hub ROUTER] --> status_reply() --> StatusReply

Everything here runs on the hub thread. A change of max_staleness applies to every batch taken
after it (Hub.take_batch checks each group against the k in force at the take) and to admission
at once; an update whose batch was already taken trains under the bound it was taken with
(Hub.batch_max_staleness). The file is polled rather than re-read on a signal: a signal handler
would run on the training thread, which may hold the hub's lock.
"""

from __future__ import annotations

import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from protocol import messages as m
from protocol.logs import get_logger

if TYPE_CHECKING:
    from learner.hub.server import ActorState, Hub

RATE_WINDOW_S = 30.0  # per-actor samples/s is measured over this window
RECENT_GROUPS = 512  # the staleness histogram covers this many recently taken groups


@dataclass(kw_only=True, slots=True)
class UpdateTimes:
    """The training thread's timings of its last update, for `fleetrl status` (Hub.note_update)."""

    updates: int = 0
    step_s: float = 0.0  # batch wait + train + weight sync
    syncs: int = 0
    sync_started: float = 0.0  # time.monotonic() when the last weight sync started
    sync_s: float = 0.0  # how long that sync held the learner up
    broadcast_s: float = 0.0  # the last finished background broadcast


def note_arrival(state: ActorState, now: float) -> None:
    """Caller holds the hub's lock: an accepted group from `state`; keeps only RATE_WINDOW_S of history."""
    state.arrivals.append(now)
    while state.arrivals[0] < now - RATE_WINDOW_S:
        state.arrivals.popleft()


def apply(hub: Hub, key: str, value: int, source: str) -> m.ControlReply:
    """Change one live setting; refused values leave it as it was and say why."""
    assert key in m.CONTROL_KEYS, key  # the codec's check() rejects unknown keys before this
    try:
        previous = hub.set_max_staleness(value, source=source)
    except ValueError as e:
        hub.log.warning("hub.control_refused", key=key, value=value, source=source, error=str(e))
        k = hub.max_staleness
        return m.ControlReply(ok=False, key=key, previous=k, value=k, policy_version=hub.version, detail=str(e))
    detail = (f"max_staleness {previous} -> {value} at version {hub.version}: admission now, and every batch taken from now on "
              f"(an update already running keeps the bound its batch was taken with)")
    return m.ControlReply(ok=True, key=key, previous=previous, value=value, policy_version=hub.version, detail=detail)


def status_reply(hub: Hub) -> m.StatusReply:
    now = time.monotonic()
    with hub.cond:
        actors = sorted(hub.actors.items())
        window = [min(RATE_WINDOW_S, max(now - s.joined_at, 1e-3)) for _, s in actors]
        rates = [sum(1 for t in s.arrivals if t >= now - RATE_WINDOW_S) * hub.cfg.rollout.samples_per_prompt / w
                 for (_, s), w in zip(actors, window, strict=True)]
        recent = list(hub.recent_staleness)
        states = hub.ledger.state_counts()
        times = hub.times
        return m.StatusReply(
            policy_version=hub.version, max_staleness=hub.max_staleness, steps_per_update=hub.steps, updates=times.updates,
            training=hub.training, uptime_s=now - hub.started, step_s=times.step_s, syncs=times.syncs,
            sync_age_s=now - times.sync_started if times.syncs else 0.0, sync_s=times.sync_s, broadcast_s=times.broadcast_s,
            buffered=len(hub.buffer), pending=states["pending"], granted=states["granted"], received=states["received"],
            trained=states["trained"], dropped_stale=hub.counters["dropped_stale"], staleness_window=RECENT_GROUPS,
            actor_ids=[a for a, _ in actors],
            actor_served_version=np.asarray([s.served_version for _, s in actors], np.int32),
            actor_samples_per_s=np.asarray(rates, np.float32),
            actor_groups=np.asarray([s.groups for _, s in actors], np.int32),
            actor_leases=np.asarray([len(s.held) for _, s in actors], np.int32),
            actor_heartbeat_age_s=np.asarray([now - s.last_seen for _, s in actors], np.float32),
            staleness_counts=np.bincount(np.asarray(recent, np.int64), minlength=1).astype(np.int32) if recent else np.zeros(0, np.int32),
        )


class ControlFile:
    """RUN_DIR/control.toml, the operator's way on the learner node: `max_staleness = 2`.

    Polled by the hub thread; applied each time the file changes (mtime or size) after the hub
    started. A file already there at start is not applied (the config decides the start; touch the
    file to apply it again). A bad file is logged once per change and ignored.
    """

    def __init__(self, path: Path):
        self.path = path
        self.log = get_logger()
        self.seen = self._signature()
        if self.seen is not None:
            self.log.info("hub.control_file_present", path=str(path), detail="not applied at start; touch it to apply")

    def _signature(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

    def poll(self, hub: Hub) -> list[m.ControlReply]:
        """Apply the file if it changed since the last poll; the replies, for the log and tests."""
        sig = self._signature()
        if sig is None or sig == self.seen:
            self.seen = sig
            return []
        self.seen = sig
        try:
            data = tomllib.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            self.log.error("hub.control_file_bad", path=str(self.path), error=str(e))
            return []
        replies = []
        for key, value in data.items():
            if key not in m.CONTROL_KEYS or type(value) is not int:
                self.log.error("hub.control_file_bad", path=str(self.path), key=key, value=value,
                               error=f"expected an integer setting, one of: {', '.join(m.CONTROL_KEYS)}")
                continue
            reply = apply(hub, key, value, source=f"file {self.path}")
            replies.append(reply)
        return replies
