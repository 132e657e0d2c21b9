"""The ledger: every prompt of every epoch, in exactly one state. No prompt lost, none trained twice.

    pending --grant--> granted(actor, deadline) --receive--> received --train--> trained
       ^                  |  lease expired / actor dead          |  too stale
       +------------------+--------------------------------------+

A prompt is keyed by (epoch, prompt_id). Epochs open lazily when the pending queue
runs dry, each in its own seeded shuffle, so a resumed run replays the same order.
A result for a prompt that is already received or trained is a duplicate: counted,
not trained again. A late result for a prompt whose lease expired is still taken
while nobody else has delivered it (the work was done; wasting it helps no one).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass
from enum import Enum

Key = tuple[int, int]  # (epoch, prompt_id)


class State(Enum):
    PENDING = "pending"
    GRANTED = "granted"
    RECEIVED = "received"
    TRAINED = "trained"


@dataclass(slots=True)
class Entry:
    state: State
    actor: str | None = None  # holder while granted
    deadline: float = 0.0  # lease end while granted (monotonic seconds)


class Ledger:
    def __init__(self, num_prompts: int, max_epochs: int, seed: int):
        assert num_prompts > 0
        self.num_prompts = num_prompts
        self.max_epochs = max_epochs
        self.seed = seed
        self.entries: dict[Key, Entry] = {}
        self.queue: deque[Key] = deque()  # pending keys; may hold keys no longer pending (skipped on pop)
        self.epochs_opened = 0
        self.counts: Counter[str] = Counter()  # requeued_stale, requeued_lease, requeued_dead, duplicates

    def _open_epoch(self) -> bool:
        if self.epochs_opened >= self.max_epochs:
            return False
        epoch = self.epochs_opened
        order = list(range(self.num_prompts))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        for pid in order:
            self.entries[(epoch, pid)] = Entry(State.PENDING)
            self.queue.append((epoch, pid))
        self.epochs_opened += 1
        return True

    def next_pending(self) -> Key | None:
        """The next prompt to grant, opening a new epoch if needed; None when all epochs are out."""
        while True:
            while self.queue:
                key = self.queue.popleft()
                if self.entries[key].state is State.PENDING:
                    return key
            if not self._open_epoch():
                return None

    def grant(self, key: Key, actor: str, deadline: float) -> None:
        entry = self.entries[key]
        assert entry.state is State.PENDING, f"grant of {key} in state {entry.state}"
        entry.state, entry.actor, entry.deadline = State.GRANTED, actor, deadline

    def receive(self, key: Key) -> bool:
        """A result arrived. True if it is the first for this prompt (then the prompt is received)."""
        entry = self.entries.get(key)
        if entry is None or entry.state in (State.RECEIVED, State.TRAINED):
            self.counts["duplicates"] += 1
            return False
        entry.state, entry.actor = State.RECEIVED, None
        return True

    def requeue(self, key: Key, reason: str) -> None:
        """Back to pending, at the front of the queue (it has waited longest)."""
        entry = self.entries[key]
        assert entry.state in (State.GRANTED, State.RECEIVED), f"requeue of {key} in state {entry.state}"
        entry.state, entry.actor = State.PENDING, None
        self.queue.appendleft(key)
        self.counts[f"requeued_{reason}"] += 1

    def trained(self, key: Key) -> None:
        entry = self.entries[key]
        assert entry.state is State.RECEIVED, f"trained {key} in state {entry.state}"
        entry.state = State.TRAINED

    def expire(self, now: float) -> list[Key]:
        """Requeue every grant whose lease passed."""
        expired = [k for k, e in self.entries.items() if e.state is State.GRANTED and e.deadline <= now]
        for key in expired:
            self.requeue(key, "lease")
        return expired

    def release_actor(self, actor: str) -> list[Key]:
        """Requeue every grant held by a dead actor."""
        held = [k for k, e in self.entries.items() if e.state is State.GRANTED and e.actor == actor]
        for key in held:
            self.requeue(key, "dead")
        return held

    def state_counts(self) -> dict[str, int]:
        c = Counter(e.state.value for e in self.entries.values())
        return {s.value: c.get(s.value, 0) for s in State}

    def check(self) -> None:
        """Invariant: every prompt of every opened epoch has exactly one entry."""
        assert len(self.entries) == self.epochs_opened * self.num_prompts, "ledger lost or invented a prompt"
