"""Dispatch: which actor generates which prompt next. Functions of the registry's records, the ledger and the
eval round; HubState.pump decides how many training prompts admission control allows and counts what they grant.

    (eval round, actors, now)                              --eval_grants()--> EvalGrants for actors serving its version
    (ready queue, actors, ledger, prompts, capacity, ...)  --work_grants()--> WorkGrants, one prompt per actor per turn

An actor is granted at most its `demand` (its capacity minus what it holds, as it last asked), so requests
still in flight never make the hub grant more than the actor can hold.

Fairness and cost: the actors with demand wait in one line (Ready), least recently granted first. Each turn
grants the actor at the front one prompt and sends it to the back if it wants more, and no actor holds more than
its share of admission's slots (slots / actors, rounded up): the first actor to report a new version must not
take all the room the update opened. Every actor that asks is granted within about (actors ahead of it) /
(grants per second). A sort by load, stable in registration order,
gave every grant to the first few actors of a large fleet. An actor that falls behind on weights at each update
keeps its place: the order in which the fleet reports the new version must not decide who is served. A grant
costs O(log N), a pump with no capacity O(1): the hub pumps on every work request, group and version report, and
a walk over every actor there made the hub's cost grow with the square of the fleet.
"""

from __future__ import annotations

import heapq

from learner.data.prompts import PromptSet
from learner.hub.core.evaluation import EvalRound
from learner.hub.core.ledger import Ledger
from learner.hub.core.records import ActorState, Out
from protocol import messages as m


class Ready:
    """The actors that want work, each at most once, least recently granted first (a heap of tickets: an actor's
    ticket is the count of grants made when it was last granted, or when it first asked). Entries are checked when
    they reach the front: one removed, satisfied, silent or behind on weights since is dropped there and keeps its ticket,
    so it comes back in its old place when it asks or reports a newer version (HubState._wants). O(log N) each."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, str]] = []
        self._queued: set[str] = set()
        self._ticket: dict[str, int] = {}
        self._grants = 0

    def want(self, actor_id: str) -> None:
        if actor_id not in self._queued:
            self._queued.add(actor_id)
            heapq.heappush(self._heap, (self._ticket.setdefault(actor_id, self._grants), actor_id))

    def pop(self) -> str | None:
        if not self._heap:
            return None
        _, actor_id = heapq.heappop(self._heap)
        self._queued.discard(actor_id)
        return actor_id

    def granted(self, actor_id: str) -> None:
        """It got a prompt: to the back of the line."""
        self._grants += 1
        self._ticket[actor_id] = self._grants

    def order(self, actor_ids: list[str]) -> list[str]:
        """`actor_ids`, least recently granted first (never granted: first of all)."""
        return sorted(actor_ids, key=lambda a: self._ticket.get(a, -1))

    def forget(self, actor_id: str) -> None:
        """Removed from the registry (a later registration under its id starts afresh, at the back)."""
        self._ticket.pop(actor_id, None)

    def __len__(self) -> int:
        return len(self._heap)


def eval_grants(rnd: EvalRound, actors: dict[str, ActorState], max_groups: int, now: float) -> list[Out]:
    """Prompts of the open eval round for the actors serving exactly its version."""
    ready = [a for a, s in actors.items() if s.served_version == rnd.version]
    return [Out(actors[a].identity, grant, reply=False) for a, grant in rnd.assign(ready, max_groups, now)]


def work_grants(
    ready: Ready,
    actors: dict[str, ActorState],
    ledger: Ledger,
    prompts: PromptSet,
    capacity: int,
    share: int,
    min_version: int,
    lease_s: float,
    now: float,
) -> tuple[list[Out], list[tuple[str, int, int]]]:
    """Up to `capacity` pending prompts for the actors in `ready` that serve `min_version` or newer and hold fewer
    than `share`, one per actor per turn, each leased for `lease_s`. Returns the grants and (actor, epoch, prompt
    id) of each."""
    sends: list[Out] = []
    granted: list[tuple[str, int, int]] = []
    while capacity > 0 and (actor_id := ready.pop()) is not None:
        state = actors.get(actor_id)
        if state is None:
            ready.forget(actor_id)
            continue
        if state.demand <= 0 or state.silent:
            continue  # satisfied, or silent (hung?): back in line when it asks, or is heard from
        if len(state.held) >= share:
            continue  # its fair share: back in line when it returns a group (HubState._rollout)
        if state.served_version < min_version:
            continue  # it would generate samples already too stale (or it awaits its first sync); back on its report
        key = ledger.next_pending()
        if key is None:
            ready.want(actor_id)  # its place is kept: it lost its turn to nothing of its own
            break
        ledger.grant(key, actor_id, now + lease_s)
        state.held.add(key)
        granted.append((actor_id, *key))
        state.demand -= 1
        capacity -= 1
        ready.granted(actor_id)
        if state.demand > 0:
            ready.want(actor_id)  # to the back: everyone ahead gets a prompt first
        prompt = prompts[key[1]]
        sends.append(
            Out(
                state.identity,
                m.WorkGrant(
                    prompt_id=key[1],
                    epoch=key[0],
                    prompt_tokens=prompt.tokens,
                    answer=prompt.answer,
                    policy_version=min_version,
                    lease_s=lease_s,
                    prompt=prompt.text,
                    metadata=prompt.metadata,
                ),
                reply=False,
            )
        )
    return sends, granted
