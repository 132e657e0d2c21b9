"""The hub's registry: the live actors by id, the connection and CURVE key each registered with, and who is
told when one joins or leaves (the weight sender).

    Register            --register()--> RegisterAck, or Error (quarantined, id_taken)
    (actor id, conn)    --known()-----> its ActorState, or None (not registered, or not on that connection)
    gone: released (replaced, quarantined), connection_closed(), evict(), expire() (silent past actor_timeout_s)
          --> give_back(actor id, state, requeue): HubState returns what it held to the ledger and the eval round
    silent past hub.silent_s: still registered, but listeners hear it leave (and join when it is heard again)

Rules: one actor per connection; only the CURVE key that registered an id may take it over; a served version
above the learner's counts as none.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from learner.hub.core.ledger import Key
from learner.hub.core.quarantine import Quarantine
from learner.hub.core.records import ActorState, Out, error_reply
from learner.hub.core.updates import Updates
from protocol import messages as m
from protocol.config import Config
from protocol.logs import get_logger


class Registry:
    def __init__(
        self,
        cfg: Config,
        quarantine: Quarantine,
        updates: Updates,
        counters: Counter[str],
        give_back: Callable[[str, ActorState, str], list[Key]],
    ):
        """`give_back(actor_id, state, requeue)`: return what a removed actor held; the keys it requeued."""
        self.cfg, self.quarantine, self.updates, self.counters, self.give_back = cfg, quarantine, updates, counters, give_back
        self.log = get_logger()
        self.actors: dict[str, ActorState] = {}
        self.quiet = 0  # of them silent past hub.silent_s (ActorState.silent)
        # Who is told when an actor registers or is removed (the weight sender): fn(actor_id, joined).
        self.listeners: list[Callable[[str, bool], None]] = []

    def register(self, identity: bytes, msg: m.Register, now: float, key: str | None) -> list[Out]:
        if self.quarantine.refuses_id(msg.actor_id, now):
            self.counters["quarantined_messages"] += 1
            self.log.warning("hub.register_refused", actor=msg.actor_id, key=key, why="quarantined")
            return [error_reply(identity, "quarantined", f"actor id {msg.actor_id!r} is quarantined for sending refused groups")]
        old = self.actors.get(msg.actor_id)
        if old is not None and old.key != key:  # only the key that registered an id may take it over
            self.counters["register_wrong_key"] += 1
            self.log.warning("hub.register_refused", actor=msg.actor_id, key=key, owner=old.key)
            return [
                error_reply(
                    identity, "id_taken", f"actor id {msg.actor_id!r} is registered with another key; pick another id (fleetrl actor --id)"
                )
            ]
        # A retry from the same connection (queued retries arrive together when a learner comes back). But -1
        # from an actor this hub saw serving a version is a rejoin: its sync failed and its worker left the
        # weight group, which must re-form, so it counts as new.
        repeat = old is not None and old.identity == identity and (msg.served_version >= 0 or old.served_version < 0)
        if old is not None and repeat:
            old.last_seen = now
        else:
            if old is not None:  # same id, new connection (the old one is gone), or a rejoin
                self.release(msg.actor_id, "replaced by a new connection" if old.identity != identity else "rejoined (served -1)")
            # One actor per connection: a peer cycling through ids cannot grow the registry (or the weight
            # group, whose every member must answer) without bound.
            for other in [a for a, s in self.actors.items() if s.identity == identity]:
                self.release(other, f"its connection registered again as {msg.actor_id!r}")
                self.counters["reregistered"] += 1
            self.actors[msg.actor_id] = ActorState(
                identity, now, self.trusted(msg.served_version), joined_at=now, key=key, devices=list(msg.devices)
            )
            for fn in self.listeners:
                fn(msg.actor_id, True)
            self.log.info(
                "hub.actor_registered", actor=msg.actor_id, host=msg.host, pid=msg.pid, served=msg.served_version, ranks=len(msg.devices)
            )
        ack = m.RegisterAck(actor_id=msg.actor_id, policy_version=self.updates.version, heartbeat_s=self.cfg.hub.heartbeat_s)
        return [Out(identity, ack)]

    def known(self, actor_id: str, identity: bytes, now: float) -> ActorState | None:
        """The actor, if it is registered on this connection (then it was heard from `now`)."""
        state = self.actors.get(actor_id)
        if state is None or state.identity != identity:
            return None
        state.last_seen = now
        if state.silent:
            state.silent = False
            self.quiet -= 1
            self.log.info("hub.actor_heard_again", actor=actor_id)
            for fn in self.listeners:  # the weight sender serves it again (a newcomer: caught up on its own)
                fn(actor_id, True)
        return state

    def unknown(self, identity: bytes, actor_id: str) -> list[Out]:
        self.counters["unknown_actor"] += 1
        return [error_reply(identity, "unknown_actor", f"actor {actor_id!r} is not registered; register again")]

    def served(self, identity: bytes, actor_id: str, served_version: int, now: float) -> ActorState | None:
        """Record the version an actor serves (max: a heartbeat sent before a sync may arrive after it)."""
        state = self.known(actor_id, identity, now)
        if state is not None:
            state.served_version = max(state.served_version, self.trusted(served_version))
        return state

    def trusted(self, served_version: int) -> int:
        """A version above the learner's comes from weights of a learner that died after its last checkpoint
        (the resumed one retrains those versions differently): it counts as none (-1)."""
        if served_version > self.updates.version:
            self.counters["served_ahead"] += 1
            return -1
        return served_version

    def release(self, actor_id: str, why: str, requeue: str = "dead") -> None:
        """Forget an actor and requeue what it held (`requeue`: the ledger's reason; "dead" lets it deliver late)."""
        state = self.actors.pop(actor_id)
        self.quiet -= state.silent
        requeued = self.give_back(actor_id, state, requeue)
        for fn in self.listeners:
            fn(actor_id, False)
        self.log.warning("hub.actor_removed", actor=actor_id, why=why, requeued=len(requeued), keys=sorted(requeued))

    def connection_closed(self, identity: bytes) -> None:
        """The connection `identity` closed (a killed process: its kernel closes the socket): its actor is gone now,
        not after hub.actor_timeout_s."""
        for actor_id in [a for a, state in self.actors.items() if state.identity == identity]:
            self.release(actor_id, "connection closed")
            self.counters["actors_lost"] += 1
            self.counters["actors_disconnected"] += 1

    def evict(self, actor_id: str, why: str) -> bool:
        """Remove a live actor (its grants go back to the queue); False if it is not registered."""
        if actor_id not in self.actors:
            return False
        self.release(actor_id, why)
        self.counters["actors_evicted"] += 1
        return True

    def expire(self, now: float) -> None:
        """Declare the actors silent for longer than hub.actor_timeout_s dead."""
        for actor_id in [a for a, s in self.actors.items() if now - s.last_seen > self.cfg.hub.actor_timeout_s]:
            self.release(actor_id, "heartbeat timeout")
            self.counters["actors_lost"] += 1

    def silent(self, now: float) -> list[tuple[str, ActorState]]:
        """The actors silent for longer than hub.silent_s (a hung process, its socket open) that hold leases, or went
        silent just now: the caller returns their leases to the queue. They stay registered, and may deliver late."""
        out = []
        for actor_id, state in self.actors.items():
            if now - state.last_seen <= self.cfg.hub.silent_s:
                continue
            newly = not state.silent
            if newly:
                state.silent = True
                self.quiet += 1
                self.counters["actors_silent"] += 1
                self.log.warning("hub.actor_silent", actor=actor_id, silent_s=round(now - state.last_seen, 3), leases=len(state.held))
                for fn in self.listeners:  # the weight sender stops waiting for it (a broadcast it blocks is given up)
                    fn(actor_id, False)
            if newly or state.held:
                out.append((actor_id, state))
        return out

    def lapsed(self, keys: list[Key]) -> None:
        """These leases ran out (the ledger requeued them): no actor holds them any more."""
        for key in keys:
            for state in self.actors.values():
                state.held.discard(key)

    def live(self) -> list[str]:
        """The registered actors heard from within hub.silent_s, sorted: those the weight sender serves."""
        return sorted(a for a, s in self.actors.items() if not s.silent)

    def devices(self, actor_ids: list[str]) -> list[list[str]]:
        """Each actor's device identities as it registered them, one per weight-group rank it holds. An actor
        removed meanwhile counts as one CPU rank: the sender gives up any attempt it is part of anyway."""
        return [list(s.devices) if (s := self.actors.get(a)) is not None else [""] for a in actor_ids]
