"""What the hub keeps per actor and per admitted group, what it sends, and its constants: plain records, no rules
(the rules are in learner/hub/core/state.py and its parts: registry.py, groups.py, dispatch.py, updates.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from learner.hub.core.ledger import Key
from protocol import messages as m

MAX_DETAIL = 300  # characters of an error reply: a decode error may quote the peer's input, which may be huge
RATE_WINDOW_S = 30.0  # per-actor samples/s is measured over this window
RECENT_GROUPS = 512  # the staleness histogram covers this many recently taken groups


@dataclass(slots=True)
class ActorState:
    identity: bytes  # ZeroMQ routing id of the actor's DEALER
    last_seen: float
    served_version: int
    demand: int = 0  # prompts it may still be granted: its capacity minus `held` when it last asked
    held: set[Key] = field(default_factory=set)
    groups: int = 0  # groups accepted from it
    joined_at: float = 0.0
    first_version: int | None = None  # version_min of its first admissible group (a late joiner's must be current)
    key: str | None = None  # name of the CURVE key that registered it (None: CURVE off); only that key may replace it
    arrivals: deque[float] = field(default_factory=deque)  # accept times, last RATE_WINDOW_S (samples/s)
    devices: list[str] = field(default_factory=lambda: [""])  # Register.devices: its weight-group ranks' devices
    silent: bool = False  # not heard from for hub.silent_s: its leases go back to the queue (HubState.tick)

    def note_arrival(self, now: float) -> None:
        """An accepted group; keeps only RATE_WINDOW_S of history."""
        self.arrivals.append(now)
        while self.arrivals[0] < now - RATE_WINDOW_S:
            self.arrivals.popleft()


@dataclass(slots=True)
class Accepted:
    """A rollout group in the buffer, with the ledger key it settles."""

    key: Key
    group: m.RolloutGroup
    arrived: float


@dataclass(frozen=True, slots=True)
class Out:
    """A message for one peer. A reply (an Error, a RegisterAck) is dropped when the peer's queue is full, never
    waited for: a peer that sends without reading must not hold up the hub. A grant is waited for, briefly."""

    identity: bytes
    msg: m.Message
    reply: bool = True


@dataclass(kw_only=True, slots=True)
class UpdateTimes:
    """The training thread's timings of its last update, for `fleetrl status` (Updates.note_update)."""

    updates: int = 0
    step_s: float = 0.0  # batch wait + train + weight sync
    syncs: int = 0
    sync_started: float = 0.0  # time.monotonic() when the last weight sync started
    sync_s: float = 0.0  # how long that sync held the learner up
    broadcast_s: float = 0.0  # the last finished background broadcast


def error_reply(identity: bytes, code: str, detail: str) -> Out:
    return Out(identity, m.Error(code=code, detail=detail[:MAX_DETAIL]))
