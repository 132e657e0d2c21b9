"""The weight sender's decisions with no I/O: who holds which version, who goes into which group epoch (a reused
one or a new one), who is late to join it and whom to evict, and why an attempt in flight must end.

    hub thread       on_membership(actor, joined) ---> registrations, holds, probation; an abort reason
    training thread  start_serving(live) ------------> the sync's own members (probation after)
    serving thread   next_members(version, live) ----> whom to serve next
                     begin(version, members, ...) ---> Attempt in the last epoch or a new one (+ the group it replaces)
                     sent(att, live, now) -----------> its join deadline; an abort if a member left meanwhile
                     joining / overdue / late -------> the join deadline across attempts; whom to evict
                     cut_short / settle -------------> which deadlines carry over to the next attempt
                     connected / connect_failed -----> probation (learner/weights/membership.py); whom to evict
                     served / gave_up / ended -------> who holds the version; the group to close

No socket, store, group call, thread, lock or clock of its own: the caller passes the time and holds its
lock (learner/weights/sync.py owns it; learner/weights/fleet.py says why the listener only records), so
every rule here is unit-tested by calling it (tests/unit/test_weight_state.py). The groups themselves are
opaque here (`G`): the state only says which one to keep and which one to close.
"""

from __future__ import annotations

from collections import Counter
from typing import Generic

from learner.weights.membership import Membership
from learner.weights.records import Attempt, Begin, G, Joining, Late
from protocol import weights as wg
from protocol.config.fleet import GLOO_MESH_RANKS


class SenderState(Generic[G]):
    def __init__(self, identity: str, join_timeout_s: float, mesh_ranks: int = GLOO_MESH_RANKS):
        """`identity`: the learner's device identity, what plan_group compares with the members' devices;
        `mesh_ranks`: weights.gloo_mesh_ranks, past which a gloo epoch connects lazily."""
        self.identity = identity
        self.join_timeout_s = join_timeout_s
        self.mesh_ranks = mesh_ranks
        self.epoch = 0  # the last epoch number given out
        self.members: list[str] = []  # of `group`
        self.group: G | None = None  # the everyone epoch's, once it connected
        self.group_epoch = 0  # of `group` (epochs of probation members' own come and go beside it)
        self.plan: wg.GroupPlan | None = None  # of `group`
        self.stale = False  # a member of `group` left or re-registered: the next attempt needs a new epoch
        self.holds: dict[str, int] = {}  # actor -> the version it was given (this registration)
        self.gens: Counter[str] = Counter()  # registrations and removals seen per actor id
        self.membership = Membership()  # who is on probation (kept out of the sync's own epoch)
        # (actor, registration) -> its deadline (the first attempt's) and attempts so far, kept across attempts cut
        # short (a catch-up ends when the next update begins), so a member that never joins is evicted once its
        # join_timeout_s has passed in all, not never (a step shorter than the deadline ended every attempt early).
        self.join_by: dict[tuple[str, int], Joining] = {}
        self.attempt: Attempt | None = None  # in flight
        self.abort_why: str | None = None  # set when a member of the attempt in flight is removed

    # ---- what the hub saw -------------------------------------------------------------------------------
    def on_membership(self, actor: str, joined: bool) -> None:
        """`actor` registered (joined; also again under its id) or was removed."""
        self.join_by.pop((actor, self.gens[actor]), None)  # that registration is over
        self.gens[actor] += 1
        self.holds.pop(actor, None)
        if joined:
            self.membership.registered(actor)
        else:
            self.membership.removed(actor)
        if actor in self.members:
            self.stale = True
        att = self.attempt
        if not joined and att is not None and actor in att.members and self.abort_why is None:
            self.abort_why = f"member {actor} was removed by the hub"

    # ---- whom to serve, in which epoch ------------------------------------------------------------------
    def start_serving(self, live: list[str]) -> list[str]:
        """A sync: its own members are the live actors not on probation; from now on a newcomer is on probation."""
        members = self.membership.regular(live)
        self.membership.serving = True
        return members

    def next_members(self, version: int, live: list[str]) -> list[str]:
        """Whom to serve `version` next: the live actors that lack it, regular members before those on probation."""
        lacking = [a for a in live if self.holds.get(a) != version]
        return self.membership.next_group(lacking) if lacking else []

    def begin(self, version: int, members: list[str], devices: list[list[str]], catchup: bool = False) -> Begin[G]:
        """An attempt for `members` (with their `devices`): the everyone epoch again when it is exactly them and
        intact, an epoch of their own when one is on probation, else a new everyone epoch."""
        side = any(a in self.membership.probation for a in members)
        reuse = not side and self.group is not None and not self.stale and members == self.members and self.plan is not None
        close: tuple[G, str] | None = None
        if reuse:
            assert self.plan is not None
            plan, epoch = self.plan, self.group_epoch
        elif side:
            plan = wg.plan_group(self.identity, list(zip(members, devices, strict=True)), self.mesh_ranks)
            self.epoch += 1
            epoch = self.epoch
        else:
            # The old group has nothing in flight (a failed attempt already dropped it): it can go.
            if self.group is not None and self.plan is not None:
                close = (self.group, self.plan.backend)
            plan = wg.plan_group(self.identity, list(zip(members, devices, strict=True)), self.mesh_ranks)
            self.group, self.members, self.plan, self.stale = None, list(members), plan, False
            self.epoch += 1
            epoch = self.group_epoch = self.epoch
        att = Attempt(
            version=version,
            epoch=epoch,
            members=list(members),
            plan=plan,
            new_group=not reuse,
            gens={a: self.gens[a] for a in members},
            catchup=catchup,
            side=side,
        )
        self.attempt, self.abort_why = att, None
        return Begin(att, close)

    def sent(self, att: Attempt, live: list[str], now: float) -> None:
        """The WeightSyncs went out at `now`: the join deadline runs from here. A member missing from `live` was
        removed before the attempt was registered (the listener could not tell it): the attempt must end."""
        att.joins_by = now + self.join_timeout_s
        gone = set(att.members) - set(live)
        if gone:
            self.abort_why = self.abort_why or f"{sorted(gone)} removed before the attempt began"

    def why_abort(self, att: Attempt, stopping: bool) -> str | None:
        """Why the attempt in flight must end now: a member was removed, or (a catch-up only) the sender is
        `stopping`: the optimizer step waits for the serving thread, and a newcomer's catch-up must not hold it up."""
        if self.abort_why is not None:
            return self.abort_why
        if att.catchup and stopping:
            return "the sender stopped serving this version (the next update has begun)"
        return None

    # ---- joining a new epoch ----------------------------------------------------------------------------
    def _current(self, att: Attempt, actors: list[str]) -> list[str]:
        """Those of `actors` still in the registration the attempt was sent to."""
        return [a for a in actors if self.gens[a] == att.gens[a]]

    def joining(self, att: Attempt) -> None:
        """A new epoch's joins begin: each member's deadline (carried from an earlier attempt of the same
        registration, else the attempt's own) goes into att.joining. A registration that has ended since the
        attempt began gets no entry in join_by (none would drop it)."""
        current = set(self._current(att, att.members))
        att.joining = {
            a: self.join_by.setdefault((a, att.gens[a]), Joining(by=att.joins_by)) if a in current else Joining(by=att.joins_by)
            for a in att.members
        }
        for j in att.joining.values():
            j.attempts += 1

    def overdue(self, att: Attempt, now: float) -> list[str]:
        """The members whose join deadline has passed at `now` (late unless they have joined)."""
        return [a for a in att.members if now > att.joining[a].by]

    def settle(self, att: Attempt, joined: set[str], carry: bool) -> list[str]:
        """The joins end: a member that joined has shown it can: its next attempt starts afresh. One that has not
        keeps its deadline only when `carry` (a catch-up cut short by the next update); any other end starts it
        afresh. Returns the members that have not joined."""
        for a in att.members:
            if a in joined or not carry:
                self.join_by.pop((a, att.gens[a]), None)
        return [a for a in att.members if a not in joined]

    def _repeat(self, att: Attempt, blamed: list[str]) -> bool:
        """Whether each member to blame had an earlier attempt in this registration (cut short: it was logged)."""
        return bool(blamed) and all(att.joining[a].attempts > 1 for a in blamed)

    def late(self, att: Attempt, late: list[str], joined: set[str]) -> Late:
        """`late` missed their deadline (checked before a cut-short: the deadline counts across attempts): evict
        them, but only in the registration they were sent to (one that came back since is not to blame)."""
        self.settle(att, joined, carry=False)
        missed = f"did not join a weight group epoch within weights.join_timeout_s = {self.join_timeout_s} s"
        evict = {}
        for a in self._current(att, late):
            n = att.joining[a].attempts
            evict[a] = f"{missed} ({n} attempt{'s' if n > 1 else ''})"
        att.repeat = self._repeat(att, late)
        return Late(evict=evict, why=f"{late} {missed} (epoch {att.epoch})")

    def cut_short(self, att: Attempt, joined: set[str], stopping: bool) -> None:
        """The joins end early (why_abort): a catch-up stopped by the next update carries its deadlines over."""
        carry = att.catchup and stopping and self.abort_why is None
        waiting = self.settle(att, joined, carry=carry)
        att.repeat = carry and self._repeat(att, waiting)

    def connected(self, att: Attempt, group: G) -> None:
        """Every member joined and the group connected: they are proven; the everyone epoch's group is kept."""
        if not att.side:
            self.group = group
        self.membership.joined(self._current(att, att.members))

    def connect_failed(self, att: Attempt) -> dict[str, str]:
        """Every member said it joined but the group did not connect by the deadline: no culprit is named, so
        they are tried apart (learner/weights/membership.py); whom to evict (with why): a member that failed alone."""
        evict = self.membership.connect_failed(self._current(att, att.members))
        why = f"weight group epoch {att.epoch} did not connect within weights.join_timeout_s = {self.join_timeout_s} s"
        return {a: why + " (its only member: nobody else to blame)" for a in evict}

    # ---- how the attempt ended --------------------------------------------------------------------------
    def ended(self) -> None:
        """The attempt is no longer in flight (whatever its outcome)."""
        self.attempt = None

    def served(self, att: Attempt) -> None:
        """Every member holds att.version: those still in the registration it was sent to are marked."""
        for a in self._current(att, att.members):
            self.holds[a] = att.version

    def closing(self) -> tuple[G, str] | None:
        """Serving is over (the learner's end): the everyone epoch's group and its backend, to close; the next
        attempt, if any, forms a new epoch."""
        if self.group is None or self.plan is None:
            return None
        out = (self.group, self.plan.backend)
        self.group, self.members, self.plan = None, [], None
        return out

    def gave_up(self, att: Attempt) -> G | None:
        """The attempt failed and its epoch is over: the everyone epoch's group, when it was that one, to close
        (an operation in flight lives on in the graveyard). A probation epoch's own group is the caller's."""
        if att.side:
            return None
        dead, self.group, self.members, self.plan = self.group, None, [], None
        return dead
