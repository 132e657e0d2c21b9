"""The operator's messages: `fleetrl ctl` and `fleetrl status` (part of protocol/messages.py's MESSAGE_TYPES)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from protocol.message_base import Message, ProtocolError

# ---- operations: `fleetrl ctl` and `fleetrl status` ------------------------------------------------
# An operator's client (a DEALER, protocol.transport.client_socket) talks to the hub's ROUTER: one request,
# one reply. It never registers; it is not an actor.
CONTROL_KEYS = ("max_staleness",)  # settings `fleetrl ctl set` may change in a running learner


@dataclass(kw_only=True, slots=True)
class ControlRequest(Message):
    """ops client -> hub: change a setting of the running learner (`fleetrl ctl set max_staleness 2`)."""

    command: str  # "set" (the only command so far)
    key: str  # one of CONTROL_KEYS
    value: int  # the new value (max_staleness: k, in policy versions)

    def check(self) -> None:
        if self.command != "set":
            raise ProtocolError(f"ControlRequest.command: {self.command!r} unknown (known: set)")
        if self.key not in CONTROL_KEYS:
            raise ProtocolError(f"ControlRequest.key: {self.key!r} unknown (known: {', '.join(CONTROL_KEYS)})")


@dataclass(kw_only=True, slots=True)
class ControlReply(Message):
    """hub -> ops client: whether the change was applied, and the setting's value now."""

    ok: bool  # false: refused (value unchanged); `detail` says why
    key: str
    previous: int  # the value before the request
    value: int  # the value in force now (== previous when refused)
    policy_version: int  # learner version when the request was handled
    detail: str  # what happened, for the operator


@dataclass(kw_only=True, slots=True)
class StatusRequest(Message):
    """ops client -> hub: ask for one StatusReply (`fleetrl status`)."""


@dataclass(kw_only=True, slots=True)
class StatusReply(Message):
    """hub -> ops client: one snapshot of the learner and its fleet.

    Per-actor arrays have one entry per actor, in the order of `actor_ids`. `staleness_counts[s]` counts
    the last `staleness_window` (at most) groups taken for training whose staleness was s, measured as the
    bound measures it: (u + S - 1) - v for a batch taken at version u, S optimizer steps per update,
    sample version v.
    """

    ARRAYS: ClassVar[dict[str, tuple[str, int]]] = {
        "actor_served_version": ("int32", 1),
        "actor_samples_per_s": ("float32", 1),
        "actor_groups": ("int32", 1),
        "actor_leases": ("int32", 1),
        "actor_heartbeat_age_s": ("float32", 1),
        "staleness_counts": ("int32", 1),
    }
    policy_version: int  # learner's version (optimizer steps taken)
    max_staleness: int  # k in force now
    steps_per_update: int  # S = mini_batches x ppo_epochs
    updates: int  # updates finished
    training: bool  # an update is being assembled or trained
    uptime_s: float  # seconds since the hub started
    step_s: float  # wall time of the last update (batch wait + train + weight sync); 0 before the first
    syncs: int  # weight syncs so far (the fields below are 0 before the first)
    sync_age_s: float  # seconds since the last weight sync started
    sync_s: float  # seconds the last weight sync held the learner up (snapshot, WeightSync messages)
    broadcast_s: float  # seconds the last finished background broadcast took
    buffered: int  # accepted groups waiting for a batch
    pending: int  # ledger: prompts waiting to be granted (opened epochs only)
    granted: int  # ledger: prompts held by actors
    received: int  # ledger: prompts whose group arrived, not yet trained
    trained: int  # ledger: prompts trained on
    dropped_stale: int  # groups the staleness check dropped since the start (their prompts went back)
    staleness_window: int  # the histogram covers at most this many recent groups
    actor_ids: list[str]
    actor_served_version: np.ndarray  # int32 [actors]: the version each engine serves
    actor_samples_per_s: np.ndarray  # float32 [actors]: accepted samples per second over the last 30 s (learner.hub.core.control)
    actor_groups: np.ndarray  # int32 [actors]: groups accepted from it since it registered
    actor_leases: np.ndarray  # int32 [actors]: prompts it holds now
    actor_heartbeat_age_s: np.ndarray  # float32 [actors]: seconds since the hub last heard from it
    staleness_counts: np.ndarray  # int32 [max staleness seen + 1]

    def check(self) -> None:
        n = len(self.actor_ids)
        for name in ("actor_served_version", "actor_samples_per_s", "actor_groups", "actor_leases", "actor_heartbeat_age_s"):
            if getattr(self, name).shape[0] != n:
                raise ProtocolError(f"StatusReply.{name}: {getattr(self, name).shape[0]} entries for {n} actors")
        if (self.staleness_counts < 0).any() or int(self.staleness_counts.sum()) > self.staleness_window:
            raise ProtocolError(f"StatusReply.staleness_counts: negative, or more than {self.staleness_window} groups")
        if self.steps_per_update < 1 or self.max_staleness < 0:
            raise ProtocolError(f"StatusReply: steps_per_update={self.steps_per_update}, max_staleness={self.max_staleness}")
