"""Who goes into which weight-group epoch, so that a member that cannot join holds the others up once at most.

Joining a new epoch has its own deadline, `weights.join_timeout_s` (learner/weights/state.py): every member
sets its joined key, then the group connects (gloo's rendezvous, NCCL's communicator init). Until an actor
has joined an epoch in its current registration it is unproven: registering says its engine is up (the
actor registers only after its engine has started, actors/main.py), not that it can reach the weight store
and the other ranks. So:

- an actor that registers while a version is being served is on probation: it is caught up in an epoch of
  probation members only, never in the sync's own epoch, and leaves probation once it has joined one. An
  actor that registers and never joins therefore costs the others nothing;
- a member that misses its joined key is evicted by the sender (the culprit is known); when it registers
  again it is on probation like any newcomer;
- a group that fails to connect although every member said it joined names no culprit. Its unproven
  members go on probation, each to be tried alone, and its proven ones become unproven (a second failure
  puts them on probation too). A member that fails to connect alone is evicted.

Actors registered before the first sync (version 0 comes from model.path: there was nothing to prove it
with) are regular members: one of them that never joins delays the first sync by the join deadline, once.

No I/O and no lock: part of the sender's decisions (learner/weights/state.py), which say whom the sender evicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALONE = 1  # a probation mark: tried in an epoch of its own (it was in a group that failed to connect)


@dataclass(slots=True)
class Membership:
    serving: bool = False  # a version has been served: a newcomer lacks it, and is on probation
    proven: set[str] = field(default_factory=set)  # joined an epoch in their current registration
    probation: dict[str, int] = field(default_factory=dict)  # actor -> 0 (with other newcomers) or ALONE

    # ---- what the hub saw -------------------------------------------------------------------------------
    def registered(self, actor: str) -> None:
        """A registration (a new actor, or one back under its id: a new process, or evicted): it proves itself again."""
        self.proven.discard(actor)
        if self.serving:
            self.probation.setdefault(actor, 0)

    def removed(self, actor: str) -> None:
        self.proven.discard(actor)
        self.probation.pop(actor, None)

    # ---- who goes next ------------------------------------------------------------------------------------
    def regular(self, actors: list[str]) -> list[str]:
        """The members of a sync's own epoch: everyone but those on probation."""
        return [a for a in actors if a not in self.probation]

    def next_group(self, lacking: list[str]) -> list[str]:
        """Whom to serve next among `lacking`: the regular members, else the newcomers together, else one alone."""
        regular = self.regular(lacking)
        if regular:
            return regular
        fresh = [a for a in lacking if self.probation.get(a) == 0]
        return fresh or lacking[:1]

    # ---- how a join went ----------------------------------------------------------------------------------
    def joined(self, members: list[str]) -> None:
        """Every member joined (the group connected)."""
        for a in members:
            self.proven.add(a)
            self.probation.pop(a, None)

    def connect_failed(self, members: list[str]) -> list[str]:
        """Every member set its joined key but the group did not connect in time: who to evict (a member that
        failed alone: nobody else can be to blame). The others are tried apart next time."""
        if len(members) == 1:
            return list(members)
        for a in members:
            if a in self.proven:
                self.proven.discard(a)
            else:
                self.probation[a] = ALONE
        return []
