"""Actors that keep sending groups the hub refuses: counted over a window, then shut out for a while.

    refused group --strike(actor, now)--> strikes in the last hub.quarantine_window_s
        >= hub.quarantine_after --> quarantined for hub.quarantine_s: its id and its connection are refused

A ROUTER socket cannot close one peer, so "disconnect" is: forget the actor (its grants go back to the
queue), answer every further message from its connection, and every Register of its id from any
connection, with Error "quarantined". A key holder can still come back under a new id on a new
connection; it starts with no strikes and is quarantined again after as many refused groups, each
refused and none trained. Revoking its CURVE key (docs/security.md) shuts it out for good.
A checkpoint keeps the quarantined ids with the time each has left (export/restore): a learner that resumes
goes on refusing them. Strikes and connections are not kept (a restarted hub's connections are new). No clock
here: the caller passes `now`.
"""

from __future__ import annotations

from collections import deque


class Quarantine:
    def __init__(self, after: int, window_s: float, duration_s: float):
        self.after = after  # 0: never quarantine
        self.window_s = window_s
        self.duration_s = duration_s
        self._strikes: dict[str, deque[float]] = {}  # actor id -> times of its refused groups, the last window_s
        self._ids: dict[str, float] = {}  # quarantined actor id -> until
        self._identities: dict[bytes, float] = {}  # its connection's routing id -> until

    def strike(self, actor_id: str, now: float) -> int | None:
        """A refused group from `actor_id`. Returns the strikes in the window when they reach the limit (the
        caller then quarantines it with `add`), else None."""
        times = self._strikes.setdefault(actor_id, deque())
        times.append(now)
        while times[0] <= now - self.window_s:
            times.popleft()
        return len(times) if self.after and len(times) >= self.after else None

    def add(self, actor_id: str, identity: bytes, now: float) -> None:
        until = now + self.duration_s
        self._ids[actor_id], self._identities[identity] = until, until
        self._strikes.pop(actor_id, None)

    def refuses_id(self, actor_id: str, now: float) -> bool:
        return self._ids.get(actor_id, now) > now

    def refuses_identity(self, identity: bytes, now: float) -> bool:
        return self._identities.get(identity, now) > now

    def expire(self, now: float) -> None:
        """Forget quarantines that ended and strikes out of the window (bounds the memory these take)."""
        self._ids = {a: t for a, t in self._ids.items() if t > now}
        self._identities = {i: t for i, t in self._identities.items() if t > now}
        self._strikes = {a: t for a, t in self._strikes.items() if t[-1] > now - self.window_s}

    def export(self, now: float) -> dict[str, float]:
        """Quarantined actor id -> seconds it has left (clocks do not survive a restart; durations do)."""
        return {a: round(t - now, 3) for a, t in self._ids.items() if t > now}

    def restore(self, left: dict[str, float], now: float) -> None:
        self._ids.update({a: now + float(s) for a, s in left.items() if float(s) > 0})
