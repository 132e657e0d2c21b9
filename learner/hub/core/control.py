"""Operating a running learner: live settings (`fleetrl ctl`, RUN_DIR/control.toml) and fleet status.

    fleetrl ctl set max_staleness 2 --> ControlRequest --> [hub ROUTER] --> apply() --> ControlReply
    echo 'max_staleness = 2' > RUN_DIR/control.toml --> hub housekeeping (1/s) --> apply() --> log
    fleetrl status                  --> StatusRequest  --> [hub ROUTER] --> status_reply() --> StatusReply

Everything here runs on the hub thread, under the hub's lock. A change of max_staleness applies to
every batch taken after it (Updates.take checks each group against the k in force at the take)
and to admission at once; an update whose batch was already taken trains under the bound it was
taken with (Updates.batch_max_staleness). The file is polled rather than re-read on a signal: a signal handler
would run on the training thread, which may hold the hub's lock.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import numpy as np

from learner.hub.core.records import RATE_WINDOW_S, RECENT_GROUPS
from learner.hub.core.state import HubState
from protocol import messages as m
from protocol.logs import get_logger


def apply(hub: HubState, key: str, value: int, source: str) -> m.ControlReply:
    """Caller holds the hub's lock. Change one live setting; refused values leave it as it was and say why."""
    assert key in m.CONTROL_KEYS, key  # the codec's check() rejects unknown keys before this
    try:
        previous = hub.updates.set_max_staleness(value, source=source)
    except ValueError as e:
        hub.log.warning("hub.control_refused", key=key, value=value, source=source, error=str(e))
        k = hub.max_staleness
        return m.ControlReply(ok=False, key=key, previous=k, value=k, policy_version=hub.version, detail=str(e))
    detail = (
        f"max_staleness {previous} -> {value} at version {hub.version}: admission now, and every batch taken from now on "
        f"(an update already running keeps the bound its batch was taken with)"
    )
    return m.ControlReply(ok=True, key=key, previous=previous, value=value, policy_version=hub.version, detail=detail)


def status_reply(hub: HubState, now: float) -> m.StatusReply:
    """Caller holds the hub's lock."""
    actors = sorted(hub.actors.items())
    window = [min(RATE_WINDOW_S, max(now - s.joined_at, 1e-3)) for _, s in actors]
    rates = [
        sum(1 for t in s.arrivals if t >= now - RATE_WINDOW_S) * hub.cfg.rollout.samples_per_prompt / w
        for (_, s), w in zip(actors, window, strict=True)
    ]
    recent = list(hub.updates.recent_staleness)
    states = hub.ledger.state_counts()
    times = hub.updates.times
    return m.StatusReply(
        policy_version=hub.version,
        max_staleness=hub.max_staleness,
        steps_per_update=hub.optimizer_steps,
        updates=times.updates,
        training=hub.training,
        uptime_s=now - hub.started,
        step_s=times.step_s,
        syncs=times.syncs,
        sync_age_s=now - times.sync_started if times.syncs else 0.0,
        sync_s=times.sync_s,
        broadcast_s=times.broadcast_s,
        buffered=len(hub.buffer),
        pending=states["pending"],
        granted=states["granted"],
        received=states["received"],
        trained=states["trained"],
        dropped_stale=hub.counters["dropped_stale"],
        staleness_window=RECENT_GROUPS,
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

    def poll(self) -> list[tuple[str, int]]:
        """The settings to apply (with `apply`), if the file changed since the last poll."""
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
        settings = []
        for key, value in data.items():
            if key not in m.CONTROL_KEYS or type(value) is not int:
                self.log.error(
                    "hub.control_file_bad",
                    path=str(self.path),
                    key=key,
                    value=value,
                    error=f"expected an integer setting, one of: {', '.join(m.CONTROL_KEYS)}",
                )
                continue
            settings.append((key, value))
        return settings
