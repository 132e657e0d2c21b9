"""The hub's rules without a socket: registry, admission, leases, the buffer, eval rounds, restore.

Each test feeds HubState messages with an explicit clock and reads what it would send.
"""

import numpy as np
import pytest
from conftest import rollout_group

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.core.evaluation import EvalRound, Sampling
from learner.hub.core.state import HubState
from protocol import messages as m
from protocol.config import load_config

A, B = b"conn-a", b"conn-b"


@pytest.fixture(scope="module")
def prompts():
    return PromptSet(addition_items()[:40], build_tokenizer())


def hub(prompts, *overrides):
    cfg = load_config(
        None,
        [
            "rollout.samples_per_prompt=3",
            "train.prompts_per_step=4",
            "staleness.max_staleness=1",
            "staleness.lease_s=10",
            "hub.actor_timeout_s=5",
            *overrides,
        ],
    )
    return HubState(cfg, prompts, now=0.0)


def register(state, identity=A, actor="a0", served=0, now=0.0, key=None):
    return state.handle(identity, m.Register(actor_id=actor, host="h", pid=1, served_version=served), now, key)


def grants(outs):
    return [o.msg for o in outs if isinstance(o.msg, m.WorkGrant)]


def group_for(grant, actor="a0", version=0):
    return rollout_group(n=3, actor=actor, prompt_id=grant.prompt_id, epoch=grant.epoch, version=version, prompt_tokens=grant.prompt_tokens)


def test_register_ack_and_unknown_actor(prompts):
    state = hub(prompts)
    (ack,) = register(state)
    assert isinstance(ack.msg, m.RegisterAck) and ack.reply and ack.msg.policy_version == 0
    (err,) = state.handle(A, m.Heartbeat(actor_id="stranger", served_version=0, groups_in_flight=0), 1.0)
    assert err.msg.code == "unknown_actor" and state.counters["unknown_actor"] == 1


def test_admission_grants_at_most_one_update_ahead(prompts):
    """With k = 1 and 4 prompts per update, an idle learner at version 0 grants 2 updates' worth: (k + 1) x 4."""
    state = hub(prompts)
    register(state)
    outs = state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=100), 0.0)
    assert len(grants(outs)) == 8 and all(not o.reply for o in outs)  # grants wait for room, replies do not
    assert state.outstanding() == 8
    assert grants(state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=100), 0.1)) == []  # nothing more until one is trained


def test_grants_skip_an_actor_serving_too_old_a_version(prompts):
    state = hub(prompts)
    state.finish_update(3, [])
    register(state, served=2)  # grants go only to actors serving the current version (staleness.min_grant_version)
    assert grants(state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=4), 0.0)) == []
    outs = state.handle(A, m.WeightVersion(actor_id="a0", served_version=3, load_s=0.1, group_epoch=1), 0.5)
    assert len(grants(outs)) == 4 and {g.policy_version for g in grants(outs)} == {3}


def test_received_groups_are_taken_oldest_version_first_and_stale_ones_requeued(prompts):
    state = hub(prompts)
    register(state)
    gs = grants(state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=8), 0.0))
    for g in gs[:4]:
        state.handle(A, group_for(g), 1.0)
    assert len(state.buffer) == 4 and state.ledger.state_counts()["received"] == 4
    batch = state.take(4)
    assert batch is not None and state.training and state.take(1) is None
    state.finish_update(1, [i.key for i in batch])
    state.handle(A, m.Heartbeat(actor_id="a0", served_version=1, groups_in_flight=0), 2.0)
    for g in gs[4:6]:
        state.handle(A, group_for(g, version=0), 3.0)  # staleness 1 at version 1: still admissible
    state.finish_update(2, [])
    assert state.take(1) is None  # version 0 at learner version 2: too stale, dropped and requeued
    assert state.counters["dropped_stale"] == 2 and state.ledger.state_counts()["trained"] == 4


def test_rejections_give_the_prompt_back_at_once(prompts):
    state = hub(prompts)
    register(state)
    g1, g2 = grants(state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=2), 0.0))
    outs = state.handle(A, rollout_group(n=5, prompt_id=g1.prompt_id, epoch=g1.epoch), 1.0)
    assert outs[0].msg.code == "rejected" and "expected 3" in outs[0].msg.detail
    outs = state.handle(A, group_for(g2, version=7), 1.0)  # a version this learner never had
    assert outs[0].msg.code == "rejected" and "newer than the learner's 0" in outs[0].msg.detail
    assert state.ledger.counts["requeued_rejected"] == 2 and state.outstanding() == 0


def test_silent_actor_and_expired_lease_requeue_their_prompts(prompts):
    state = hub(prompts, "hub.silent_s=8")  # a0 last heard at 6: its leases run out at 10 before it counts as silent
    register(state)
    register(state, B, "a1", now=0.0)
    state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=2), 0.0)
    state.handle(B, m.WorkRequest(actor_id="a1", max_prompts=2), 0.0)
    for t in (2.0, 4.0, 6.0):  # a0 keeps beating, a1 is silent past hub.actor_timeout_s = 5
        state.handle(A, m.Heartbeat(actor_id="a0", served_version=0, groups_in_flight=0), t)
        state.tick(t)
    assert list(state.actors) == ["a0"] and state.counters["actors_lost"] == 1
    state.tick(10.5)  # a0's leases (10 s) ran out too
    assert state.ledger.counts["requeued_dead"] == 2 and state.ledger.counts["requeued_lease"] == 2
    assert state.actors["a0"].held == set()


def test_a_closed_connection_releases_its_actor_and_listeners_hear_it(prompts):
    state = hub(prompts)
    heard = []
    state.listeners.append(lambda actor, joined: heard.append((actor, joined)))
    register(state)
    state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=3), 0.0)
    state.registry.connection_closed(A)
    assert heard == [("a0", True), ("a0", False)] and state.ledger.counts["requeued_dead"] == 3
    assert state.counters["actors_disconnected"] == 1


def test_only_the_registering_key_may_take_an_id_over(prompts):
    state = hub(prompts)
    register(state, key="alice")
    (out,) = register(state, B, key="mallory")
    assert out.msg.code == "id_taken" and state.actors["a0"].identity == A
    (out,) = register(state, B, key="alice")  # the same key from a new connection: a restarted actor
    assert isinstance(out.msg, m.RegisterAck) and state.actors["a0"].identity == B


def test_one_actor_per_connection(prompts):
    state = hub(prompts)
    for i in range(5):
        register(state, A, f"id{i}")
    assert list(state.actors) == ["id4"] and state.counters["reregistered"] == 4


def eval_result(round_id, split, prompt_id):
    return m.EvalResult(
        actor_id="a0",
        eval_round=round_id,
        split=split,
        prompt_id=prompt_id,
        lengths=np.ones(1, np.int32),
        rewards=np.ones(1, np.float32),
        finish_reasons=["stop"],
        version_min=0,
        version_max=0,
        gen_s=0.1,
    )


def test_eval_round_grants_to_actors_serving_its_version_and_takes_results(prompts):
    state = hub(prompts)
    register(state, served=0)
    register(state, B, "a1", served=-1)
    val = PromptSet(addition_items()[:2], build_tokenizer())
    state.eval_round = EvalRound(1, 0, {"val": val}, Sampling(n=1, temperature=0.0), lease_s=10)
    outs = state.pump(0.0)
    evals = [o for o in outs if isinstance(o.msg, m.EvalGrant)]
    assert len(evals) == 2 and {o.identity for o in evals} == {A}  # a1 serves no version yet
    for o in evals:
        result = eval_result(1, o.msg.split, o.msg.prompt_id)
        assert state.handle(A, result, 1.0) == []
    assert state.eval_round.done
    state.handle(A, eval_result(0, "val", 0), 2.0)
    assert state.counters["eval_late"] == 1


def test_max_staleness_refuses_a_bound_fresh_samples_would_break(prompts):
    state = hub(prompts, "train.mini_batches=2")
    with pytest.raises(ValueError, match="max_staleness: 0 < 2 optimizer steps"):
        state.updates.set_max_staleness(0, "test")
    assert state.updates.set_max_staleness(3, "test") == 1 and state.max_staleness == 3


def test_restore_continues_the_ledger_and_refuses_other_data(prompts):
    state = hub(prompts)
    register(state)
    state.handle(A, m.WorkRequest(actor_id="a0", max_prompts=2), 0.0)
    saved = state.export_state(0.0)
    again = hub(prompts)
    again.restore(saved, version=5, now=0.0)
    assert again.version == 5 and again.ledger.state_counts()["pending"] == 40  # what was out comes back first
    assert again.ledger.counts["requeued_resume"] == 2
    assert {again.ledger.next_pending(), again.ledger.next_pending()} == state.actors["a0"].held
    other = HubState(state.cfg, PromptSet(addition_items()[:10], build_tokenizer()), now=0.0)
    with pytest.raises(ValueError, match="the checkpoint's ledger has 40 prompts"):
        other.restore(saved, version=5, now=0.0)


def test_an_update_without_a_sync_is_not_counted_as_one(prompts):
    """Every step skipped: nothing moved and nothing was sent, so `fleetrl status` must not show a sync."""
    state = hub(prompts)
    state.updates.note_update(1.0, 10.0, 0.2, 0.05)
    state.updates.note_update(1.5, None, 0.0, None)
    t = state.updates.times
    assert (t.updates, t.syncs, t.sync_started, t.sync_s, t.broadcast_s, t.step_s) == (2, 1, 10.0, 0.2, 0.05, 1.5)


def test_a_message_not_for_the_hub_is_a_protocol_error(prompts):
    state = hub(prompts)
    (out,) = state.handle(A, m.Shutdown(reason="x"), 0.0)
    assert out.msg.code == "protocol" and state.counters["protocol_errors"] == 1
