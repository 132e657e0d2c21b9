"""What the weight sender needs of the fleet it serves, and the one rule that keeps the two from deadlocking.

The hub on learner rank 0 (learner/hub/server.py) satisfies `Fleet` as it is; tests hand in stand-ins
(tests/fake_hub.py). Nothing in learner/weights/ imports the hub.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from protocol import messages as m


class Fleet(Protocol):
    """The live actors, their devices, and a way to reach and to remove them.

    The sender and the fleet call each other, and each has a lock of its own:

        sender (training or serving thread) --live_actors / devices / send_weight_sync / evict--> fleet (its lock)
        fleet, under its lock ------------------listener(actor_id, joined)------------------------> sender (its lock)

    The listener runs under the fleet's lock, on the hub thread, or on the sender's own serving thread
    inside `evict`. So that neither side ever waits for the other's lock while holding its own:
    - the listener only records the change (learner/weights/state.py: SenderState.on_membership) and
      wakes the serving thread: no fleet call, no store or group call, nothing that blocks;
    - the sender never holds its own lock while it calls the fleet (`evict` would deadlock on the spot),
      nor while it closes a group: NCCL's abort can take a while, and the hub thread would wait for it,
      inside the listener, holding the hub's lock.
    """

    def live_actors(self) -> list[str]:
        """The registered actors' ids, sorted."""
        ...

    def devices(self, actor_ids: list[str]) -> list[list[str]]:
        """Each actor's device identities, one per engine worker (Register.devices; protocol/weights.py)."""
        ...

    def send_weight_sync(self, members: list[str], make: Callable[[str], m.WeightSync]) -> None:
        """Send `make(actor_id)` to each member still live; raises when it cannot (the hub stopping, a send timing out)."""
        ...

    def evict(self, actor_id: str, why: str) -> None:
        """Remove a live actor (the listener hears it); it hears `unknown_actor` next and registers again."""
        ...

    def add_membership_listener(self, fn: Callable[[str, bool], None]) -> None:
        """`fn(actor_id, joined)` on each registration (joined: also again under the same id) and each removal."""
        ...
