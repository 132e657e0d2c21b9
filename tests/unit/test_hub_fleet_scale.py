"""The hub's rules at fleet scale, without a socket: what one message costs as the fleet grows, fair grants, and
a hung actor's leases (bench/hub_scale.py measures the same on the real hub).

Cost is counted, not timed: the actors the hub's state looks at per message, with 100 and with 1,000 actors.
"""

import pytest
from conftest import rollout_group

from deploy.tiny import build_tokenizer
from learner.data.prompts import PromptSet, addition_items
from learner.hub.core.state import HubState
from protocol import messages as m
from protocol.config import ConfigError, load_config


@pytest.fixture(scope="module")
def prompts():
    return PromptSet(addition_items()[:40], build_tokenizer())


def hub(prompts, *overrides):
    cfg = load_config(None, ["rollout.samples_per_prompt=3", "train.prompts_per_step=4", "staleness.max_staleness=1", *overrides])
    return HubState(cfg, prompts, now=0.0)


def conn(i):
    return f"conn-{i}".encode()


def grants(outs):
    return [(o.identity, o.msg) for o in outs if isinstance(o.msg, m.WorkGrant)]


class Counting(dict):
    """The actors dict, counting every entry looked at (an iteration counts each entry it yields)."""

    touched = 0

    def _count(self, it):
        for x in it:
            self.touched += 1
            yield x

    def items(self):
        return self._count(super().items())

    def values(self):
        return self._count(super().values())

    def keys(self):
        return self._count(super().keys())

    def __iter__(self):
        return self._count(super().__iter__())

    def get(self, key, default=None):
        self.touched += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.touched += 1
        return super().__getitem__(key)


def looked_at_per_message(prompts, n):
    """Actors looked at per work request or heartbeat, with `n` actors all asking and admission full."""
    state = hub(prompts, "hub.actor_timeout_s=1000", "hub.silent_s=1000")
    for i in range(n):
        state.handle(conn(i), m.Register(actor_id=f"a{i}", host="h", pid=1, served_version=0), 0.0)
        state.handle(conn(i), m.WorkRequest(actor_id=f"a{i}", max_prompts=8), 0.0)
    assert state.outstanding() == 8  # (k + 1) x prompts_per_step granted: no room until the learner trains
    actors = Counting(state.registry.actors)
    state.registry.actors = actors
    messages = 0
    for r in range(3):
        for i in range(0, n, max(1, n // 100)):  # 100 actors' requests and heartbeats, whatever the fleet
            state.handle(conn(i), m.WorkRequest(actor_id=f"a{i}", max_prompts=8), 1.0 + r)
            state.handle(conn(i), m.Heartbeat(actor_id=f"a{i}", served_version=0, groups_in_flight=0), 1.0 + r)
            messages += 2
    return actors.touched / messages


def test_a_message_costs_the_same_with_100_and_1000_actors(prompts):
    small, large = looked_at_per_message(prompts, 100), looked_at_per_message(prompts, 1000)
    # Each message looks its own actor up; a pump with no room looks at nobody (it walked every actor, sorted).
    assert small <= 2 and large <= 2, (small, large)


def test_every_actor_that_asks_is_granted_in_turn(prompts):
    """50 actors, 8 slots: each round every granted prompt comes back, the learner steps, every actor reports the
    new version in the order the hub sends it (HubState.sync_order) and asks again. A sort by load in registration
    order gave every grant to the first 8 actors; sending the version in sorted order served the first reporters."""
    n = 50
    state = hub(prompts)
    for i in range(n):
        state.handle(conn(i), m.Register(actor_id=f"a{i}", host="h", pid=1, served_version=0), 0.0)
    count = {f"a{i}": 0 for i in range(n)}
    held = []
    for r in range(20):
        t = 1.0 + r * 0.1
        for ident, grant in held:
            actor = ident.decode().replace("conn-", "a")
            group = rollout_group(
                n=3,
                actor=actor,
                prompt_id=grant.prompt_id,
                epoch=grant.epoch,
                prompt_tokens=grant.prompt_tokens,
                version=grant.policy_version,
            )
            assert state.handle(ident, group, t) == []  # admitted (a pump with the buffer full grants nothing)
        while (batch := state.take(4)) is not None:
            state.finish_update(state.version + 1, [item.key for item in batch])
        held = []
        for actor in state.sync_order(sorted(count)):  # as Hub.send_weight_sync sends the version, they report it
            report = m.WeightVersion(actor_id=actor, served_version=state.version, group_epoch=1, load_s=0.0)
            held += grants(state.handle(conn(int(actor[1:])), report, t))
        for i in range(n):
            held += grants(state.handle(conn(i), m.WorkRequest(actor_id=f"a{i}", max_prompts=2), t))
        for ident, _ in held:
            count[ident.decode().replace("conn-", "a")] += 1
    assert min(count.values()) >= 2 and max(count.values()) <= 3 * min(count.values()), count


def test_a_hung_actor_stops_holding_admission_after_silent_s(prompts):
    """A hung actor (socket open, silent) holds its share of the slots, a live one the rest and asks for more. After
    hub.silent_s its leases go back to the queue and the live actor gets them; its late groups count once at most."""
    state = hub(prompts, "hub.silent_s=4", "hub.actor_timeout_s=30")
    hung, live = conn(0), conn(1)
    state.handle(hung, m.Register(actor_id="hung", host="h", pid=1, served_version=0), 0.0)
    state.handle(live, m.Register(actor_id="live", host="h", pid=1, served_version=0), 0.0)
    held = grants(state.handle(hung, m.WorkRequest(actor_id="hung", max_prompts=8), 0.0))
    assert len(held) == 4  # its share: 8 slots, 2 actors
    assert len(grants(state.handle(live, m.WorkRequest(actor_id="live", max_prompts=8), 0.0))) == 4
    for t in (2.0, 4.0):  # the live one beats; the hung one is silent, not yet past 4 s
        state.handle(live, m.Heartbeat(actor_id="live", served_version=0, groups_in_flight=0), t)
        state.tick(t)
        assert grants(state.pump(t)) == []
    state.handle(live, m.Heartbeat(actor_id="live", served_version=0, groups_in_flight=0), 4.5)
    state.tick(4.5)
    regranted = grants(state.pump(4.5))
    assert len(regranted) == 4 and {i for i, _ in regranted} == {live}
    assert state.ledger.counts["requeued_silent"] == 4 and state.counters["actors_silent"] == 1
    assert "hung" in state.actors and state.actors["hung"].held == set()  # still registered: it may come back
    # It wakes and delivers one late group before the live actor, and one after: the first counts, the second not.
    first, second = held[0][1], held[1][1]
    late = [rollout_group(n=3, actor="hung", prompt_id=g.prompt_id, epoch=g.epoch, prompt_tokens=g.prompt_tokens) for g in (first, second)]
    assert state.handle(hung, late[0], 5.0) == [] and not state.actors["hung"].silent
    again = next(g for _, g in regranted if (g.epoch, g.prompt_id) == (second.epoch, second.prompt_id))
    mine = rollout_group(n=3, actor="live", prompt_id=again.prompt_id, epoch=again.epoch, prompt_tokens=again.prompt_tokens)
    assert state.handle(live, mine, 5.1) == []
    state.handle(hung, late[1], 5.2)
    assert state.ledger.counts["duplicates"] == 1 and len(state.buffer) == 2


def test_silent_s_must_exceed_the_heartbeat(prompts):
    with pytest.raises(ConfigError, match="hub.silent_s"):
        load_config(None, ["hub.heartbeat_s=2", "hub.silent_s=2"])


def test_listeners_hear_a_silent_actor_leave_and_come_back(prompts):
    """The weight sender stops waiting for a hung actor after hub.silent_s, not hub.actor_timeout_s (a broadcast it
    blocks is given up and retried without it), and serves it again when it is heard from."""
    state = hub(prompts, "hub.silent_s=4", "hub.actor_timeout_s=30")
    heard = []
    state.listeners.append(lambda actor, joined: heard.append((actor, joined)))
    for i, actor in enumerate(("hung", "live")):
        state.handle(conn(i), m.Register(actor_id=actor, host="h", pid=1, served_version=0), 0.0)
    assert heard == [("hung", True), ("live", True)] and state.registry.live() == ["hung", "live"]
    state.handle(conn(1), m.Heartbeat(actor_id="live", served_version=0, groups_in_flight=0), 3.0)
    state.tick(4.5)
    assert heard[2:] == [("hung", False)] and state.registry.live() == ["live"] and "hung" in state.actors
    state.tick(5.5)
    assert heard[3:] == []  # told once
    state.handle(conn(0), m.Heartbeat(actor_id="hung", served_version=0, groups_in_flight=0), 6.0)
    assert heard[3:] == [("hung", True)] and state.registry.live() == ["hung", "live"]
