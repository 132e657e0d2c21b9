import json

import pytest

from learner.hub.core.ledger import Ledger, State


def test_lifecycle_and_counts():
    ledger = Ledger(num_prompts=3, max_epochs=2, seed=0)
    keys = [ledger.next_pending() for _ in range(3)]
    assert sorted(k[1] for k in keys) == [0, 1, 2] and all(k[0] == 0 for k in keys)
    for k in keys:
        ledger.grant(k, "a", deadline=10.0)
    assert ledger.receive(keys[0]) is True
    assert ledger.receive(keys[0]) is False  # duplicate
    ledger.trained(keys[0])
    assert ledger.expire(now=11.0) == keys[1:]  # leases passed
    assert ledger.next_pending() in keys[1:]  # requeued at the front, before epoch 1 opens
    ledger.check()
    assert ledger.counts["duplicates"] == 1 and ledger.counts["requeued_lease"] == 2


def test_dead_actor_releases_only_its_grants():
    ledger = Ledger(num_prompts=4, max_epochs=1, seed=1)
    a, b = ledger.next_pending(), ledger.next_pending()
    ledger.grant(a, "dead", 100.0)
    ledger.grant(b, "alive", 100.0)
    assert ledger.release_actor("dead") == [a]
    assert ledger.entries[a].state is State.PENDING and ledger.entries[b].state is State.GRANTED


def test_late_result_after_lease_is_taken_once():
    ledger = Ledger(num_prompts=1, max_epochs=1, seed=0)
    k = ledger.next_pending()
    ledger.grant(k, "slow", 1.0)
    ledger.expire(2.0)
    assert ledger.receive(k) is True  # the slow actor's work still counts
    assert ledger.next_pending() is None  # and it is not handed out again
    assert ledger.receive(k) is False


def test_epochs_open_in_seeded_order_and_end():
    a = Ledger(num_prompts=5, max_epochs=2, seed=7)
    b = Ledger(num_prompts=5, max_epochs=2, seed=7)
    order_a = [a.next_pending() for _ in range(10)]
    assert order_a == [b.next_pending() for _ in range(10)]
    assert {k[0] for k in order_a} == {0, 1}
    assert a.next_pending() is None
    a.check()


def _drain(ledger: Ledger, n: int) -> list:
    return [ledger.next_pending() for _ in range(n)]


def test_ledger_round_trip_requeues_in_flight_and_continues_the_order():
    a = Ledger(num_prompts=7, max_epochs=3, seed=11)
    keys = _drain(a, 9)  # epoch 0 whole, 2 of epoch 1
    assert [k[0] for k in keys] == [0] * 7 + [1] * 2
    for k in keys:
        a.grant(k, "x", deadline=5.0)
    for k in keys[:6]:
        assert a.receive(k)
    for k in keys[:4]:
        a.trained(k)
    a.requeue(keys[4], "stale")  # received -> pending, at the front of the queue
    a.expire(now=10.0)  # keys 6, 7, 8 were granted: their lease is over, pending again (each to the front)
    assert a.receive(keys[7])  # a late result: received, and still in the queue as a stale entry
    assert a.next_pending() == keys[8]
    a.grant(keys[8], "y", deadline=50.0)
    # trained 0-3; pending 4 and 6 (and the rest of epoch 1); received 5 and 7; granted 8
    state = json.loads(json.dumps(a.state_dict()))  # what learner.json holds
    code = {0: "t", 1: "t", 2: "t", 3: "t", 4: "p", 5: "r", 6: "p", 7: "r", 8: "g"}
    by_key = {k: code[i] for i, k in enumerate(keys)}
    assert state["states"] == ["".join(by_key.get((e, p), "p") for p in range(7)) for e in (0, 1)]
    assert state["queue"][:2] == [list(keys[6]), list(keys[4])] and len(state["queue"]) == 2 + 5  # no stale entry
    b = Ledger.from_state(state, max_epochs=3)
    b.check()
    states = b.states()
    assert [states[k] for k in keys[:4]] == [State.TRAINED] * 4
    assert all(s in (State.TRAINED, State.PENDING) for s in states.values())  # nothing is in flight after a restart
    assert b.counts["requeued_resume"] == 3 and b.counts["requeued_stale"] == 1 and b.counts["requeued_lease"] == 3
    # The prompts that were in flight come first; then exactly what the uninterrupted ledger hands out next,
    # through the rest of epoch 1 and all of epoch 2 (its seeded shuffle).
    rest_a = list(iter(a.next_pending, None))
    rest_b = list(iter(b.next_pending, None))
    assert rest_b == sorted([keys[5], keys[7], keys[8]]) + rest_a
    assert len(rest_b) == 3 * 7 - 4 and {k[0] for k in rest_a} == {0, 1, 2}
    assert not set(keys[:4]) & set(rest_b)  # trained prompts are never handed out again in their epoch


def test_ledger_state_is_checked_on_load():
    a = Ledger(num_prompts=3, max_epochs=2, seed=0)
    k = a.next_pending()
    a.grant(k, "x", 1.0)
    state = a.state_dict()
    assert state["epochs_opened"] == 1 and state["states"] == ["".join("g" if p == k[1] else "p" for p in range(3))]
    with pytest.raises(AssertionError, match="one state string per opened epoch"):
        Ledger.from_state({**state, "states": ["ppp", "ppp"]}, max_epochs=2)
    with pytest.raises(AssertionError, match="pending"):  # a queued prompt that the states call trained
        Ledger.from_state({**state, "states": ["ttt"]}, max_epochs=2)


def test_state_counts_kept_as_prompts_move_match_a_recount():
    """The per-state counts are kept as entries move (the metrics row reads them every update): after any mix of
    grants, results, late results, requeues, expiries, deaths, training and a checkpoint round trip they equal a
    recount of the entries (check() asserts it), and left_to_train is the untrained rest once the last epoch is open."""
    import random

    rng = random.Random(3)
    ledger = Ledger(num_prompts=6, max_epochs=3, seed=2)
    now = 0.0
    for step in range(400):
        now += 1.0
        op = rng.randrange(6)
        granted = list(ledger.granted)
        received = [k for k, e in ledger.entries.items() if e.state is State.RECEIVED]
        if op == 0 and (key := ledger.next_pending()) is not None:
            ledger.grant(key, rng.choice("ab"), deadline=now + rng.choice([0.5, 5.0]))
        elif op == 1 and granted:
            key = rng.choice(granted)
            if ledger.may_deliver(key, ledger.entries[key].actor or "a"):
                ledger.receive(key)
        elif op == 2 and received:
            ledger.trained(rng.choice(received))
        elif op == 3 and received:
            ledger.requeue(rng.choice(received), "stale", front=rng.random() < 0.5)
        elif op == 4:
            ledger.expire(now)
        elif op == 5:
            ledger.release_actor(rng.choice("ab"))
        ledger.check()
        if step == 200:
            ledger = Ledger.from_state(json.loads(json.dumps(ledger.state_dict())), max_epochs=3)
            ledger.check()
    counts = ledger.state_counts()
    assert sum(counts.values()) == ledger.size and counts["trained"] > 0
    left = ledger.left_to_train()
    assert left is None if ledger.epochs_opened < 3 else left == ledger.size - counts["trained"]


def test_left_to_train_only_once_the_last_epoch_is_open():
    ledger = Ledger(num_prompts=2, max_epochs=2, seed=0)
    assert ledger.left_to_train() is None
    keys = [ledger.next_pending() for _ in range(3)]  # opens epoch 1 of 2: the last
    assert ledger.left_to_train() == 4
    for key in keys:
        ledger.grant(key, "a", 10.0)
        ledger.receive(key)
        ledger.trained(key)
    assert ledger.left_to_train() == 1  # one prompt of the last epoch, never granted


def test_an_epoch_trained_whole_is_closed_and_its_prompts_stay_trained():
    """A long run opens an epoch per pass over the data: those trained whole keep no entries (the 60-minute soak's
    learner grew 100 MiB an hour with 1,527 of them), and their prompts still count as trained: a late result for
    one is a duplicate, the counts and a checkpoint round trip keep them, and none is handed out again."""
    ledger = Ledger(num_prompts=5, max_epochs=40, seed=1)
    for _ in range(30 * 5):  # 30 epochs, each trained whole
        key = ledger.next_pending()
        assert key is not None
        ledger.grant(key, "a", deadline=1e9)
        assert ledger.may_deliver(key, "a") and ledger.receive(key)
        ledger.trained(key)
        ledger.check()
    assert ledger.closed == set(range(30)) and not ledger.entries  # nothing kept of them
    late = (3, 2)
    assert ledger.state_of(late) is State.TRAINED and ledger.may_deliver(late, "someone")
    assert not ledger.receive(late) and ledger.counts["duplicates"] == 1
    assert ledger.state_of((31, 0)) is None and not ledger.may_deliver((31, 0), "a")  # no such epoch yet
    assert ledger.holder(late) is None  # an actor may still list it as held (another delivered it late): no holder
    key = ledger.next_pending()  # epoch 30 opens: its entries are the only ones
    assert key is not None and key[0] == 30 and len(ledger.entries) == 5
    ledger.grant(key, "a", deadline=1e9)
    assert ledger.state_counts() == {"pending": 4, "granted": 1, "received": 0, "trained": 150}
    state = json.loads(json.dumps(ledger.state_dict()))
    assert state["states"][:30] == ["ttttt"] * 30  # the checkpoint format is unchanged
    back = Ledger.from_state(state, max_epochs=40)
    back.check()
    assert back.closed == set(range(30)) and len(back.entries) == 5 and back.left_to_train() is None
    assert back.state_counts() == {"pending": 5, "granted": 0, "received": 0, "trained": 150}
    handed = list(iter(back.next_pending, None))
    assert len(handed) == 10 * 5 and {k[0] for k in handed} == set(range(30, 40))  # never a closed epoch's prompt
