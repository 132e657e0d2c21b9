"""The ledger: every prompt of every epoch, in exactly one state. No prompt lost, none trained twice.

    pending --grant--> granted(actor, deadline) --receive--> received --train--> trained
       ^                  |  lease expired / actor dead          |  too stale
       +------------------+--------------------------------------+

A prompt is keyed by (epoch, prompt_id). Epochs open lazily when the pending queue
runs dry, each in its own seeded shuffle, so a resumed run replays the same order.
A result for a prompt that is already received or trained is a duplicate: counted,
not trained again. A result is taken only from the actor the prompt was granted to
(`may_deliver`): a group for a prompt never granted, or granted to someone else, is
refused. A late result, from an actor whose lease on the prompt expired or which was
declared dead while holding it, is still taken while nobody else has delivered it (the
work was done; wasting it helps no one).

An epoch whose every prompt is trained is closed: its entries go, and a result for one of its
prompts is a duplicate like any other. So the ledger holds the epochs still in play, not every
epoch a long run has opened (a 60-minute soak opened 1,527).

A learner checkpoint stores the ledger (`state_dict`). On resume (`from_state`) granted
and received prompts go back to pending, at the front of the queue: the groups in the
dead learner's buffer died with it, and an actor's late result for an old grant is
dropped by the actor itself (it re-registered), so either would otherwise be lost.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

Key = tuple[int, int]  # (epoch, prompt_id)
LAPSES = ("lease", "dead", "silent")  # requeue reasons after which the holder may still deliver late


class State(Enum):
    PENDING = "pending"
    GRANTED = "granted"
    RECEIVED = "received"
    TRAINED = "trained"


_CODE = {State.PENDING: "p", State.GRANTED: "g", State.RECEIVED: "r", State.TRAINED: "t"}  # one char per prompt in a checkpoint
_STATE = {c: s for s, c in _CODE.items()}


@dataclass(slots=True)
class Entry:
    state: State
    actor: str | None = None  # holder while granted
    deadline: float = 0.0  # lease end while granted (monotonic seconds)
    lapsed: tuple[str, ...] = ()  # actors whose grant of it lapsed (lease, death) since its last result: their late result counts


class Ledger:
    def __init__(self, num_prompts: int, max_epochs: int, seed: int):
        assert num_prompts > 0
        self.num_prompts = num_prompts
        self.max_epochs = max_epochs
        self.seed = seed
        self.entries: dict[Key, Entry] = {}  # the prompts of the epochs not yet closed
        self.closed: set[int] = set()  # epochs whose every prompt is trained: no entries (`_close`)
        self.trained_in: Counter[int] = Counter()  # trained prompts per epoch not yet closed
        self.queue: deque[Key] = deque()  # pending keys; may hold keys no longer pending (skipped on pop)
        # The keys in state granted, in grant order: admission's count of leases and the lease check read this, not
        # every entry (the entries grow by a pass over the data each epoch; the hub asks on every message).
        self.granted: dict[Key, None] = {}
        self.epochs_opened = 0
        self.counts: Counter[str] = Counter()  # requeued_stale, requeued_lease, requeued_dead, duplicates
        # Prompts per state (closed epochs' included), kept as they move: the metrics row reads it every update.
        self.in_state: Counter[State] = Counter()

    def _open_epoch(self) -> bool:
        if self.epochs_opened >= self.max_epochs:
            return False
        epoch = self.epochs_opened
        order = list(range(self.num_prompts))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        for pid in order:
            self.entries[(epoch, pid)] = Entry(State.PENDING)
            self.queue.append((epoch, pid))
        self.in_state[State.PENDING] += self.num_prompts
        self.epochs_opened += 1
        return True

    def next_pending(self) -> Key | None:
        """The next prompt to grant, opening a new epoch if needed; None when all epochs are out."""
        while True:
            while self.queue:
                key = self.queue.popleft()
                if self.state_of(key) is State.PENDING:
                    return key
            if not self._open_epoch():
                return None

    def left_to_train(self) -> int | None:
        """Prompts that may still be trained: pending, granted or received (not yet trained). None while another
        epoch can be opened (then there is always more)."""
        if self.epochs_opened < self.max_epochs:
            return None
        return self.size - self.in_state[State.TRAINED]

    @property
    def size(self) -> int:
        """Prompts of the opened epochs, closed ones included."""
        return self.epochs_opened * self.num_prompts

    def state_of(self, key: Key) -> State | None:
        """Where `key` is; None for a prompt of no opened epoch."""
        entry = self.entries.get(key)
        if entry is not None:
            return entry.state
        return State.TRAINED if key[0] in self.closed else None

    def holder(self, key: Key) -> str | None:
        """Who holds `key`'s grant now (None: nobody, or its epoch is closed)."""
        entry = self.entries.get(key)
        return entry.actor if entry is not None else None

    def states(self) -> dict[Key, State]:
        """Every prompt of the opened epochs and its state (closed epochs' included): for checks, not hot paths."""
        out = {(e, p): State.TRAINED for e in sorted(self.closed) for p in range(self.num_prompts)}
        out.update((k, e.state) for k, e in self.entries.items())
        return out

    def grant(self, key: Key, actor: str, deadline: float) -> None:
        entry = self.entries[key]
        assert entry.state is State.PENDING, f"grant of {key} in state {entry.state}"
        self._move(entry, State.GRANTED)
        entry.actor, entry.deadline = actor, deadline
        self.granted[key] = None

    def may_deliver(self, key: Key, actor: str) -> bool:
        """Whether a result from `actor` for `key` is its to give: granted to it now, or a late result of a grant
        that lapsed. A result for a prompt already received or trained is a duplicate: True, receive() counts it."""
        entry = self.entries.get(key)
        if entry is None:
            return key[0] in self.closed  # a closed epoch's prompt is trained: a duplicate
        if entry.state in (State.RECEIVED, State.TRAINED):
            return True
        return (entry.state is State.GRANTED and entry.actor == actor) or actor in entry.lapsed

    def receive(self, key: Key) -> bool:
        """A result arrived (may_deliver said so). True if it is the first for this prompt (then received)."""
        entry = self.entries.get(key)
        if entry is None or entry.state in (State.RECEIVED, State.TRAINED):  # None: of a closed epoch
            self.counts["duplicates"] += 1
            return False
        assert entry.state is State.GRANTED or entry.lapsed, f"receive of {key}: never granted"
        self.granted.pop(key, None)
        self._move(entry, State.RECEIVED)
        entry.actor, entry.lapsed = None, ()
        return True

    def requeue(self, key: Key, reason: str, front: bool = True) -> None:
        """Back to pending, at the front of the queue (it has waited longest), or at its back (`front=False`: the
        prompt itself may be why it came back, and must not take the next grant again). A grant that lapsed (its
        lease ran out, its actor was declared dead or went silent) leaves that actor free to deliver it late."""
        entry = self.entries[key]
        assert entry.state in (State.GRANTED, State.RECEIVED), f"requeue of {key} in state {entry.state}"
        holder = entry.actor
        self.granted.pop(key, None)
        if entry.state is State.GRANTED and reason in LAPSES and holder is not None and holder not in entry.lapsed:
            entry.lapsed = (*entry.lapsed, holder)
        self._move(entry, State.PENDING)
        entry.actor = None
        (self.queue.appendleft if front else self.queue.append)(key)
        self.counts[f"requeued_{reason}"] += 1

    def trained(self, key: Key) -> None:
        entry = self.entries[key]
        assert entry.state is State.RECEIVED, f"trained {key} in state {entry.state}"
        self._move(entry, State.TRAINED)
        self.trained_in[key[0]] += 1
        if self.trained_in[key[0]] == self.num_prompts:
            self._close(key[0])

    def _close(self, epoch: int) -> None:
        """Every prompt of `epoch` is trained: its entries go (their state is implied, see state_of)."""
        for pid in range(self.num_prompts):
            del self.entries[(epoch, pid)]
        del self.trained_in[epoch]
        self.closed.add(epoch)

    def _recount(self) -> Counter[State]:
        """Prompts per state from the entries and the closed epochs (what `in_state` keeps as prompts move)."""
        counts = Counter(e.state for e in self.entries.values())
        counts[State.TRAINED] += len(self.closed) * self.num_prompts
        return counts

    def _move(self, entry: Entry, state: State) -> None:
        self.in_state[entry.state] -= 1
        self.in_state[state] += 1
        entry.state = state

    def expire(self, now: float) -> list[Key]:
        """Requeue every grant whose lease passed."""
        expired = [k for k in self.granted if self.entries[k].deadline <= now]
        for key in expired:
            self.requeue(key, "lease")
        return expired

    def release_actor(self, actor: str) -> list[Key]:
        """Requeue every grant held by a dead actor."""
        held = [k for k in self.granted if self.entries[k].actor == actor]
        for key in held:
            self.requeue(key, "dead")
        return held

    def state_counts(self) -> dict[str, int]:
        return {s.value: self.in_state[s] for s in State}

    def check(self) -> None:
        """Invariants: every prompt of every opened epoch has exactly one entry; the per-state counts are exact."""
        assert len(self.entries) + len(self.closed) * self.num_prompts == self.size, "ledger lost or invented a prompt"
        assert +self.in_state == self._recount(), "ledger state counts drifted"
        trained = Counter(k[0] for k, e in self.entries.items() if e.state is State.TRAINED)
        assert +self.trained_in == trained and not self.closed & set(trained), "ledger per-epoch trained counts drifted"

    # ---- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: each opened epoch's states as one string (a char per prompt id), the pending queue in order.

        The queue is what makes the order exact: requeued prompts sit at its front, and the rest of
        the open epoch follows in its seeded shuffle. Epochs not yet opened follow from seed alone.
        """
        queue, seen = [], set()
        for key in self.queue:
            if key not in seen and self.state_of(key) is State.PENDING:
                seen.add(key)
                queue.append(list(key))
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "epochs_opened": self.epochs_opened,
            "states": [self._codes(e) for e in range(self.epochs_opened)],
            "queue": queue,
            "counts": dict(self.counts),
        }

    def _codes(self, epoch: int) -> str:
        if epoch in self.closed:
            return _CODE[State.TRAINED] * self.num_prompts
        return "".join(_CODE[self.entries[(epoch, p)].state] for p in range(self.num_prompts))

    @classmethod
    def from_state(cls, state: dict[str, Any], max_epochs: int) -> Ledger:
        """Rebuild a checkpointed ledger; its granted and received prompts return to pending (requeued_resume)."""
        ledger = cls(state["num_prompts"], max(max_epochs, state["epochs_opened"]), state["seed"])
        ledger.epochs_opened = state["epochs_opened"]
        assert len(state["states"]) == ledger.epochs_opened, "ledger state: one state string per opened epoch"
        done = _CODE[State.TRAINED] * ledger.num_prompts
        for epoch, codes in enumerate(state["states"]):
            assert len(codes) == ledger.num_prompts, f"ledger state: epoch {epoch} has {len(codes)} prompts, not {ledger.num_prompts}"
            if codes == done:
                ledger.closed.add(epoch)
                continue
            for pid, code in enumerate(codes):
                ledger.entries[(epoch, pid)] = Entry(_STATE[code])
            ledger.trained_in[epoch] = codes.count(_CODE[State.TRAINED])
        queue: list[Key] = [(int(e), int(p)) for e, p in state["queue"]]
        assert all(ledger.state_of(k) is State.PENDING for k in queue), "ledger state: a queued prompt is not pending"
        lost = sorted(k for k, e in ledger.entries.items() if e.state in (State.GRANTED, State.RECEIVED))
        for key in lost:
            ledger.entries[key].state = State.PENDING
        ledger.in_state = ledger._recount()
        ledger.queue = deque([*lost, *queue])
        pending = ledger.in_state[State.PENDING]
        assert pending == len(ledger.queue), f"ledger state: {pending} pending prompts, {len(ledger.queue)} queued"
        ledger.counts = Counter(state["counts"])
        ledger.counts["requeued_resume"] += len(lost)
        return ledger
