"""Dispatch: which actor generates which prompt next. Functions of the registry's records, the ledger and the
eval round; HubState.pump decides how many training prompts admission control allows and counts what they grant.

    (eval round, actors, now)                              --eval_grants()--> EvalGrants for actors serving its version
    (actors, ledger, prompts, capacity, min version, now)  --work_grants()--> WorkGrants, least-loaded actors first

An actor is granted at most its `demand` (its capacity minus what it holds, as it last asked), so requests
still in flight never make the hub grant more than the actor can hold.
"""

from __future__ import annotations

from learner.data.prompts import PromptSet
from learner.hub.core.evaluation import EvalRound
from learner.hub.core.ledger import Ledger
from learner.hub.core.records import ActorState, Out
from protocol import messages as m


def eval_grants(rnd: EvalRound, actors: dict[str, ActorState], max_groups: int, now: float) -> list[Out]:
    """Prompts of the open eval round for the actors serving exactly its version."""
    ready = [a for a, s in actors.items() if s.served_version == rnd.version]
    return [Out(actors[a].identity, grant, reply=False) for a, grant in rnd.assign(ready, max_groups, now)]


def work_grants(
    actors: dict[str, ActorState], ledger: Ledger, prompts: PromptSet, capacity: int, min_version: int, lease_s: float, now: float
) -> tuple[list[Out], list[tuple[str, int, int]]]:
    """Up to `capacity` pending prompts for the actors with demand that serve `min_version` or newer, each leased
    for `lease_s`. Returns the grants and (actor, epoch, prompt id) of each."""
    sends: list[Out] = []
    granted: list[tuple[str, int, int]] = []
    # Fairness: least-loaded actors first.
    for actor_id, state in sorted(actors.items(), key=lambda kv: len(kv[1].held)):
        if state.served_version < min_version:
            continue  # it would generate samples already too stale (or it awaits its first sync)
        while state.demand > 0 and capacity > 0:
            key = ledger.next_pending()
            if key is None:
                break
            ledger.grant(key, actor_id, now + lease_s)
            state.held.add(key)
            granted.append((actor_id, *key))
            state.demand -= 1
            capacity -= 1
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
