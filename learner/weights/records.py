"""The weight sender's records: an attempt, a member's join across attempts, what serving a version took, and the
decisions learner/weights/state.py returns. Plain data, no rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocol import weights as wg

G = TypeVar("G")  # a weight group (torch.distributed.ProcessGroup); the decisions only hold it


@dataclass(kw_only=True, slots=True)
class Joining:
    """A member's join in one registration, across attempts cut short (SenderState.join_by)."""

    by: float  # when it must have joined (monotonic clock): the first attempt's deadline
    attempts: int = 0  # how many attempts it has been sent so far


@dataclass(kw_only=True, slots=True)
class Attempt:
    """One try at giving `version` to `members` in group epoch `epoch`."""

    version: int
    epoch: int
    members: list[str]  # member k holds ranks plan.first[k] .. plan.first[k] + plan.counts[k] - 1
    plan: wg.GroupPlan  # backend, world size, ranks
    new_group: bool  # the epoch is new: members join before the broadcast
    gens: dict[str, int]  # each member's registration count when the attempt began (a re-registered one lacks v)
    catchup: bool = False  # not the sync's own attempt: a stop (the optimizer step) gives it up instead of waiting for it
    joins_by: float = 0.0  # new epoch: when every member must have joined (monotonic clock; WeightSyncs sent + join_timeout_s)
    # Members on probation (learner/weights/membership.py): their epoch's group is used for this attempt only, and
    # the sender's group (the everyone epoch, reused by the next sync) is kept meanwhile.
    side: bool = False
    # Its failure repeats what an earlier attempt of the same members' registrations logged: cut short again before
    # they joined, or at the deadline that evicts them (hub.actor_removed counts the attempts). Logged at debug.
    repeat: bool = False
    joining: dict[str, Joining] = field(default_factory=dict)  # new epoch: each member's join, from SenderState.joining


@dataclass(kw_only=True, slots=True)
class Serving:
    """What serving one version took, reported by the next `wait`."""

    version: int
    broadcast_s: float | None = None  # the first complete attempt (normally the sync's own)
    failed: int = 0  # attempts given up
    catchups: int = 0  # complete attempts after the first: newcomers, and survivors of a failed one
    epochs: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Begin(Generic[G]):
    """An attempt begun, and the everyone epoch's group it replaces (with its backend), for the caller to close."""

    attempt: Attempt
    close: tuple[G, str] | None = None


@dataclass(slots=True)
class Late:
    """Members that missed the join deadline: whom to evict (with why), and why the attempt ends."""

    evict: dict[str, str]
    why: str
