"""Every rollout group is checked against the model and the grant before the hub admits it (learner/hub/core/checks.py),
an actor that keeps failing the checks is quarantined (learner/hub/core/quarantine.py), and the learner refuses what
still gets through (learner/train/batch.py: check_batch). One test per way an admitted actor crashed or
corrupted a learner before these checks; HubState is driven with an explicit clock, no socket.
"""

import json

import numpy as np
import pytest
from conftest import rollout_group

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.core.ledger import State
from learner.hub.core.state import HubState
from learner.train.batch import InvalidBatch, check_batch
from learner.train.shard import make_shares
from learner.update import settle
from protocol import messages as m
from protocol.config import load_config

A, B = b"conn-a", b"conn-b"
VOCAB = 20  # rows of the tiny model's embedding (deploy/tiny.py: one per tokenizer entry)


@pytest.fixture(scope="module")
def prompts():
    return PromptSet(addition_items()[:40], build_tokenizer())


def hub(prompts, *overrides):
    cfg = load_config(
        None, ["rollout.samples_per_prompt=3", "train.prompts_per_step=4", "staleness.lease_s=10", "hub.actor_timeout_s=100", *overrides]
    )
    state = HubState(cfg, prompts, now=0.0, vocab_size=VOCAB)
    for identity, actor in ((A, "a0"), (B, "b0")):
        state.handle(identity, m.Register(actor_id=actor, host="h", pid=1, served_version=0), 0.0)
    return state


def grant(state, identity=A, actor="a0", n=1, now=0.0):
    outs = state.handle(identity, m.WorkRequest(actor_id=actor, max_prompts=n), now)
    return [o.msg for o in outs if isinstance(o.msg, m.WorkGrant)]


def group_for(g, actor="a0", seed=0):
    return rollout_group(n=3, actor=actor, prompt_id=g.prompt_id, epoch=g.epoch, prompt_tokens=g.prompt_tokens, seed=seed)


def errors(outs):
    return [o.msg for o in outs if isinstance(o.msg, m.Error)]


def long_completion(g):
    """4,000 tokens where the engine's limit is 64."""
    lengths = np.asarray([4000, 1, 1], np.int32)
    g.lengths, g.completion_tokens = lengths, np.ones(4002, np.int32)
    g.behaviour_logprobs = np.full(4002, -0.5, np.float32)


def with_parts(*names, value=0.5):
    """The group carries these reward part names (a value for each completion and name)."""

    def edit(g):
        g.reward_part_names = list(names)
        g.reward_parts = np.full(len(g.lengths) * len(names), value, np.float32)

    return edit


ROWS = {  # what an admitted actor sent -> the check that refuses it (hub/rejected_<reason>)
    "token id >= vocabulary": (lambda g: g.completion_tokens.__setitem__(0, VOCAB), "token"),
    "negative token id": (lambda g: g.completion_tokens.__setitem__(0, -1), "token"),
    "reward 3e38": (lambda g: g.rewards.__setitem__(1, np.float32(3e38)), "reward"),
    "4000 tokens, limit 64": (long_completion, "length"),
    "empty prompt": (lambda g: setattr(g, "prompt_tokens", np.zeros(0, np.int32)), "prompt"),
    "logprob -200": (lambda g: g.behaviour_logprobs.__setitem__(0, np.float32(-200)), "logprob"),
    "finish reason abort": (lambda g: g.finish_reasons.__setitem__(2, "abort"), "finish"),
    "17 reward part names": (with_parts(*(f"p{i:02d}" for i in range(17))), "parts"),
    "unsorted part names": (with_parts("b", "a"), "parts"),
    "repeated part name": (with_parts("a", "a"), "parts"),
    "part name of 65 characters": (with_parts("x" * 65), "parts"),
    "part name with a newline": (with_parts("a\nb"), "parts"),
    "empty part name": (with_parts(""), "parts"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_bad_group_is_refused_counted_requeued_and_explained(prompts, row):
    edit, reason = ROWS[row]
    state = hub(prompts, "rollout.max_tokens=64", "actor.max_model_len=128")
    (g,) = grant(state)
    bad = group_for(g)
    edit(bad)
    outs = state.handle(A, bad, 1.0)
    (err,) = errors(outs)
    assert err.code == "rejected" and f"refused, {reason}:" in err.detail
    assert state.counters[f"rejected_{reason}"] == 1 and not state.buffer
    assert state.ledger.state_counts()["received"] == 0 and state.ledger.counts["requeued_rejected"] == 1
    assert state.actors["a0"].held == set()  # its slot is free
    key = (g.epoch, g.prompt_id)
    if reason == "reward":  # perhaps this prompt's reward every time: last in the queue, not the next grant again
        assert state.ledger.queue[-1] == key and state.ledger.queue[0] != key
        state.ledger.queue.remove(key)
        state.ledger.queue.appendleft(key)
    again = grant(state, now=1.5)  # first in the queue
    assert [(x.epoch, x.prompt_id) for x in again] == [key]
    assert not errors(state.handle(A, group_for(again[0]), 2.0)) and len(state.buffer) == 1  # the honest group goes in


def test_a_completion_may_fill_the_context_a_long_prompt_leaves_and_no_more(prompts):
    """Open-Reasoner-Zero's shape: prompts up to data.max_prompt_tokens in a context that cannot hold one of them plus
    rollout.max_tokens; a completion may run to the context's end (the engine stops it there), not past it."""
    state = hub(prompts, "rollout.max_tokens=64", "actor.max_model_len=66", "data.max_prompt_tokens=10")
    (g,) = grant(state)
    budget = 66 - len(g.prompt_tokens)
    assert budget < 64
    for length, refused in ((budget + 1, True), (budget, False)):
        group = group_for(g)
        group.lengths = np.asarray([length, 1, 1], np.int32)
        group.completion_tokens = np.ones(length + 2, np.int32)
        group.behaviour_logprobs = np.full(length + 2, -0.5, np.float32)
        (err,) = errors(state.handle(A, group, 1.0)) or [None]
        if refused:
            assert err is not None and f"outside 1..{budget} (rollout.max_tokens 64, actor.max_model_len 66 - prompt" in err.detail
            (g,) = grant(state, now=1.5)
        else:
            assert err is None and len(state.buffer) == 1


def test_reward_parts_are_metrics_and_any_finite_value_is_taken(prompts):
    state = hub(prompts)
    (g,) = grant(state)
    group = group_for(g)
    with_parts("length", value=3e38)(group)
    assert not errors(state.handle(A, group, 1.0)) and len(state.buffer) == 1


def test_a_group_for_a_prompt_never_granted_is_refused(prompts):
    state = hub(prompts)
    key = state.ledger.next_pending()  # pending: nobody holds it
    state.ledger.queue.appendleft(key)
    forged = rollout_group(n=3, actor="a0", epoch=key[0], prompt_id=key[1], prompt_tokens=prompts[key[1]].tokens)
    (err,) = errors(state.handle(A, forged, 1.0))
    assert err.code == "rejected" and "grant" in err.detail and state.counters["rejected_grant"] == 1
    assert state.ledger.entries[key].state is State.PENDING and not state.buffer
    unknown = rollout_group(n=3, actor="a0", epoch=7, prompt_id=-1)  # no such prompt or epoch: not an index from the end
    assert errors(state.handle(A, unknown, 1.0))[0].code == "rejected" and state.counters["rejected_grant"] == 2


def test_a_group_for_someone_elses_prompt_is_refused_and_their_grant_kept(prompts):
    state = hub(prompts)
    (g,) = grant(state, B, "b0")
    (err,) = errors(state.handle(A, group_for(g, actor="a0"), 1.0))
    assert err.code == "rejected" and "not granted to 'a0'" in err.detail
    entry = state.ledger.entries[(g.epoch, g.prompt_id)]
    assert entry.state is State.GRANTED and entry.actor == "b0" and state.actors["b0"].held == {(g.epoch, g.prompt_id)}
    assert not errors(state.handle(B, group_for(g, actor="b0"), 2.0)) and len(state.buffer) == 1


def test_a_late_result_of_a_lapsed_grant_is_still_taken(prompts):
    """A lease that ran out (or an actor declared dead) does not make the work someone else's until it is delivered."""
    state = hub(prompts)
    (g,) = grant(state)
    state.tick(10.5)  # the lease (10 s) lapsed: pending again
    assert state.ledger.entries[(g.epoch, g.prompt_id)].state is State.PENDING
    assert not errors(state.handle(A, group_for(g), 11.0)) and len(state.buffer) == 1
    assert state.counters["rejected_grant"] == 0


def test_an_actor_that_keeps_sending_bad_groups_is_quarantined(prompts):
    state = hub(prompts, "hub.quarantine_after=3", "hub.quarantine_window_s=60", "hub.quarantine_s=100")
    heard = []
    state.listeners.append(lambda actor, joined: heard.append((actor, joined)))
    held = grant(state, n=4)
    bad = [group_for(g) for g in held[:3]]
    for b in bad:
        b.completion_tokens[0] = VOCAB
    assert [e.code for e in errors(state.handle(A, bad[0], 1.0))] == ["rejected"]
    assert [e.code for e in errors(state.handle(A, bad[1], 2.0))] == ["rejected"]
    assert [e.code for e in errors(state.handle(A, bad[2], 3.0))] == ["rejected", "quarantined"]
    assert "a0" not in state.actors and heard == [("a0", False)] and state.counters["actors_quarantined"] == 1
    assert state.ledger.counts["requeued_quarantined"] == 1  # the grant it still held went back to the queue
    # Its connection is refused, whatever it sends; so is its id from any connection, until hub.quarantine_s passes.
    (err,) = state.handle(A, m.Heartbeat(actor_id="a0", served_version=0, groups_in_flight=0), 4.0)
    assert err.msg.code == "quarantined"
    (err,) = state.handle(b"conn-c", m.Register(actor_id="a0", host="h", pid=2, served_version=0), 5.0)
    assert err.msg.code == "quarantined" and state.counters["quarantined_messages"] == 2
    # The late result of a grant it lost by quarantine is not its to give any more.
    assert not state.ledger.may_deliver((held[3].epoch, held[3].prompt_id), "a0")
    # A learner that resumes from a checkpoint taken now goes on refusing it for the time it has left (through JSON,
    # as state/learner.json keeps it; its own clock starts elsewhere).
    saved = json.loads(json.dumps(state.export_state(now=50.0)))
    assert saved["quarantine"] == {"a0": 53.0}
    resumed = HubState(state.cfg, prompts, now=1000.0, vocab_size=VOCAB)
    resumed.restore(saved, version=0, now=1000.0)
    (err,) = resumed.handle(b"conn-d", m.Register(actor_id="a0", host="h", pid=3, served_version=0), 1050.0)
    assert err.msg.code == "quarantined"
    (ack,) = resumed.handle(b"conn-d", m.Register(actor_id="a0", host="h", pid=3, served_version=0), 1054.0)
    assert isinstance(ack.msg, m.RegisterAck)
    state.tick(104.0)
    (ack,) = state.handle(b"conn-c", m.Register(actor_id="a0", host="h", pid=2, served_version=0), 104.0)
    assert isinstance(ack.msg, m.RegisterAck)


def test_refusals_outside_the_window_do_not_add_up(prompts):
    state = hub(prompts, "hub.quarantine_after=2", "hub.quarantine_window_s=10")
    for t in (0.0, 20.0, 40.0):
        (g,) = grant(state, now=t)
        bad = group_for(g)
        bad.completion_tokens[0] = VOCAB
        assert [e.code for e in errors(state.handle(A, bad, t + 1))] == ["rejected"]
    assert "a0" in state.actors and state.counters["rejected_token"] == 3
    # A version newer than the learner's follows a learner restart: no fault of the actor, no strike.
    (g,) = grant(state, now=50.0)
    ahead = group_for(g)
    ahead.version_min = ahead.version_max = 5
    for t in (51.0, 52.0):
        state.handle(A, ahead, t)
    assert "a0" in state.actors and state.counters["rejected_ahead"] == 2


def test_refusals_that_are_not_the_actors_fault_never_quarantine_it(prompts):
    """A reward beyond rollout.reward_bound comes from the run's own reward function, the same on every actor:
    striking it would shut the whole fleet out. A group for a real prompt not granted to it may be an honest late
    result whose lapsed grant went elsewhere and came back. A prompt of no opened epoch is the actor's doing."""
    state = hub(prompts, "hub.quarantine_after=1")
    for t in (1.0, 2.0, 3.0):
        (g,) = grant(state, now=t)
        bad = group_for(g)
        bad.rewards[0] = 1e9
        assert [e.code for e in errors(state.handle(A, bad, t))] == ["rejected"]
    assert "a0" in state.actors and state.counters["rejected_reward"] == 3
    # A finish reason other than stop or length is vLLM's doing (an actor from before actors/rollout.py regenerated
    # such groups would send them): refused, never a strike.
    for t in (3.1, 3.2):
        (g,) = grant(state, now=t)
        unfinished = group_for(g)
        unfinished.finish_reasons[0] = "abort"
        assert [e.code for e in errors(state.handle(A, unfinished, t))] == ["rejected"]
    assert "a0" in state.actors and state.counters["rejected_finish"] == 2
    pending = state.ledger.next_pending()  # a real prompt, granted to nobody now
    state.ledger.queue.appendleft(pending)
    late = rollout_group(n=3, prompt_id=pending[1], epoch=pending[0])
    assert [e.code for e in errors(state.handle(A, late, 4.0))] == ["rejected"]
    assert "a0" in state.actors and state.counters["rejected_grant"] == 1
    invented = rollout_group(n=3, prompt_id=0, epoch=999)
    assert [e.code for e in errors(state.handle(A, invented, 5.0))] == ["rejected", "quarantined"]
    assert "a0" not in state.actors


# ---- the learner's second line: check_batch on rank 0, before the scatter ----------------------------------


def _groups(n=2):
    return [rollout_group(n=3, prompt_id=i, seed=i) for i in range(n)]


@pytest.mark.parametrize("row", ["token id >= vocabulary", "negative token id", "nan logprob", "positive logprob", "inf reward"])
def test_the_learner_refuses_a_batch_no_model_could_train_on(row):
    groups = _groups()
    g = groups[1]
    if row == "token id >= vocabulary":
        g.completion_tokens[0] = VOCAB
    elif row == "negative token id":
        g.prompt_tokens[0] = -1
    elif row == "nan logprob":
        g.behaviour_logprobs[0] = np.nan
    elif row == "positive logprob":
        g.behaviour_logprobs[0] = 0.5
    else:
        g.rewards[0] = np.inf
    cfg = load_config(None, ["rollout.samples_per_prompt=3", "train.prompts_per_step=2", "train.micro_batch_samples=6"])
    check_batch(_groups(), VOCAB)  # the untouched batch passes
    assert len(make_shares(cfg, _groups(), 0, 1, 1, vocab_size=VOCAB)[0][0].samples) == 6
    with pytest.raises(InvalidBatch, match="group of prompt 1"):
        make_shares(cfg, groups, 0, 1, 1, vocab_size=VOCAB)


def _taken_batch(state):
    """4 groups, 2 from each actor: the hub grants an actor at most its share of the slots."""
    for identity, actor in ((A, "a0"), (B, "b0")):
        for g in grant(state, identity, actor, n=2):
            state.handle(identity, group_for(g, actor), 1.0)
    batch = state.take(4)
    assert batch is not None and len(batch) == 4
    return batch


class _Facade:
    """The two Hub calls settle makes, straight on a HubState."""

    def __init__(self, state):
        self.state = state

    def abort_update(self, items, version=None):
        self.state.abort_update(items, version)

    def finish_update(self, version, trained):
        self.state.finish_update(version, trained)


def test_an_update_with_a_skipped_step_requeues_its_prompts_and_counts_only_applied_steps(prompts):
    """S = 4 optimizer steps, step 2 skipped: the weights moved by 3 steps, so the version is 3, and no prompt of
    the update is marked trained (they are generated and trained again). Without a failed step: 4, all trained."""
    import structlog

    state = hub(prompts, "train.mini_batches=2", "train.ppo_epochs=2", "staleness.max_staleness=3")
    batch = _taken_batch(state)
    settle(_Facade(state), batch, 0, applied=3, failed=[2], log=structlog.get_logger())
    assert state.version == 3 and not state.training
    assert state.ledger.state_counts()["trained"] == 0 and state.ledger.counts["requeued_aborted"] == 4
    state = hub(prompts, "train.mini_batches=2", "train.ppo_epochs=2", "staleness.max_staleness=3")
    batch = _taken_batch(state)
    settle(_Facade(state), batch, 0, applied=4, failed=[], log=structlog.get_logger())
    assert state.version == 4 and state.ledger.state_counts()["trained"] == 4


def test_an_actor_still_holding_a_prompt_another_delivered_late_is_removed_cleanly():
    """b0 holds a prompt whose lapsed grant a0 then delivered late; it is trained and its epoch closes (the ledger
    drops a closed epoch's entries). Removing b0 must not look the prompt up in the ledger's entries: it did, and
    the KeyError ended the hub thread."""
    state = hub(PromptSet(addition_items()[:1], build_tokenizer()))  # one prompt per epoch: trained, its epoch closes
    (g,) = grant(state, A, "a0")
    state.tick(10.5)  # a0's lease lapsed: pending again, a0 may still deliver it late
    (g2,) = grant(state, B, "b0", now=10.6)
    key = (g.epoch, g.prompt_id)
    assert (g2.epoch, g2.prompt_id) == key
    assert not errors(state.handle(A, group_for(g), 11.0)) and len(state.buffer) == 1  # a0's late result is taken
    state.buffer.clear()
    state.ledger.trained(key)  # what the update's settle does
    assert key[0] in state.ledger.closed and state.ledger.holder(key) is None
    state.registry.connection_closed(B)  # b0 goes, still listing the prompt as held
    state.tick(12.0)
    assert "b0" not in state.actors
    state.ledger.check()
