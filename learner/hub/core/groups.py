"""What becomes of a rollout group a registered actor sends: refused, dropped unread (a duplicate), dropped as
too stale, or admitted to the buffer.

    (actor, group, ledger) --receive()--> verdict(): the hub's own checks from its state (`ahead`, `grant`,
                                          `size`), then learner/hub/core/checks.py's on the group's contents
                                            |
                           refused: counted, its prompt back to the queue, the actor told which check failed;
                                    a strike when it is the actor's fault (learner/hub/core/quarantine.py)
                           admitted: the ledger's receipt, then the buffer (learner/hub/core/updates.py) or, too
                                     stale already, back to the queue

An actor whose refused groups reach quarantine.after strikes is quarantined and released (HubState.release).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from learner.data.prompts import PromptSet
from learner.hub.core.checks import GroupLimits, Refusal, check_group
from learner.hub.core.ledger import Key, Ledger, State
from learner.hub.core.quarantine import Quarantine
from learner.hub.core.records import MAX_DETAIL, Accepted, ActorState, Out, error_reply
from learner.hub.core.updates import Updates
from protocol import messages as m
from protocol.config import Config
from protocol.logs import get_logger

# Refusals that are no actor's fault, so never a strike toward quarantine: a `reward` out of bounds is the run's
# own reward function, the same on every actor (quarantining would shut out the whole fleet; it is logged for the
# operator); a `finish` reason other than stop or length is vLLM's (an actor regenerates such groups before it
# sends one, actors/rollout.py, and one from before that change must not be shut out for it).
NO_FAULT = frozenset({"reward", "finish", "env"})


def verdict(
    msg: m.RolloutGroup, version: int, ledger: Ledger, samples_per_prompt: int, prompts: PromptSet, limits: GroupLimits
) -> tuple[Refusal, bool] | None:
    """None: admit it (or, a duplicate of a group already received, drop it unread). Otherwise the refusal and
    whether it is a strike against the actor. `version`: the learner's."""
    key = (msg.epoch, msg.prompt_id)
    if msg.version_min > version:  # weights this learner never had (a lost learner's): no fault of the actor
        return Refusal("ahead", f"group of version {msg.version_min} is newer than the learner's {version}"), False
    if not ledger.may_deliver(key, msg.actor_id):
        # A prompt of no opened epoch was granted to nobody: the actor's fault. A real prompt may be an honest
        # actor's late result whose lapsed grant went to another and came back (stale, aborted): no strike.
        return Refusal("grant", f"not granted to {msg.actor_id!r}"), ledger.state_of(key) is None
    n = msg.lengths.shape[0]
    if n != samples_per_prompt:
        return Refusal("size", f"group has {n} samples, expected {samples_per_prompt}"), True
    if ledger.state_of(key) in (State.GRANTED, State.PENDING):  # duplicates are dropped unread
        refusal = check_group(msg, prompts[msg.prompt_id].tokens, limits)
        if refusal is not None:
            return refusal, refusal.reason not in NO_FAULT
    return None


class Groups:
    """The hub's receipt of rollout groups (HubState passes the ledger, which a restore replaces)."""

    def __init__(
        self,
        cfg: Config,
        prompts: PromptSet,
        limits: GroupLimits,
        quarantine: Quarantine,
        updates: Updates,
        counters: Counter[str],
        release: Callable[[str, str, str], None],
    ):
        """`release(actor_id, why, requeue)`: HubState.release, which removes a quarantined actor."""
        self.cfg, self.prompts, self.limits, self.quarantine = cfg, prompts, limits, quarantine
        self.updates, self.counters, self.release = updates, counters, release
        self.log = get_logger()

    def receive(self, identity: bytes, state: ActorState, msg: m.RolloutGroup, now: float, ledger: Ledger) -> list[Out]:
        """A group from the registered actor `state` (on its own connection): what to tell it (a refusal)."""
        key = (msg.epoch, msg.prompt_id)
        refused = verdict(msg, self.updates.version, ledger, self.cfg.rollout.samples_per_prompt, self.prompts, self.limits)
        if refused is None or refused[0].reason == "env":  # episodes a failing environment ended, trained or requeued
            self.counters["env_errors"] += msg.env_errors
            self.counters["env_timeouts"] += msg.env_timeouts
        if refused is not None:
            return self._refuse(identity, state, msg.actor_id, key, now, ledger, *refused)
        state.held.discard(key)
        if ledger.receive(key):
            state.groups += 1
            item = Accepted(key, msg, now)
            state.note_arrival(now)
            if self.updates.admit(item):
                if state.first_version is None:  # its first group that can be trained: its version must be one it was sent
                    state.first_version = msg.version_min
                    self.log.info(
                        "hub.actor_first_group",
                        actor=msg.actor_id,
                        version=msg.version_min,
                        learner_version=self.updates.version,
                        after_s=round(now - state.joined_at, 3),
                    )
            else:  # already too stale on arrival: versions only grow, it can never be used
                self.drop_stale(item, ledger)
        self.log.debug("hub.group_received", actor=msg.actor_id, key=key, version=msg.version_min)
        return []

    def drop_stale(self, item: Accepted, ledger: Ledger) -> None:
        """The sample may never be trained on; its prompt goes back to the queue."""
        self.counters["dropped_stale"] += 1
        u = self.updates
        self.log.debug(
            "hub.dropped_stale", key=item.key, sample_version=item.group.version_min, learner_version=u.version, k=u.max_staleness
        )
        ledger.requeue(item.key, "stale")

    def _refuse(
        self, identity: bytes, state: ActorState, actor_id: str, key: Key, now: float, ledger: Ledger, refusal: Refusal, strike: bool
    ) -> list[Out]:
        """A group not admitted: counted by reason, its prompt back to the queue, the actor told which check failed.
        With `strike` (the actor's fault) it counts toward quarantining the actor."""
        self.counters[f"rejected_{refusal.reason}"] += 1
        # A rejected group's prompt goes back to the queue now, not at its lease's end, and frees the actor's slot
        # (its requests are capacities). A reward out of bounds may be this prompt's every time: behind the queue,
        # it cannot take every next grant.
        if key in state.held and ledger.holder(key) == actor_id:
            state.held.discard(key)
            ledger.requeue(key, "rejected", refusal.reason != "reward")
        out = [error_reply(identity, "rejected", f"group for prompt {key[1]} (epoch {key[0]}) refused, {refusal.reason}: {refusal.detail}")]
        if strike or refusal.reason in NO_FAULT:
            self.log.warning("hub.group_rejected", actor=actor_id, key=key, reason=refusal.reason, detail=refusal.detail[:MAX_DETAIL])
        strikes = self.quarantine.strike(actor_id, now) if strike else None
        if strikes is not None:
            self.quarantine.add(actor_id, identity, now)
            self.release(actor_id, "quarantined", "quarantined")
            self.counters["actors_quarantined"] += 1
            q = self.cfg.hub
            self.log.warning(
                "hub.actor_quarantined",
                actor=actor_id,
                key=state.key,
                refused=strikes,
                window_s=q.quarantine_window_s,
                for_s=q.quarantine_s,
                last_reason=refusal.reason,
            )
            out.append(
                error_reply(
                    identity,
                    "quarantined",
                    f"{strikes} groups refused within {q.quarantine_window_s:g} s (the last: "
                    f"{refusal.reason}); actor {actor_id!r} is refused for {q.quarantine_s:g} s",
                )
            )
        return out
