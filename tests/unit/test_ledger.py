from learner.hub.ledger import Ledger, State


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
