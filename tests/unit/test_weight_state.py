"""The weight sender's decisions without a socket, a store or a group: which epoch an attempt uses, who holds the
version after it, who is late to join and whom to evict, why an attempt in flight ends.

Each test drives learner/weights/state.py's SenderState with an explicit clock; groups are plain strings (the
state only keeps and hands back the caller's groups). The I/O around it: tests/integration/test_weight_join.py
and test_weight_death.py.
"""

from learner.weights.membership import ALONE
from learner.weights.state import SenderState

JOIN_S = 3.0  # weights.join_timeout_s
CPU = [""]  # one CPU rank


def sender(*registered: str) -> SenderState[str]:
    state: SenderState[str] = SenderState("", JOIN_S)
    for a in registered:
        state.on_membership(a, True)
    return state


def begin(state, version, members, catchup=False, now=0.0, live=None):
    """An attempt, its WeightSyncs sent at `now` to `live` (default: its members)."""
    begun = state.begin(version, members, [CPU] * len(members), catchup)
    state.sent(begun.attempt, members if live is None else live, now)
    return begun


def succeed(state, att, group="g"):
    """A new epoch joined and connected (or the last one reused), then every bucket sent."""
    if att.new_group:
        state.joining(att)
        state.settle(att, set(att.members), carry=False)
        state.connected(att, group)
    state.ended()
    state.served(att)


def test_a_sync_reuses_the_epoch_of_exactly_the_same_connected_members():
    state = sender("a", "b", "c")  # all registered before the first sync: regular members
    assert state.start_serving(["a", "b", "c"]) == ["a", "b", "c"]
    first = begin(state, 1, ["a", "b"])
    att = first.attempt
    assert att.new_group and att.epoch == 1 and first.close is None and not att.side
    assert (att.plan.backend, att.plan.world_size, att.plan.first, att.plan.counts) == ("gloo", 3, (1, 2), (1, 1))
    assert att.joins_by == JOIN_S
    succeed(state, att, "g1")
    assert state.group == "g1" and state.next_members(1, ["a", "b", "c"]) == ["c"]

    again = begin(state, 2, ["a", "b"]).attempt
    assert not again.new_group and again.epoch == 1 and again.plan is att.plan  # no join, no new group
    succeed(state, again)
    grown = begin(state, 3, ["a", "b", "c"])
    assert grown.attempt.new_group and grown.attempt.epoch == 2 and grown.close == ("g1", "gloo")
    assert state.group is None and state.members == ["a", "b", "c"] and state.group_epoch == 2


def test_a_member_that_registers_again_makes_a_new_epoch_and_lacks_the_version():
    state = sender("a", "b")
    state.start_serving(["a", "b"])
    succeed(state, begin(state, 1, ["a", "b"]).attempt, "g1")
    state.on_membership("b", True)  # a new process under the same id
    assert state.next_members(1, ["a", "b"]) == ["b"]  # it lost version 1 (and is on probation: a newcomer)
    succeed(state, begin(state, 1, ["b"], catchup=True).attempt, "side")  # b proves itself in an epoch of its own
    assert state.start_serving(["a", "b"]) == ["a", "b"]
    begun = begin(state, 2, ["a", "b"])  # the same ids as the group's, but b's new process is not in it
    assert begun.attempt.new_group and begun.attempt.epoch == 3 and begun.close == ("g1", "gloo")


def test_a_newcomer_is_caught_up_in_an_epoch_of_its_own_and_joins_the_next_syncs():
    state = sender("a")
    state.start_serving(["a"])
    succeed(state, begin(state, 1, ["a"]).attempt, "g1")
    state.on_membership("n", True)
    assert state.next_members(1, ["a", "n"]) == ["n"]
    side = begin(state, 1, ["n"], catchup=True)
    assert side.attempt.side and side.attempt.new_group and side.attempt.epoch == 2 and side.close is None
    succeed(state, side.attempt, "side")
    assert state.group == "g1" and state.group_epoch == 1 and state.members == ["a"]  # the everyone epoch kept
    assert state.holds == {"a": 1, "n": 1} and state.next_members(1, ["a", "n"]) == []
    assert state.start_serving(["a", "n"]) == ["a", "n"]  # proven: a regular member now
    everyone = begin(state, 2, ["a", "n"])
    assert everyone.attempt.epoch == 3 and not everyone.attempt.side and everyone.close == ("g1", "gloo")


def test_regular_members_are_served_before_those_on_probation():
    state = sender("a")
    state.start_serving(["a"])
    state.on_membership("n", True)
    state.on_membership("a", True)  # a re-registered too: on probation now, like n
    assert state.next_members(1, ["a", "n"]) == ["a", "n"]  # newcomers together
    state.on_membership("r", False)  # removing someone unknown changes nothing
    assert state.next_members(1, ["a", "n"]) == ["a", "n"]


def test_removing_a_member_of_the_attempt_in_flight_gives_it_up_once():
    state = sender("a", "b", "c")
    att = begin(state, 1, ["a", "b"]).attempt
    state.on_membership("c", False)  # not a member of it
    state.on_membership("b", True)  # a registration is not a removal
    assert state.why_abort(att, stopping=False) is None
    state.on_membership("b", False)
    state.on_membership("a", False)
    assert state.why_abort(att, stopping=False) == "member b was removed by the hub"  # the first reason stays
    state.ended()
    state.on_membership("x", True)
    state.on_membership("x", False)
    assert state.abort_why == "member b was removed by the hub"  # nothing in flight: no new reason


def test_a_member_removed_before_its_attempt_was_registered_gives_it_up():
    state = sender("a", "b")
    att = begin(state, 1, ["a", "b"], now=10.0, live=["a"]).attempt
    assert att.joins_by == 10.0 + JOIN_S
    assert state.why_abort(att, stopping=False) == "['b'] removed before the attempt began"
    nxt = begin(state, 1, ["a"], now=11.0).attempt  # a new attempt starts with no reason
    assert state.why_abort(nxt, stopping=False) is None
    state.on_membership("c", True)
    both = begin(state, 1, ["a", "c"], now=12.0, live=None).attempt
    state.on_membership("c", False)  # the listener saw it first: its reason stays
    state.sent(both, ["a"], 12.0)
    assert state.why_abort(both, stopping=False) == "member c was removed by the hub"


def test_only_a_catchup_gives_up_when_serving_stops():
    state = sender("a")
    own = begin(state, 1, ["a"]).attempt
    assert state.why_abort(own, stopping=True) is None  # the optimizer step waits for the sync's own attempt
    catchup = begin(state, 1, ["a"], catchup=True).attempt
    assert state.why_abort(catchup, stopping=True) == "the sender stopped serving this version (the next update has begun)"


def test_only_members_still_in_the_registration_sent_to_hold_the_version():
    state = sender("a", "b")
    att = begin(state, 1, ["a", "b"]).attempt
    state.on_membership("b", True)  # b came back (a new process) while the attempt ran: it lacks version 1
    succeed(state, att)
    assert state.holds == {"a": 1} and state.next_members(1, ["a", "b"]) == ["b"]
    assert state.next_members(2, ["a", "b"]) == ["a", "b"]


def test_a_member_late_to_join_is_evicted_unless_it_registered_again_since():
    state = sender("a", "b", "c")
    att = begin(state, 1, ["a", "b", "c"], now=0.0).attempt
    state.joining(att)
    assert state.overdue(att, JOIN_S) == [] and state.overdue(att, JOIN_S + 0.1) == ["a", "b", "c"]
    state.on_membership("c", True)  # c is back under a new registration: not to blame
    verdict = state.late(att, ["b", "c"], joined={"a"})
    missed = f"did not join a weight group epoch within weights.join_timeout_s = {JOIN_S} s"
    assert verdict.evict == {"b": f"{missed} (1 attempt)"}
    assert verdict.why == f"['b', 'c'] {missed} (epoch 1)"
    assert state.join_by == {} and not att.repeat  # the deadline starts afresh; the first failure is a warning


def test_a_catchup_cut_short_by_the_next_update_keeps_its_join_deadline():
    """A newcomer whose catch-ups are cut short at every update (a step shorter than the join deadline) is still
    evicted once its deadline has passed in all, and the failures after the first are logged quietly."""
    state = sender("a")
    state.start_serving(["a"])
    state.on_membership("n", True)
    first = begin(state, 1, ["n"], catchup=True, now=0.0).attempt
    state.joining(first)
    state.cut_short(first, joined=set(), stopping=True)
    assert state.join_by[("n", 1)].by == JOIN_S and not first.repeat
    state.ended()
    second = begin(state, 2, ["n"], catchup=True, now=2.5).attempt
    state.joining(second)
    assert second.joining["n"].by == JOIN_S and second.joining["n"].attempts == 2  # the first attempt's deadline
    assert state.overdue(second, JOIN_S + 0.1) == ["n"]
    verdict = state.late(second, ["n"], joined=set())
    assert verdict.evict["n"].endswith("(2 attempts)") and second.repeat


def test_a_cut_short_that_is_not_the_next_update_starts_the_deadline_afresh():
    state = sender("a", "b")
    state.start_serving(["a"])
    state.on_membership("n", True)
    state.on_membership("m", True)
    att = begin(state, 1, ["n", "m"], catchup=True, now=0.0).attempt
    state.joining(att)
    state.on_membership("m", False)  # a removal, not the stop: nobody carries a deadline
    state.cut_short(att, joined=set(), stopping=True)
    assert state.join_by == {} and not att.repeat
    other = begin(state, 1, ["n"], catchup=True, now=1.0).attempt
    state.joining(other)
    state.cut_short(other, joined={"n"}, stopping=True)  # n had joined: its next attempt starts afresh
    assert state.join_by == {}


def test_a_registration_that_ends_drops_its_join_deadline():
    state = sender("a")
    state.start_serving(["a"])
    state.on_membership("n", True)
    att = begin(state, 1, ["n"], catchup=True).attempt
    state.joining(att)
    assert ("n", 1) in state.join_by
    state.on_membership("n", False)
    assert state.join_by == {}


def test_a_group_that_does_not_connect_tries_its_members_apart_then_evicts_the_one_alone():
    state = sender("a")
    state.start_serving(["a"])
    state.on_membership("x", True)
    state.on_membership("y", True)
    att = begin(state, 1, ["x", "y"], catchup=True).attempt
    assert state.connect_failed(att) == {} and state.membership.probation == {"x": ALONE, "y": ALONE}
    state.ended()
    assert state.next_members(1, ["a", "x", "y"]) == ["a"] and state.next_members(1, ["x", "y"]) == ["x"]
    alone = begin(state, 1, ["x"], catchup=True).attempt
    why = f"weight group epoch {alone.epoch} did not connect within weights.join_timeout_s = {JOIN_S} s"
    assert state.connect_failed(alone) == {"x": why + " (its only member: nobody else to blame)"}


def test_a_failed_attempt_drops_the_everyone_group_but_keeps_it_for_a_probation_epoch():
    state = sender("a")
    state.start_serving(["a"])
    succeed(state, begin(state, 1, ["a"]).attempt, "g1")
    state.on_membership("n", True)
    side = begin(state, 1, ["n"], catchup=True).attempt
    assert state.gave_up(side) is None and state.group == "g1"  # the caller closes the probation epoch's own group
    state.ended()
    own = begin(state, 2, ["a"]).attempt
    assert not own.new_group
    assert state.gave_up(own) == "g1" and state.group is None and state.members == [] and state.plan is None
    state.ended()
    retry = begin(state, 2, ["a"])
    assert retry.attempt.new_group and retry.attempt.epoch == 3 and retry.close is None  # a new epoch; epochs never reused


def test_closing_hands_back_the_connected_group_once_and_the_next_sync_forms_a_new_epoch():
    state = sender("a")
    state.start_serving(["a"])
    att = begin(state, 1, ["a"]).attempt
    succeed(state, att, "g1")
    assert state.closing() == ("g1", "gloo")
    assert state.group is None and state.closing() is None  # closed once
    again = begin(state, 2, ["a"])
    assert again.attempt.new_group and again.attempt.epoch == 2 and again.close is None  # nothing left to close
